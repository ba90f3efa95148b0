"""What `npuport generate` does: turn text prompts (through the model folder's tokenizer) or token ids into
requests, generate, and report token ids, text and acceptance statistics."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from npuport.devices import pick_device
from npuport.errors import NpuportError
from npuport.jsonfile import read_json_object
from npuport.runtime.generate import generate
from npuport.runtime.loader import load_model
from npuport.runtime.run_options import run_options
from npuport.runtime.sampling import SamplingParams
from npuport.tokenizer_folder import load_tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def parse_prompt_ids(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise NpuportError(f"--prompt-ids {text!r}: expected comma-separated integers such as 1,2,3") from None
    if not ids:
        raise NpuportError("--prompt-ids: empty prompt")
    return ids


def stop_token_ids(model_dir: Path) -> list[int]:
    """eos_token_id of generation_config.json, else of config.json (an id or a list of ids)."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            config = read_json_object(path)
            eos = config.get("eos_token_id", (config.get("text_config") or {}).get("eos_token_id"))
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []


def context_tokens_of(path: Path) -> int | None:
    """The model's context in tokens: `max_position_embeddings` of config.json (its `text_config` first, as
    ModelConfig reads the sizes); None when it states none."""
    config = read_json_object(path / "config.json")
    for section in (config.get("text_config") or {}, config):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


# The most tokens generate makes for a prompt when the model's config.json states no context: Qwen3.5's own.
UNSTATED_CONTEXT_TOKENS = 262_144


def check_length(model_dir: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """Refuse, before any memory is taken for them, `max_new_tokens` that would carry the longest prompt past the
    model's context (config.json's max_position_embeddings; UNSTATED_CONTEXT_TOKENS where it states none)."""
    context = context_tokens_of(model_dir)
    limit = context or UNSTATED_CONTEXT_TOKENS
    what = (f"the model's context ({limit:,} tokens, config.json max_position_embeddings)" if context else
            f"{limit:,} tokens (config.json states no max_position_embeddings; npuport's cap)")
    longest = max((len(p) for p in prompts), default=0)
    if longest + max_new_tokens > limit:
        room = f"at most {limit - longest:,}" if longest < limit else "the prompt alone fills it"
        raise NpuportError(f"--max-new-tokens {max_new_tokens:,}: the longest prompt ({longest:,} tokens) and the "
                           f"new tokens would exceed {what}; {room}")


def run_generate(model_dir: Path, texts: Sequence[str], id_prompts: Sequence[str], max_new_tokens: int, mtp: int,
                 sampling: SamplingParams, device: str | None, dtype: str, batch_invariant: bool | None = None,
                 dispatch: str | None = None) -> dict:
    """Generate for every --prompt and --prompt-ids; returns the report `npuport generate --json` prints."""
    model_dir = Path(model_dir)
    if dtype not in DTYPES:
        raise NpuportError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if not texts and not id_prompts:
        raise NpuportError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    tokenizer = load_tokenizer(model_dir)
    if texts and tokenizer is None:
        raise NpuportError(f"{model_dir} has no tokenizer; use --prompt-ids")
    prompts = [tokenizer.encode(t) for t in texts] + [parse_prompt_ids(s) for s in id_prompts]
    check_length(model_dir, prompts, max_new_tokens)
    model = load_model(model_dir, pick_device(device), DTYPES[dtype])
    options = run_options(model, mtp, invariant=batch_invariant, dispatch=dispatch)
    result = generate(model, prompts, max_new_tokens, options, sampling=sampling, stop_tokens=stop_token_ids(model_dir))
    requests = []
    for i, (prompt, tokens) in enumerate(zip(prompts, result.tokens, strict=True)):
        requests.append({
            "prompt": texts[i] if i < len(texts) else None,
            "prompt_ids": prompt,
            "token_ids": tokens,
            "text": tokenizer.decode(tokens) if tokenizer is not None else None,
            "finish_reason": result.finish_reasons[i],
        })
    return {
        "model": str(model_dir),
        "device": str(model.device),
        "devices": model.parallel.world,
        "batch_invariant": options.invariant,
        "dispatch": {True: "bf16", False: "int8", None: "auto"}[options.dispatch.bf16],
        "dtype": dtype,
        "mtp": mtp,
        "requests": requests,
        "acceptance": result.stats.to_dict() if result.stats is not None else None,
    }


def format_report(report: dict) -> str:
    """The report for a person: where it ran and in which dtype, each prompt's continuation, then the acceptance
    statistics."""
    lines = [f"{report['model']} on {report['device']} in {report['dtype']}"]
    for i, r in enumerate(report["requests"]):
        shown = r["text"] if r["text"] is not None else ",".join(map(str, r["token_ids"]))
        lines.append(f"[{i}] ({len(r['token_ids'])} tokens, {r['finish_reason']}) {shown}")
    acc = report["acceptance"]
    if acc is not None:
        rates = ", ".join(f"{x:.2f}" for x in acc["acceptance_rate_per_position"])
        lines.append(f"MTP k={acc['k']}: mean accepted length {acc['mean_accepted_length']:.2f}, "
                     f"acceptance per draft position [{rates}]")
    return "\n".join(lines)
