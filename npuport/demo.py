"""`npuport demo`: the whole job on a generated tiny model, printing where everything went."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from npuport.convert.check import check_artifact
from npuport.convert.converter import convert_qwen35
from npuport.errors import NpuportError
from npuport.tiny_checkpoint import TinySpec, make_tiny

MARKER = ".npuport-demo"


@dataclass
class DemoOutputs:
    workdir: Path
    source: Path
    artifact: Path


def prepare_workdir(workdir: Path) -> None:
    """Create `workdir`, or empty it if an earlier demo made it; never touch a folder the demo did not make."""
    if workdir.exists():
        if not (workdir / MARKER).exists():
            raise NpuportError(f"{workdir} exists and was not made by `npuport demo`; choose another --workdir")
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    (workdir / MARKER).write_text("made by npuport demo; removed and rebuilt by the next demo run\n")


def run_demo(workdir: Path, arch: str = "moe", log: Callable[[str], None] = print) -> DemoOutputs:
    workdir = Path(workdir)
    prepare_workdir(workdir)
    source = make_tiny(workdir / "source-bf16", TinySpec(arch=arch, layout="multimodal"))
    log(f"[1/3] tiny Qwen3.5 {arch} BF16 source with MTP head: {source}")
    result = convert_qwen35(source, workdir / "artifact-w8a8", show_progress=False, log=log)
    log(f"[2/3] W8A8 artifact ({len(result.plan.ignore_list)} layers kept BF16, listed in "
        f"npuport_manifest.json): {result.out}")
    problems = check_artifact(result.out)
    if problems:
        raise NpuportError("demo artifact fails the contract check:\n  " + "\n  ".join(problems))
    log(f"[3/3] npuport check {result.out}: OK")
    return DemoOutputs(workdir, source, result.out)
