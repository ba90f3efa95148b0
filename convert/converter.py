"""`npuport convert-qwen35 --a8w8`: a Qwen3.5 BF16 source folder -> an msModelSlim-format W8A8 artifact.

Everything is checked before a byte is written (source headers, recipe, disk space); the artifact is
built in a hidden folder beside OUT (npuport.output_folder), checked against the contract, and only then
swapped into place.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from npuport import __version__
from npuport.benchlog import Progress
from npuport.checksums import sha256_file
from npuport.convert.ascend_writer import (
    copied_files,
    planned_size,
    strip_quantization_config,
    write_description,
    write_json,
    write_shards,
)
from npuport.convert.check import check_artifact
from npuport.convert.engine_facts import EngineTarget
from npuport.convert.engine_rules import engine_problems
from npuport.convert.plan import Plan, Unit, build_plan
from npuport.convert.qwen35_names import layer_kinds
from npuport.convert.recipe import (
    FLOAT,
    W4A8_DYNAMIC,
    Recipe,
    checked_part_file_size,
    default_recipe_path,
    load_recipe,
)
from npuport.convert.source import INDEX_NAME, SourceCheckpoint, open_source
from npuport.errors import ArtifactError, CheckpointError, NpuportError, RecipeError
from npuport.output_folder import GB, MANIFEST_NAME, MANIFEST_TOOL, OutputFolder


@dataclass
class ConversionResult:
    out: Path
    plan: Plan
    recipe: Recipe
    seconds: float
    bytes_written: int


def source_identity(source: SourceCheckpoint, full_sha256: bool) -> dict[str, str]:
    """Checksums identifying the source. By default a fingerprint: sha256 of config.json, the index and
    every shard's size and safetensors header (cheap, exact for any renamed, resharded or re-exported
    source); with `full_sha256`, the sha256 of every shard's bytes as well (one more read of the source)."""
    h = hashlib.sha256()
    for p in sorted({source.path / "config.json", source.path / INDEX_NAME, *source.shard_files}):
        if not p.exists():
            continue
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with open(p, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if p.suffix == ".safetensors" else size - 8
            h.update(head + f.read(n))
    out = {"fingerprint_sha256": h.hexdigest()}
    if full_sha256:
        out.update({p.name: sha256_file(p) for p in source.shard_files})
    return out


def best_practice_name(src: Path) -> str:
    """`<ModelName>_best_practice.yaml`, ModelName from the source folder's name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", src.resolve().name) + "_best_practice.yaml"


def _manifest(src: SourceCheckpoint, recipe: Recipe, plan: Plan, source_checksums: dict[str, str],
              engine: EngineTarget | None) -> dict:
    return {
        "tool": MANIFEST_TOOL,
        "version": __version__,
        "command": f"convert-qwen35 {'--w4a8' if plan.scheme == W4A8_DYNAMIC else '--a8w8'}"
                   + (f" --engine {engine.engine}=={engine.version}" if engine else ""),
        "engine": {"name": engine.engine, "version": str(engine.version)} if engine else None,
        "scheme": plan.scheme,
        "schemes": plan.schemes,
        "source": {"name": src.path.resolve().name, "model_type": src.model_type, "checksums": source_checksums},
        "recipe": {"name": recipe.name, "file": recipe.source_name,
                   "sha256": hashlib.sha256(recipe.text.encode()).hexdigest(), "notes": recipe.notes},
        "quantized_layers": sum(1 for lab in plan.linear_labels.values() if lab.label != "FLOAT"),
        "ignore_list": [{"module": lab.module, "reason": lab.reason} for lab in plan.ignore_list],
    }


def convert_qwen35(
    src: Path,
    out: Path,
    *,
    recipe_path: Path | None = None,
    force: bool = False,
    workers: int = 1,
    skip_unsupported: bool = False,
    part_file_size_gb: float | None = None,
    show_progress: bool = True,
    full_sha256: bool = False,
    engine: EngineTarget | None = None,
    scheme: str | None = None,
    log: Callable[[str], None] = print,
) -> ConversionResult:
    """Convert the Qwen3.5 BF16 checkpoint in `src` into an msModelSlim-format artifact at `out` (W8A8_DYNAMIC, and
    W4A8_DYNAMIC experts where the recipe asks): what the recipe asks, as msModelSlim writes it; with `engine`, what
    that engine release cannot load quantized is kept FLOAT. `scheme`: the scheme the user asked for (`--w4a8`): a
    recipe and source that would write another are refused before anything is written."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    if part_file_size_gb is not None:
        part_file_size_gb = checked_part_file_size(part_file_size_gb, "--part-file-size")
    folder = OutputFolder(out, NpuportError, log)
    folder.prepare({"source": src}, force)
    source = open_source(src)
    broken = engine_problems(src, source.config, {name: tuple(e.shape) for name, e in source.entries.items()})
    if broken:  # the artifact would break them too: say so now, not after the whole conversion
        raise CheckpointError(f"{src} breaks rules the serving engines assert, and its artifact would too:\n  "
                              + "\n  ".join(broken))
    recipe = load_recipe(recipe_path or default_recipe_path(source.is_moe), allow_unsupported=skip_unsupported)
    for note in recipe.notes:
        log(f"recipe: {note}")
    part_bytes = int((recipe.part_file_size_gb if part_file_size_gb is None else part_file_size_gb) * GB)
    plan = build_plan(source, recipe, part_bytes, engine)
    if scheme is not None and plan.scheme != scheme:
        what = "a dense model has no routed experts" if not source.is_moe else "the recipe asks for no int4 layer"
        raise RecipeError(f"{recipe.path}: {scheme} asked for, but this conversion would write {plan.scheme} only "
                          f"({what})")
    _log_plan(plan, log)
    for pattern, rule in recipe.unmatched_includes(plan.linear_labels):  # a recipe for another model? a typo?
        log(f"warning: include pattern {pattern!r} ({rule.where}) matches no linear layer of this model")
    copies = copied_files(src)
    needed = planned_size(plan) + sum(p.stat().st_size for p in copies) + 1024 * 1024
    with folder.building(needed, "artifact") as tmp:
        total = sum(u.source_bytes for u in plan.units)
        n_tensors = sum(len(u.specs) for u in plan.units)
        done = [0]
        # a bar on a terminal, else a plain line every few seconds (a log, a pipe, a batch job)
        with Progress("convert", total, "GB of the source", scale=GB, enabled=show_progress) as bar:

            def progress(unit: Unit) -> None:
                done[0] += len(unit.specs)
                if bar.bar is not None:
                    bar.bar.set_postfix_str(f"{done[0]}/{n_tensors} tensors", refresh=False)
                bar.update(advance=unit.source_bytes)

            write_shards(plan, tmp, workers, progress)
        write_description(plan, tmp)
        write_json(tmp / "config.json", strip_quantization_config(source.config))
        for p in copies:
            shutil.copyfile(p, tmp / p.name)
        (tmp / best_practice_name(src)).write_text(recipe.text, encoding="utf-8")
        write_json(tmp / MANIFEST_NAME, _manifest(source, recipe, plan, source_identity(source, full_sha256), engine))
        problems = check_artifact(tmp)
        if problems:
            raise ArtifactError("the written artifact fails the contract check:\n  " + "\n  ".join(problems))
        folder.commit()
    written = sum(p.stat().st_size for p in out.iterdir())
    return ConversionResult(out, plan, recipe, time.perf_counter() - t0, written)


def _log_plan(plan: Plan, log: Callable[[str], None]) -> None:
    ignored = plan.ignore_list
    counts = Counter(lab.label for lab in plan.linear_labels.values() if lab.label != FLOAT)
    log(", ".join(f"{n} linear layers -> {scheme}" for scheme, n in sorted(counts.items()))
        + f", {len(ignored)} kept BF16 (ignore-list):")
    by_reason: dict[str, list[str]] = {}
    for lab in ignored:
        by_reason.setdefault(lab.reason, []).append(lab.module)
    for reason, modules in by_reason.items():  # each kind of layer named, as the model card lists them
        shown = ", ".join(f"{kind} ({n})" if n > 1 else kind for kind, n in layer_kinds(modules).items())
        log(f"  FLOAT {len(modules):4d}  {reason}: {shown}")
