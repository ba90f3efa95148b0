"""`npuport demo`: the whole job on a generated tiny model - make a source, convert, check, validate against the
source on a few GSM8K questions on CPU - printing where everything went."""

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
# A few questions and tokens: the demo shows the pipeline; a random-weight model scores ~0 whatever it runs.
DEMO_QUESTIONS = 4
DEMO_NEW_TOKENS = 16
DEMO_MTP = 2


@dataclass
class DemoOutputs:
    workdir: Path
    source: Path
    artifact: Path
    report: Path  # report.md; report.json, the plots and completions.jsonl beside it


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
    log(f"[1/4] tiny Qwen3.5 {arch} BF16 source with MTP head: {source}")
    result = convert_qwen35(source, workdir / "artifact-w8a8", show_progress=False, log=log)
    log(f"[2/4] W8A8 artifact ({len(result.plan.ignore_list)} layers kept BF16, listed in "
        f"npuport_manifest.json): {result.out}")
    problems = check_artifact(result.out)
    if problems:
        raise NpuportError("demo artifact fails the contract check:\n  " + "\n  ".join(problems))
    log(f"[3/4] npuport check {result.out}: OK")
    from npuport.runtime.validate import ValidateOptions, run_validation  # torch and the runtime: loaded late

    options = ValidateOptions(result.out, num_questions=DEMO_QUESTIONS, max_new_tokens=DEMO_NEW_TOKENS,
                              batch_size=DEMO_QUESTIONS, mtp=DEMO_MTP, reference=source, device="cpu")
    outcome = run_validation(options, workdir / "validation", log=lambda m: log(f"      {m}"))
    fidelity = outcome.report.fidelity
    gates = ", ".join(f"{g.name}: {'pass' if g.passed else 'FAIL'}" for g in outcome.report.gates)
    log(f"[4/4] npuport validate --gsm8k {result.out} --reference {source} ({DEMO_QUESTIONS} questions, CPU): "
        f"top-1 agreement with BF16 {fidelity.top1_agreement * 100:.1f} %, mean KL {fidelity.mean_kl:.3g}; {gates}; "
        f"report: {outcome.files.markdown}")
    return DemoOutputs(workdir, source, result.out, outcome.files.markdown)
