"""`npuport train-tiny`: train a small Qwen3.5 (the runtime's own model: GatedDeltaNet and full-attention
layers, dense or MoE) together with its MTP head on the GSM8K train split, and write it BF16 in make-tiny's
checkpoint layout (multimodal names, `mtp.*`, the make-tiny tokenizer).

Objective: next-token cross-entropy of the target + MTP_WEIGHT x the MTP head's cross-entropy on token
i + 2 (runtime/training.py). Weights are drawn per tensor from (seed, name), the data order from the seed,
and training runs with deterministic algorithms and a fixed thread count: on the CPU the same seed writes
the same bytes. On CUDA deterministic algorithms are warn-only, and two runs were measured to differ
(bench/RESULTS.md).
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn
from tqdm import tqdm

from npuport.convert.qwen35_names import FUSED_EXPERTS, text_prefix
from npuport.errors import NpuportError
from npuport.runtime.config import ModelConfig
from npuport.runtime.devices import pick_device
from npuport.runtime.loader import _checkpoint_name
from npuport.runtime.model import GatedDeltaNet, GatedRMSNorm, Qwen35, RMSNorm
from npuport.runtime.training import sequence_losses
from npuport.tiny_checkpoint import TensorValues, TinySpec, make_tiny, tensor_shapes, write_metadata
from npuport.tiny_tokenizer import gsm8k_train_texts

# DeepSeek-V3 weights its MTP loss 0.3 for most of training (0.1 at the end); 0.3 throughout here.
MTP_WEIGHT = 0.3
# Records are joined as the few-shot prompts of runtime/gsm8k.py join them, so those prompts are in
# distribution. The byte-level pre-tokenizer splits "\n\nQuestion" into "\n", "\n", "Question": encoding
# records one by one and joining them with the separator's tokens equals encoding the joined text.
RECORD_SEPARATOR = "\n\n"
INIT_STD = 0.02


@dataclass(frozen=True)
class TrainRecipe:
    """How one preset trains: `steps` AdamW steps of `batch_size` windows of `seq_len` tokens; the learning
    rate warms up linearly over `warmup` steps, then follows a cosine down to lr * min_lr_ratio."""

    model_size: str  # a make-tiny preset (tiny_checkpoint.PRESETS)
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = MTP_WEIGHT


RECIPES: dict[str, TrainRecipe] = {
    "tiny": TrainRecipe("trained-tiny", steps=600, batch_size=16, seq_len=256, lr=3e-3, warmup=40),
    "small": TrainRecipe("trained-small", steps=600, batch_size=32, seq_len=512, lr=1e-3, warmup=60),
}


@dataclass(frozen=True)
class TrainSpec:
    size: str = "tiny"  # a key of RECIPES
    arch: str = "dense"  # dense | moe
    seed: int = 0
    steps: int | None = None  # default: the recipe's
    threads: int | None = 2  # CPU threads while training (results depend on it); None: leave as is

    @property
    def recipe(self) -> TrainRecipe:
        recipe = RECIPES[self.size]
        return recipe if self.steps is None else replace(recipe, steps=self.steps)

    @property
    def checkpoint(self) -> TinySpec:
        return TinySpec(arch=self.arch, layout="multimodal", size=self.recipe.model_size, seed=self.seed)


@dataclass
class TrainResult:
    out: Path
    steps: int
    tokens: int
    seconds: float
    parameters: int  # text model + MTP head
    target_loss: float  # mean over the last LOSS_WINDOW steps
    mtp_loss: float


LOSS_WINDOW = 50


def trained_tiny_path() -> Path:
    """The trained tiny checkpoint shipped with the package (npuport/data/tiny-trained, README.md there)."""
    return Path(str(resources.files("npuport.data") / "tiny-trained"))


def encode_records(tokenizer: Tokenizer) -> tuple[list[list[int]], list[int]]:
    """Token ids of every GSM8K train record (question + worked answer) and of RECORD_SEPARATOR."""
    records = [e.ids for e in tokenizer.encode_batch(gsm8k_train_texts())]
    return records, tokenizer.encode(RECORD_SEPARATOR).ids


def token_batches(records: Sequence[Sequence[int]], separator: Sequence[int], batch_size: int, seq_len: int,
                  seed: int) -> Iterator[torch.Tensor]:
    """Endless batches [batch_size, seq_len] of int64 token ids: per epoch, the records in an order drawn from
    (seed, epoch), joined by `separator` into one stream and cut into consecutive windows."""
    epoch = 0
    while True:
        order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        stream = [t for i in order.tolist() for t in (*records[i], *separator)]
        n = len(stream) // seq_len
        if n < batch_size:
            raise NpuportError(f"the training data ({len(stream)} tokens) is shorter than one batch")
        windows = torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)
        for s in range(0, n - batch_size + 1, batch_size):
            yield windows[s : s + batch_size]
        epoch += 1


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


@torch.no_grad()
def init_weights(model: Qwen35, seed: int) -> None:
    """Training initialisation, each tensor from its own generator seeded by (seed, name): matrices and
    embeddings N(0, INIT_STD); the depthwise conv as nn.Conv1d's default range; (1 + w) RMSNorms 0, the GDN
    output norm 1; A_log = log U(1, 16) and dt_bias = 1 as transformers initialises Qwen3.5."""
    for module_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{leaf}" if module_name else leaf
            g = _generator(seed, name)
            if isinstance(module, RMSNorm):
                value = torch.zeros(param.shape)
            elif isinstance(module, GatedRMSNorm) or (isinstance(module, GatedDeltaNet) and leaf == "dt_bias"):
                value = torch.ones(param.shape)
            elif isinstance(module, GatedDeltaNet) and leaf == "A_log":
                value = torch.log(torch.rand(param.shape, generator=g) * 15 + 1)
            elif isinstance(module, nn.Conv1d):
                bound = 1 / math.sqrt(param.shape[-1])
                value = (torch.rand(param.shape, generator=g) * 2 - 1) * bound
            else:
                value = torch.randn(param.shape, generator=g) * INIT_STD
            param.copy_(value)


def new_model(config: ModelConfig, seed: int, device: torch.device) -> Qwen35:
    """A float32 Qwen35 with its MTP head, initialised by init_weights, every parameter trainable."""
    model = Qwen35(config, with_mtp=True)
    init_weights(model, seed)
    return model.to(device).requires_grad_(True).train()


def _optimizer(model: Qwen35, recipe: TrainRecipe) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms, gates' A_log / dt_bias or the conv)."""
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if p.dim() != 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8)


def learning_rate(recipe: TrainRecipe, step: int) -> float:
    """The rate of step `step` (0-based): linear warmup, then cosine to lr * min_lr_ratio at the last step."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - 1 - recipe.warmup)
    low = recipe.lr * recipe.min_lr_ratio
    return low + 0.5 * (recipe.lr - low) * (1 + math.cos(math.pi * min(1.0, progress)))


def checkpoint_values(model: Qwen35, names: Sequence[str]) -> TensorValues:
    """`weights` for make_tiny: each checkpoint tensor (names: all of them, for the layout's prefix) from the
    model's parameters, experts fused into `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`, in BF16."""
    prefix = text_prefix(names)
    params = {_checkpoint_name(n, prefix): p.detach().float().cpu() for n, p in model.named_parameters()}

    def value(name: str, shape: tuple) -> torch.Tensor:
        fused = FUSED_EXPERTS.match(name)
        if fused is None:
            tensor = params[name]
        else:
            experts = [f"{fused['experts']}.{e}." for e in range(shape[0])]
            if fused["kind"] == "down_proj":
                tensor = torch.stack([params[e + "down_proj.weight"] for e in experts])
            else:
                tensor = torch.stack([torch.cat([params[e + "gate_proj.weight"], params[e + "up_proj.weight"]])
                                      for e in experts])
        if tuple(tensor.shape) != tuple(shape):
            raise AssertionError(f"{name}: trained tensor is {list(tensor.shape)}, the layout says {list(shape)}")
        return tensor.to(torch.bfloat16)

    return value


@contextlib.contextmanager
def deterministic(device: torch.device, threads: int | None) -> Iterator[None]:
    """Deterministic algorithms (warn-only off the CPU, where some kernels have none) and `threads` CPU threads
    inside the block; the previous settings afterwards."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.get_num_threads())
    torch.use_deterministic_algorithms(True, warn_only=device.type != "cpu")
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.set_num_threads(before[2])


def train_model(model: Qwen35, batches: Iterator[torch.Tensor], recipe: TrainRecipe,
                on_step: Callable[[int, float, float], None] | None = None) -> tuple[list[float], list[float]]:
    """Run recipe.steps optimizer steps on `model`; returns the target and MTP losses of every step.
    On CUDA the forward runs under BF16 autocast (float32 master weights)."""
    device = model.device
    optimizer = _optimizer(model, recipe)
    target_losses, mtp_losses = [], []
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(recipe, step)
        tokens = next(batches).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            losses = sequence_losses(model, tokens)
            loss = losses.total(recipe.mtp_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        target_losses.append(float(losses.target.detach()))
        mtp_losses.append(float(losses.mtp.detach()))
        if on_step is not None:
            on_step(step, target_losses[-1], mtp_losses[-1])
    return target_losses, mtp_losses


def train_tiny(out: Path, spec: TrainSpec = TrainSpec(), device: str | None = None, show_progress: bool = True,
               log: Callable[[str], None] = lambda _: None) -> TrainResult:
    """Train the preset `spec.size` (dense or MoE) on GSM8K train and write it to the new folder `out`."""
    out = Path(out)
    if out.exists():
        raise NpuportError(f"{out} already exists; choose a new folder")
    if spec.size not in RECIPES:
        raise NpuportError(f"unknown train-tiny preset {spec.size!r}; choose one of {', '.join(RECIPES)}")
    recipe, layout = spec.recipe, spec.checkpoint
    if recipe.steps < 1:
        raise NpuportError(f"train-tiny needs at least one step, got {recipe.steps}")
    dev = pick_device(device)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        config = ModelConfig.from_dict(write_metadata(Path(tmp), layout))
        tokenizer = Tokenizer.from_file(str(Path(tmp) / "tokenizer.json"))
    records, separator = encode_records(tokenizer)
    with deterministic(dev, spec.threads):
        torch.manual_seed(spec.seed)
        model = new_model(config, spec.seed, dev)
        parameters = sum(p.numel() for p in model.parameters())
        log(f"training {spec.arch} {spec.size} ({parameters / 1e6:.2f}M parameters) on {dev} for {recipe.steps} "
            f"steps of {recipe.batch_size} x {recipe.seq_len} tokens, MTP loss weight {recipe.mtp_weight}")
        bar = tqdm(total=recipe.steps, disable=not show_progress, desc="train-tiny", unit="step")

        def on_step(step: int, target: float, mtp: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{target:.3f}", mtp=f"{mtp:.3f}", refresh=False)

        batches = token_batches(records, separator, recipe.batch_size, recipe.seq_len, spec.seed)
        try:
            target_losses, mtp_losses = train_model(model, batches, recipe, on_step)
        finally:
            bar.close()
    names = [name for name, _ in tensor_shapes(layout, config.vocab_size)]
    make_tiny(out, layout, weights=checkpoint_values(model, names))
    tail = slice(-min(LOSS_WINDOW, recipe.steps), None)
    return TrainResult(out, recipe.steps, recipe.steps * recipe.batch_size * recipe.seq_len,
                       time.perf_counter() - start, parameters,
                       sum(target_losses[tail]) / len(target_losses[tail]),
                       sum(mtp_losses[tail]) / len(mtp_losses[tail]))
