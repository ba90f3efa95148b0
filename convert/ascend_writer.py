"""Write a plan as an msModelSlim ascendV1 artifact (CONTRACT.md): shards and their index, the
description with a label for every tensor, the config without quantization_config, copied tokenizer and
config files, the recipe as `<ModelName>_best_practice.yaml`, and npuport's manifest."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from npuport.convert.plan import BLOCK_BYTES, Plan, Unit
from npuport.convert.safetensors_io import ShardReader, ShardWriter, shard_file_size
from npuport.output_folder import signals_held

DESCRIPTION_NAME = "quant_model_description.json"
INDEX_NAME = "quant_model_weights.safetensors.index.json"
SHARD_METADATA = {"format": "pt"}
DESCRIPTION_GLOBALS = {"version": "1.0.0", "model_quant_type": "W8A8_DYNAMIC", "metadata": {}, "group_size": 0,
                       "optional": {}}
COPIED_SUFFIXES = (".json", ".py", ".txt", ".jinja", ".model", ".tiktoken")
COPIED_PREFIXES = ("LICENSE", "NOTICE")


def shard_names(n: int) -> list[str]:
    """The shards' names as msModelSlim 26.1's ascendV1 saver writes them: numbered even when there is one."""
    return [f"quant_model_weights-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]


def planned_size(plan: Plan) -> int:
    """Bytes the shards will take on disk (headers included)."""
    return sum(shard_file_size([s for u in shard for s in u.specs], SHARD_METADATA) for shard in plan.shards)


class _StopWriting(Exception):
    """Raised in a worker at its next block once the conversion stops (Ctrl-C, SIGTERM, another shard failed)."""


def write_shards(plan: Plan, out: Path, workers: int, on_unit: Callable[[Unit], None]) -> None:
    """Write every shard of `plan` into `out`; `workers` shards at a time, the same bytes for any count.
    `on_unit` is called (under a lock) after each unit is written, for progress. When the writing stops - an
    error, or Ctrl-C / SIGTERM in the main thread - no queued shard is started and the running ones stop at
    their next block, before this returns (or raises)."""
    names = shard_names(len(plan.shards))
    reader = ShardReader()
    lock = threading.Lock()
    stop = threading.Event()

    def advance(unit: Unit) -> None:
        with lock:
            on_unit(unit)

    def write_one(k: int) -> None:
        units: list[Unit] = plan.shards[k]
        writer = ShardWriter(out / names[k], [s for u in units for s in u.specs], SHARD_METADATA)
        block = torch.empty(BLOCK_BYTES, dtype=torch.uint8)  # this shard's read buffer; pages touched only when used
        try:
            for u in units:
                for name, piece in u.produce(reader, block):
                    if stop.is_set():
                        raise _StopWriting
                    writer.write(name, piece)
                advance(u)
        except BaseException:
            writer.abort()
            raise
        writer.close()

    try:
        if workers <= 1:
            for k in range(len(names)):
                write_one(k)
        else:
            _write_in_pool(write_one, len(names), workers, stop)
    finally:
        reader.close()
    weight_map = {s.name: names[k] for k, shard in enumerate(plan.shards) for u in shard for s in u.specs}
    index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map}
    write_json(out / INDEX_NAME, index)


def _write_in_pool(write_one: Callable[[int], None], n: int, workers: int, stop: threading.Event) -> None:
    """write_one(0..n-1) on `workers` threads. On the first failure, or an interrupt of the waiting main thread,
    the queued calls are cancelled and `stop` set, and the running ones are waited for (signals held meanwhile:
    they stop within a block, and the partial folder must not be removed under them)."""
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        futures = [pool.submit(write_one, k) for k in range(n)]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f.done() and f.exception() is not None), None)
        if failed is not None:
            failed.result()
    except BaseException:
        stop.set()
        with signals_held():
            pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def write_description(plan: Plan, out: Path) -> None:
    desc = dict(plan.description)
    desc.update(DESCRIPTION_GLOBALS)
    write_json(out / DESCRIPTION_NAME, desc)


def strip_quantization_config(config: dict) -> dict:
    """The source config without `quantization_config`, at the top level and inside `text_config`."""
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = {k: v for k, v in config["text_config"].items() if k != "quantization_config"}
    return config


def copied_files(src: Path) -> list[Path]:
    """Top-level config, tokenizer and license files to copy unchanged (never an `*index.json`)."""
    out = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name.endswith("index.json") or p.name == "config.json":
            continue
        if p.name.endswith(COPIED_SUFFIXES) or p.name.startswith(COPIED_PREFIXES):
            out.append(p)
    return out


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

