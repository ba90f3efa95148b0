"""The model checks of `npuport selftest`: the trained tiny model shipped with npuport (npuport/data/tiny-trained,
dense, with an MTP head) generates greedily on the device, with and without captured graphs and with MTP k = 1..3,
and every run must give plain greedy decoding's tokens exactly."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from npuport.devices import graphs_supported
from npuport.runtime.generate import generate
from npuport.runtime.loader import load_model
from npuport.runtime.selftest.timing import wait_for

# GSM8K-style prompts, as the tiny model was trained on.
PROMPTS = (
    "Question: Tom has 3 boxes of 12 pencils and gives away 7 pencils. How many pencils does he have left?\nAnswer:",
    "Question: A baker sells 24 cakes a day for 5 days. How many cakes does she sell?\nAnswer:",
)
MTP_DRAFTS = (1, 2, 3)
MODEL_RUNS = 2 + len(MTP_DRAFTS)  # what model_runs yields: greedy, graphs vs eager, one per draft count


def tiny_model_path() -> Path:
    """The trained tiny checkpoint shipped in npuport.data (its README.md says how it was made)."""
    return Path(str(resources.files("npuport.data") / "tiny-trained"))


def prompt_ids(model_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in PROMPTS]


@dataclass
class ModelRun:
    """One generation of the tiny model and its tokens against plain greedy decoding's: `differing` new tokens of
    `total` differ (a shorter or longer run counts its extra positions); passed None: not run here (`note` says
    why)."""

    name: str  # e.g. "greedy, graphs vs eager", "MTP k=2 vs greedy"
    shape: str
    graphs: bool  # whether its steps ran as captured graphs
    differing: int | None
    ms: float | None
    passed: bool | None
    note: str | None = None


def differing_tokens(got: list[list[int]], want: list[list[int]]) -> int:
    """Positions where two batches of token lists differ, a missing or extra token counting as one."""
    return sum(sum(a != b for a, b in zip(g, w, strict=False)) + abs(len(g) - len(w))
               for g, w in zip(got, want, strict=True))


def _timed(fn: Callable[[], list[list[int]]], device: torch.device) -> tuple[list[list[int]], float]:
    wait_for(device)
    start = time.perf_counter()
    tokens = fn()
    wait_for(device)
    return tokens, (time.perf_counter() - start) * 1e3


def model_runs(device: torch.device, new_tokens: int) -> Iterator[ModelRun]:
    """Greedy generation of the tiny model in bfloat16 on `device`: with graphs (where the device captures them)
    against without, then MTP k = 1..3 against plain greedy. Batch-invariant steps in every run (where the Triton
    kernels run: elsewhere the references do), so that a verify step rounds as the decode steps it stands for."""
    model_dir = tiny_model_path()
    model = load_model(model_dir, device, torch.bfloat16)
    prompts = prompt_ids(model_dir)
    shape = f"tiny-trained bfloat16, {len(prompts)} prompts x {new_tokens} new tokens"

    def run(mtp: int = 0, graphs: bool | None = None) -> list[list[int]]:
        return generate(model, prompts, new_tokens, mtp=mtp, graphs=graphs, invariant=True).tokens

    graphs = graphs_supported(device)
    greedy, greedy_ms = _timed(lambda: run(graphs=False), device)
    yield ModelRun("greedy (eager)", shape, False, 0, greedy_ms, True)
    if graphs:
        captured, ms = _timed(lambda: run(graphs=True), device)
        wrong = differing_tokens(captured, greedy)
        yield ModelRun("greedy, graphs vs eager", shape, True, wrong, ms, wrong == 0)
    else:
        yield ModelRun("greedy, graphs vs eager", shape, False, None, None, None, "not supported here")
    for k in MTP_DRAFTS:  # with graphs where the device captures them
        tokens, ms = _timed(lambda k=k: run(mtp=k), device)
        wrong = differing_tokens(tokens, greedy)
        yield ModelRun(f"MTP k={k} vs greedy", shape, graphs, wrong, ms, wrong == 0)
