"""`npuport demo`: the whole job on a small Qwen3.5 - take a BF16 source with its MTP head, convert it to W8A8,
check it, validate it against the source on CPU, package and verify the release - printing where everything went.

The questions are the shipped held-out arithmetic word problems in GSM8K's format (fixtures/arithmetic.py), not
GSM8K: the shipped model (1.8M parameters) solves them, and scores about 0 % on GSM8K, where accuracy, its paired
difference and the accuracy gate would show nothing. `npuport validate --gsm8k` runs GSM8K by default."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from npuport.convert.check import check_artifact
from npuport.convert.converter import convert_qwen35
from npuport.errors import NpuportError
from npuport.fixtures.arithmetic import arithmetic_path
from npuport.fixtures.tiny_checkpoint import TinySpec, make_tiny

MARKER = ".npuport-demo"
MODELS = ("trained", "random-dense", "random-moe")
# 32 questions and 64 tokens (the longest worked answer is 55 tokens) keep the demo to a minute or two on two
# cores. The demo gates MTP acceptance and the paired accuracy drop, both meaningful on the trained model.
DEMO_QUESTIONS = 32
DEMO_NEW_TOKENS = 64
DEMO_MTP = 2
DEMO_MAX_ACCURACY_DROP = 5.0  # points; on 32 questions one question is 3.1
DEMO_MIN_ACCEPTANCE = 1.5  # mean acceptance length; random weights give 1.0
# On CPU the runtime computes in float32: without BF16 matrix units a CPU emulates BF16 GEMMs (measured on two
# cores: a 5-shot prefill of 8 prompts 2.45 s in bfloat16, 0.67 s in float32).
DEMO_DTYPE = "float32"
DEMO_BASE_MODEL = "npuport-tiny-qwen3.5-"  # + the --model choice: the model the card's title and front matter name


@dataclass
class DemoOutputs:
    workdir: Path
    source: Path
    artifact: Path
    report: Path  # report.md; report.json, the plots and completions.jsonl beside it
    release: Path


def prepare_workdir(workdir: Path) -> None:
    """Create `workdir`, or empty it if an earlier demo made it; never touch a folder the demo did not make."""
    if workdir.exists():
        if not (workdir / MARKER).exists():
            raise NpuportError(f"{workdir} exists and was not made by `npuport demo`; choose another --workdir")
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    (workdir / MARKER).write_text("made by npuport demo; removed and rebuilt by the next demo run\n")


def demo_source(model: str, out: Path) -> tuple[Path, str]:
    """The demo's BF16 source in `out`: the trained tiny checkpoint shipped with npuport, or random weights."""
    if model == "trained":
        from npuport.fixtures.train_tiny import trained_tiny_path

        shutil.copytree(trained_tiny_path(), out, ignore=shutil.ignore_patterns("README.md"))
        return out, ("trained tiny Qwen3.5 (dense, 1.8M parameters, trained with its MTP head on GSM8K text and "
                     "arithmetic word problems)")
    arch = model.removeprefix("random-")
    return make_tiny(out, TinySpec(arch=arch, layout="multimodal")), f"tiny Qwen3.5 {arch} with random weights"


def run_demo(workdir: Path, model: str = "trained", log: Callable[[str], None] = print) -> DemoOutputs:
    workdir = Path(workdir)
    prepare_workdir(workdir)
    source, what = demo_source(model, workdir / "source-bf16")
    log(f"[1/5] BF16 source with MTP head, {what}: {source}")
    result = convert_qwen35(source, workdir / "artifact-w8a8", show_progress=False, log=log)
    log(f"[2/5] W8A8 artifact ({len(result.plan.ignore_list)} layers kept BF16, listed in "
        f"npuport_manifest.json): {result.out}")
    problems = check_artifact(result.out)
    if problems:
        raise NpuportError("demo artifact fails the contract check:\n  " + "\n  ".join(problems))
    log(f"[3/5] npuport check {result.out}: OK")

    from npuport.release.package import package_release  # torch and the runtime: loaded late
    from npuport.release.verify import verify_release
    from npuport.runtime.validation.gates import CHANCE
    from npuport.runtime.validation.validate import ValidateOptions, run_validation

    trained = model == "trained"
    options = ValidateOptions(result.out, data=arithmetic_path(), num_questions=DEMO_QUESTIONS,
                              max_new_tokens=DEMO_NEW_TOKENS, batch_size=DEMO_QUESTIONS, mtp=DEMO_MTP, reference=source,
                              device="cpu", dtype=DEMO_DTYPE,
                              max_accuracy_drop=DEMO_MAX_ACCURACY_DROP if trained else None,
                              min_accuracy=CHANCE if trained else None,
                              min_acceptance=DEMO_MIN_ACCEPTANCE if trained else None)
    outcome = run_validation(options, workdir / "validation", log=lambda m: log(f"      {m}"))
    report = outcome.report
    fidelity, mtp, accuracy = report.fidelity, report.mtp, report.accuracy[0]
    gates = ", ".join(f"{g.name}: {'pass' if g.passed else 'FAIL'}" for g in report.gates) or "no gates"
    log(f"[4/5] npuport validate --gsm8k {result.out} --data <shipped arithmetic problems> --reference {source} "
        f"--mtp {DEMO_MTP} ({DEMO_QUESTIONS} held-out questions, CPU): accuracy W8A8 "
        f"{accuracy.candidate.accuracy * 100:.1f} %, BF16 {accuracy.reference.accuracy * 100:.1f} %; greedy token "
        f"agreement of W8A8 with BF16 {fidelity.greedy_token_agreement * 100:.1f} %, top-1 agreement "
        f"{fidelity.top1_agreement * 100:.1f} %, mean KL {fidelity.mean_kl:.3g}, MTP mean acceptance length "
        f"{mtp.mean_acceptance_length:.2f}; {gates}; report: {outcome.files.markdown}")
    release = package_release(result.out, workdir / "release", outcome.files.json, base_model=DEMO_BASE_MODEL + model,
                              log=lambda m: log(f"      {m}"))
    problems = verify_release(release)
    if problems:
        raise NpuportError("demo release fails verify-release:\n  " + "\n  ".join(problems))
    log(f"[5/5] npuport package + verify-release: OK; model card: {release / 'README.md'}")
    return DemoOutputs(workdir, source, result.out, outcome.files.markdown, release)
