"""npuport package / verify-release: a release passes its own checks, and each kind of damage is caught and named;
the model card states the report's figures (the numbers this test chooses), its front matter parses, failed
gates and failing artifacts are refused, and a failure leaves nothing behind."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
from collections import Counter
from html import escape
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import npuport
from npuport.checksums import copy_with_sha256
from npuport.cli import main
from npuport.convert.converter import convert_qwen35
from npuport.fixtures.tiny_checkpoint import TinySpec, make_tiny
from npuport.release.package import ReleaseError, package_release
from npuport.release.verify import verify_release
from npuport.runtime.validation.gsm8k import AISBenchProtocol, GSM8KRecord
from npuport.runtime.validation.report import (
    AccuracyRow,
    Fidelity,
    Gate,
    MTPAcceptance,
    ThroughputRun,
    ValidationReport,
)
from npuport.runtime.validation.report_files import write_report

SOURCE_NAME = "Qwen3.5-tiny"
LICENSE_TEXT = "                                 Apache License\n                           Version 2.0, January 2004\n"
RECORDS = [GSM8KRecord(f"Q{i}?", f"w\n#### {g}") for i, g in enumerate([18, 3, 70, 5, 12])]
# The figures below follow from the completions: W8A8 right on 3 of 5 (60 %), one without a number (20 %
# invalid); BF16 right on 4 of 5 (80 %); 200 tokens in 4 s = 50 tok/s.
CANDIDATE = ["answer: 18", "answer: 4", "answer: 70", "no idea", "answer: 12"]
REFERENCE = ["answer: 18", "answer: 3", "answer: 70", "answer: 6", "answer: 12"]
EXPECTED_ROWS = [
    "| GSM8K accuracy % (accuracy) | aisbench, 0-shot | 5 | 60.00 | 80.00 | -20.00 |",
    "| GSM8K invalid % | aisbench, 0-shot | 5 | 20.00 | 0.00 | – |",
    "| GSM8K output tok/s on CPU | aisbench, 0-shot | 5 | 50.0 | – | – |",
    "| mean KL divergence | vs BF16, 8 prompts | – | 0.0123 | – | – |",
    "| lowest per-layer output cosine | vs BF16, 8 prompts | – | 0.99870 | – | – |",
    "| decode tok/s on CPU | no MTP, MTP off, batch 1 | – | 20.0 | – | – |",
    "| decode tok/s on CPU | MTP k=3, MTP on, batch 1 | – | 45.0 | – | – |",
    "| MTP mean acceptance length | k=3, 120 rounds | – | 2.50 | – | – |",
    "| MTP acceptance rate, draft position 2 | k=3, 120 rounds | – | 0.460 | – | – |",
]


def silent(_: str) -> None:
    pass


# What validate records: the question set's name and its command line (paths as given on the machine that ran it)
VALIDATE_COMMAND = ("npuport validate --gsm8k /models/Qwen3.5-tiny-w8a8 --protocol aisbench --num-questions 5 "
                    "--max-new-tokens 64 --reference /models/Qwen3.5-tiny --data /sets/gsm8k/test.jsonl "
                    "--out /runs/report")


def make_report(out: Path, gate_passed: bool = True, mtp_k: int | None = 3, questions: str = "GSM8K",
                device: str = "cpu (test)") -> Path:
    protocol = AISBenchProtocol(RECORDS)
    candidate = protocol.score(CANDIDATE, latency_s=4.0, completion_tokens=200)
    reference = protocol.score(REFERENCE)
    report = ValidationReport(
        artifact=f"{SOURCE_NAME}-w8a8", device=device, seed=7,
        settings={"questions_name": questions, "command": VALIDATE_COMMAND},
        accuracy=[AccuracyRow.paired(candidate, reference, seed=7, resamples=200)],
        fidelity=Fidelity(greedy_token_agreement=0.97, top1_agreement=0.985, mean_kl=0.0123,
                          layer_cosine=[0.9991, 0.9987, 0.9995], num_prompts=8, num_tokens=512),
        throughput=[ThroughputRun("no MTP", mtp=False, batch_size=1, decode_tokens_per_s=20.0),
                    ThroughputRun("MTP k=3", mtp=True, batch_size=1, decode_tokens_per_s=45.0,
                                  num_speculative_tokens=3)],
        mtp=None if mtp_k is None else MTPAcceptance(num_speculative_tokens=mtp_k, mean_acceptance_length=2.5,
                                                     per_position=[0.85, 0.46, 0.19][:mtp_k], num_rounds=120),
        gates=[Gate("max-accuracy-drop 1.0 points", gate_passed, "W8A8 -20.00 vs BF16")])
    return write_report(report, out).json


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("release-inputs")
    src = make_tiny(root / SOURCE_NAME, TinySpec())
    (src / "LICENSE").write_text(LICENSE_TEXT, encoding="utf-8")
    art = root / f"{SOURCE_NAME}-w8a8"
    convert_qwen35(src, art, show_progress=False, log=silent)
    return {"source": src, "artifact": art, "report": make_report(root / "report"),
            "failed_report": make_report(root / "failed-report", gate_passed=False)}


@pytest.fixture(scope="module")
def release(inputs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("releases") / f"{SOURCE_NAME}-W8A8"
    return package_release(inputs["artifact"], out, inputs["report"], log=silent)


@pytest.fixture
def damaged(release: Path, tmp_path: Path) -> Path:
    """A fresh copy of the packaged release, for a test to damage."""
    return Path(shutil.copytree(release, tmp_path / release.name))


def card_of(folder: Path) -> str:
    return (folder / "README.md").read_text(encoding="utf-8")


def front_matter_and_body(card: str) -> tuple[dict, str]:
    assert card.startswith("---\n")
    head, body = card[4:].split("\n---\n", 1)
    return yaml.safe_load(head), body


# ---------------------------------------------------------------------------------------------------------
# A sound release


def test_packaged_release_passes_verify_release(release: Path) -> None:
    assert verify_release(release) == []


def test_release_holds_the_artifact_report_license_and_checksums(release: Path, inputs: dict[str, Path]) -> None:
    art = inputs["artifact"]
    for p in art.iterdir():
        assert (release / p.name).read_bytes() == p.read_bytes(), p.name
    assert (release / "LICENSE").read_text(encoding="utf-8") == LICENSE_TEXT
    assert (release / f"{SOURCE_NAME}_best_practice.yaml").is_file()
    assert (release / "npuport_manifest.json").is_file()
    report_dir = inputs["report"].parent
    for name in ("report.json", "report.md", "accuracy.png", "mtp_acceptance.png", "throughput.png"):
        assert (release / "validation" / name).read_bytes() == (report_dir / name).read_bytes(), name
    assert not any(release.glob("model*.safetensors*"))

    files = sorted(p.relative_to(release).as_posix() for p in release.rglob("*")
                   if p.is_file() and p.name != "SHA256SUMS")
    lines = (release / "SHA256SUMS").read_text(encoding="utf-8").splitlines()
    assert lines == [f"{hashlib.sha256((release / f).read_bytes()).hexdigest()}  {f}" for f in files]


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="coreutils sha256sum not installed")
def test_sha256sums_is_checked_by_coreutils(release: Path) -> None:
    done = subprocess.run(["sha256sum", "--check", "--strict", "SHA256SUMS"], cwd=release, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------------------------------------------------
# The model card


def test_card_front_matter_parses_with_license_base_model_and_tags(release: Path) -> None:
    meta, _ = front_matter_and_body(card_of(release))
    assert meta["license"] == "apache-2.0"
    assert meta["base_model"] == SOURCE_NAME
    assert meta["base_model_relation"] == "quantized"
    assert {"w8a8", "int8", "msmodelslim", "ascend", "mtp", "qwen3_5"} <= set(meta["tags"])


def test_card_results_table_states_the_reports_figures(release: Path) -> None:
    card = card_of(release)
    assert "| measure | protocol | questions | W8A8 | BF16 | difference |" in card
    for row in EXPECTED_ROWS:
        assert row in card
    assert "- pass: max-accuracy-drop 1.0 points (W8A8 -20.00 vs BF16)" in card
    assert "seed 7" in card and "cpu (test)" in card and "report written" in card
    for plot in ("accuracy", "mtp_acceptance", "throughput"):
        assert f"![{plot}](validation/{plot}.png)" in card


def test_card_renders_as_markdown_with_table_and_serving_commands(release: Path) -> None:
    markdown_it = pytest.importorskip("markdown_it")
    _, body = front_matter_and_body(card_of(release))
    html = markdown_it.MarkdownIt("commonmark").enable("table").render(body)
    assert "<table>" in html and "<td>60.00</td>" in html and "<td>-20.00</td>" in html
    code = [block for block in html.split("<code")[1:]]
    vllm = next(c for c in code if "vllm serve" in c)
    assert f"vllm serve ./{release.name} --quantization ascend" in vllm
    assert "&quot;method&quot;:&quot;qwen3_5_mtp&quot;,&quot;num_speculative_tokens&quot;:3" in vllm
    sglang = next(c for c in code if "sglang.launch_server" in c)
    for flag in ("--device npu", "--attention-backend ascend", "--quantization modelslim",
                 "--speculative-algorithm NEXTN", "--speculative-num-steps 3", "--speculative-eagle-topk 1",
                 "--speculative-num-draft-tokens 4", "--speculative-draft-model-quantization unquant"):
        assert flag in sglang


def _serving_section(card: str) -> str:
    return card.split("## Serving", 1)[1].split("\n## ", 1)[0]


def test_card_serves_with_the_draft_tokens_the_report_validated(inputs: dict[str, Path], tmp_path: Path) -> None:
    """Validated with k=2: the card's commands draft 2 tokens (sglang: 2 steps, 3 draft tokens), whatever a
    constant says; a report without MTP gives no number, only the variable K to set."""
    for k in (2, None):
        report = make_report(tmp_path / f"report-{k}", mtp_k=k)
        validated = json.loads(report.read_text(encoding="utf-8")).get("mtp")
        assert (validated or {}).get("num_speculative_tokens") == k
        serving = _serving_section(card_of(package_release(inputs["artifact"], tmp_path / f"release-{k}", report,
                                                           log=silent)))
        if k is None:
            assert '"num_speculative_tokens":\'"$K"\'' in serving and "--speculative-num-steps $K " in serving
            assert "--speculative-num-draft-tokens $((K + 1))" in serving and "measured no MTP" in serving
            continue
        assert f'"num_speculative_tokens":{k}}}' in serving and "(2 draft tokens, as validated" in serving
        assert f"--speculative-num-steps {k} " in serving and f"--speculative-num-draft-tokens {k + 1} " in serving
        assert "3 draft tokens" not in serving and "num_speculative_tokens\":3" not in serving


def test_card_explains_the_ignore_list_by_reason_and_how_it_was_made(release: Path) -> None:
    card = card_of(release)
    manifest = json.loads((release / "npuport_manifest.json").read_text(encoding="utf-8"))
    reasons = Counter(entry["reason"] for entry in manifest["ignore_list"])
    assert len(reasons) >= 2 and any("*visual*" in reason for reason in reasons)
    markdown_it = pytest.importorskip("markdown_it")
    html = markdown_it.MarkdownIt("commonmark").enable("table").render(front_matter_and_body(card)[1])
    for reason, count in reasons.items():  # shown literally: the glob '*visual*' is not emphasis
        assert f"<td>{escape(reason, quote=False)}</td>\n<td>{count}</td>" in html
    description = json.loads((release / "quant_model_description.json").read_text(encoding="utf-8"))
    quantized = sum(1 for k, v in description.items() if v == "W8A8_DYNAMIC" and k.endswith(".weight"))
    assert f"{quantized} linear layers are W8A8_DYNAMIC" in card
    assert "`mtp.fc`" in card
    commands = card.split("## How it was made", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0].splitlines()
    assert commands == [  # every folder by its name, as if all were run in one folder; the recipe is the release's
        f"npuport convert-qwen35 --a8w8 --recipe {SOURCE_NAME}-W8A8/{SOURCE_NAME}_best_practice.yaml {SOURCE_NAME} "
        f"{SOURCE_NAME}-w8a8",
        f"npuport validate --gsm8k {SOURCE_NAME}-w8a8 --protocol aisbench --num-questions 5 --max-new-tokens 64 "
        f"--reference {SOURCE_NAME} --data test.jsonl --out report",
        f"npuport package {SOURCE_NAME}-w8a8 --out {SOURCE_NAME}-W8A8 --report report/report.json"]
    assert f"packaged with npuport {npuport.__version__}" in card
    assert "[LICENSE](LICENSE)" in card


# ---------------------------------------------------------------------------------------------------------
# Damage that verify-release must catch


def test_changed_shard_byte_fails_verify(damaged: Path) -> None:
    shard = damaged / "quant_model_weights-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x01  # inside the last tensor's data: headers and shapes stay valid
    shard.write_bytes(bytes(data))
    assert verify_release(damaged) == [
        "quant_model_weights-00001-of-00001.safetensors: SHA-256 differs from SHA256SUMS (changed after packaging)"]


def test_deleted_description_entry_fails_verify(damaged: Path) -> None:
    path = damaged / "quant_model_description.json"
    description = json.loads(path.read_text(encoding="utf-8"))
    victim = next(k for k, v in description.items() if v == "W8A8_DYNAMIC")
    del description[victim]
    path.write_text(json.dumps(description, indent=2), encoding="utf-8")
    problems = verify_release(damaged)
    assert "quant_model_description.json: SHA-256 differs from SHA256SUMS (changed after packaging)" in problems
    assert f"contract: {victim}: tensor has no entry in the description" in problems


def test_added_bf16_index_fails_verify(damaged: Path, inputs: dict[str, Path]) -> None:
    shutil.copyfile(inputs["source"] / "model.safetensors.index.json", damaged / "model.safetensors.index.json")
    problems = verify_release(damaged)
    assert "model.safetensors.index.json: not listed in SHA256SUMS (added after packaging)" in problems
    assert any(p.startswith("contract: model.safetensors.index.json: a BF16 source file") for p in problems)


def test_quantization_config_fails_verify(damaged: Path) -> None:
    config = json.loads((damaged / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = {"quant_method": "fp8"}
    (damaged / "config.json").write_text(json.dumps(config), encoding="utf-8")
    problems = verify_release(damaged)
    assert any("config.json: has quantization_config" in p for p in problems)


def test_edited_card_number_fails_verify(damaged: Path) -> None:
    card = card_of(damaged)
    assert card.count("| 60.00 |") == 1
    (damaged / "README.md").write_text(card.replace("| 60.00 |", "| 61.00 |"), encoding="utf-8")
    problems = verify_release(damaged)
    assert problems == [
        "README.md: SHA-256 differs from SHA256SUMS (changed after packaging)",
        "README.md: 'GSM8K accuracy % (accuracy)' (aisbench, 0-shot), W8A8: the card says 61.00, "
        "report.json says 60.00",
    ]


def test_dropped_card_row_and_changed_report_fail_verify(damaged: Path) -> None:
    card = card_of(damaged)
    (damaged / "README.md").write_text(card.replace(EXPECTED_ROWS[3] + "\n", ""), encoding="utf-8")
    report_path = damaged / "validation" / "report.json"
    report = json.loads(report_path.read_text(encoding="utf-8"))
    report["mtp"]["mean_acceptance_length"] = 2.75
    report_path.write_text(json.dumps(report), encoding="utf-8")
    problems = verify_release(damaged)
    assert "README.md: results table lacks 'mean KL divergence' (vs BF16, 8 prompts) from report.json" in problems
    assert ("README.md: 'MTP mean acceptance length' (k=3, 120 rounds), W8A8: the card says 2.50, "
            "report.json says 2.75") in problems


# ---------------------------------------------------------------------------------------------------------
# Refusals, --force, and nothing left behind


def test_failed_gate_is_refused_without_force(inputs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ReleaseError, match=r"gate failed: max-accuracy-drop 1.0 points \(W8A8 -20.00 vs BF16\)"):
        package_release(inputs["artifact"], tmp_path / "rel", inputs["failed_report"], archive=True, log=silent)
    assert list(tmp_path.iterdir()) == []


def test_failed_gate_with_force_is_flagged_in_the_card(inputs: dict[str, Path], tmp_path: Path) -> None:
    out = package_release(inputs["artifact"], tmp_path / "rel", inputs["failed_report"], force=True, log=silent)
    meta, body = front_matter_and_body(card_of(out))
    assert meta["base_model"] == SOURCE_NAME
    first_lines = body.lstrip("\n").splitlines()[:3]
    assert "WARNING: packaged with --force" in first_lines[0]
    assert "gate failed: max-accuracy-drop 1.0 points" in "\n".join(first_lines)
    assert "- FAIL: max-accuracy-drop 1.0 points" in body
    assert "npuport package" in body and "--force" in body
    problems = verify_release(out)
    assert problems == ["validation/report.json: gate failed: max-accuracy-drop 1.0 points (W8A8 -20.00 vs BF16)"]


def test_failing_artifact_is_refused_without_force_and_flagged_with_force(inputs: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    art = Path(shutil.copytree(inputs["artifact"], tmp_path / "art"))
    (art / "model.safetensors.index.json").write_text('{"weight_map": {}}', encoding="utf-8")
    with pytest.raises(ReleaseError, match="model.safetensors.index.json: a BF16 source file"):
        package_release(art, tmp_path / "rel", inputs["report"], log=silent)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]

    out = package_release(art, tmp_path / "rel", inputs["report"], force=True, log=silent)
    _, body = front_matter_and_body(card_of(out))
    head = "\n".join(body.lstrip("\n").splitlines()[:3])
    assert "WARNING: packaged with --force" in head and "model.safetensors.index.json" in head
    assert any(p.startswith("contract: model.safetensors.index.json") for p in verify_release(out))


def test_failure_midway_leaves_no_partial_release_or_archive(inputs: dict[str, Path], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import npuport.release.package as release_module

    real_copy = release_module.copy_with_sha256
    calls = []

    def failing_copy(src: Path, dst: Path) -> str:
        calls.append(src)
        if len(calls) == 4:
            raise OSError(28, "No space left on device")
        return real_copy(src, dst)

    monkeypatch.setattr(release_module, "copy_with_sha256", failing_copy)
    with pytest.raises(ReleaseError, match="No space left"):
        package_release(inputs["artifact"], tmp_path / "rel", inputs["report"], archive=True, log=silent)
    assert len(calls) == 4
    assert list(tmp_path.iterdir()) == []


def test_shards_truncated_after_the_check_are_refused_and_nothing_is_left(inputs: dict[str, Path], tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit's case: the shards are cut to 100 bytes after package checked the artifact and before it copies
    them (here: as the first copy starts). The copy's digest is not the checked one: refused, one line naming the
    shard, exit status 1, no release folder and nothing partial left."""
    import npuport.release.package as release_module

    art = Path(shutil.copytree(inputs["artifact"], tmp_path / "art"))
    shards = sorted(art.glob("*.safetensors"))
    original = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in shards}
    real_copy = release_module.copy_with_sha256

    def truncate_then_copy(src: Path, dst: Path) -> str:
        for shard in shards:
            if shard.stat().st_size > 100:
                os.truncate(shard, 100)
        return real_copy(src, dst)

    monkeypatch.setattr(release_module, "copy_with_sha256", truncate_then_copy)
    (work := tmp_path / "work").mkdir()
    done = CliRunner().invoke(main, ["package", str(art), "--out", str(work / "rel"), "--archive"])
    assert done.exit_code == 1 and "Traceback" not in done.output, done.output
    errors = [line for line in done.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.output
    shard = shards[0]
    assert errors[0].startswith(f"error: {shard}: changed after it was checked (sha256 {original[shard][:12]}... when "
                                f"checked, {hashlib.sha256(shard.read_bytes()).hexdigest()[:12]}... as copied, 100 "
                                "bytes)"), errors[0]
    assert errors[0].endswith(f"{work / 'rel'} was not written: package it again once nothing writes to it")
    assert list(work.iterdir()) == []


def test_a_file_changed_after_the_check_keeps_the_previous_release(inputs: dict[str, Path], tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with --force over an earlier release: the earlier one stays as it was, byte for byte."""
    import npuport.release.package as release_module

    art = Path(shutil.copytree(inputs["artifact"], tmp_path / "art"))
    rel = package_release(art, tmp_path / "rel", log=silent)
    before = {p.relative_to(rel): p.read_bytes() for p in rel.rglob("*") if p.is_file()}
    real_copy = release_module.copy_with_sha256

    def edit_then_copy(src: Path, dst: Path) -> str:
        if src.name == "config.json":
            src.write_text(src.read_text(encoding="utf-8") + " ", encoding="utf-8")
        return real_copy(src, dst)

    monkeypatch.setattr(release_module, "copy_with_sha256", edit_then_copy)
    with pytest.raises(ReleaseError, match=rf"^{art / 'config.json'}: changed after it was checked .* is unchanged"):
        package_release(art, rel, force=True, log=silent)
    assert {p.relative_to(rel): p.read_bytes() for p in rel.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "rel"]


def test_existing_release_folder_is_not_overwritten(inputs: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "rel").mkdir()
    (tmp_path / "rel" / "keep.txt").write_text("mine", encoding="utf-8")
    with pytest.raises(ReleaseError, match="already exists"):
        package_release(inputs["artifact"], tmp_path / "rel", log=silent)
    assert [p.name for p in (tmp_path / "rel").iterdir()] == ["keep.txt"]


# ---------------------------------------------------------------------------------------------------------
# Archive, no report, CLI, gates in the report


def test_archive_is_the_release_with_its_own_checksum(inputs: dict[str, Path], tmp_path: Path) -> None:
    out = package_release(inputs["artifact"], tmp_path / "rel", inputs["report"], archive=True, log=silent)
    tar_path, sum_path = tmp_path / "rel.tar", tmp_path / "rel.tar.sha256"
    assert sum_path.read_text(encoding="utf-8") == f"{hashlib.sha256(tar_path.read_bytes()).hexdigest()}  rel.tar\n"
    with tarfile.open(tar_path) as tar:
        names = {m.name for m in tar.getmembers() if m.isfile()}
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert names == {f"rel/{p.relative_to(out).as_posix()}" for p in out.rglob("*") if p.is_file()}
    assert verify_release(tmp_path / "unpacked" / "rel") == []


def test_release_without_report_says_nothing_was_measured(inputs: dict[str, Path], tmp_path: Path) -> None:
    out = package_release(inputs["artifact"], tmp_path / "rel", log=silent)
    assert verify_release(out) == []
    card = card_of(out)
    assert "No validation report was packaged" in card and "| measure |" not in card
    assert not (out / "validation").exists()


def test_cli_package_then_verify_release(inputs: dict[str, Path], tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "rel"
    done = runner.invoke(main, ["package", str(inputs["artifact"]), "--out", str(out), "--report",
                                str(inputs["report"]), "--base-model", "Qwen/Qwen3.5-tiny"])
    assert done.exit_code == 0, done.output
    assert front_matter_and_body(card_of(out))[0]["base_model"] == "Qwen/Qwen3.5-tiny"
    assert runner.invoke(main, ["verify-release", str(out)]).exit_code == 0
    (out / "tokenizer.json").unlink()
    done = runner.invoke(main, ["verify-release", str(out)])
    assert done.exit_code == 1 and "FAIL tokenizer.json: listed in SHA256SUMS but missing" in done.output

    refused = runner.invoke(main, ["package", str(inputs["artifact"]), "--out", str(tmp_path / "rel2"),
                                   "--report", str(inputs["failed_report"])])
    assert refused.exit_code == 1 and "error: refusing to package" in refused.output
    assert "Traceback" not in refused.output and not (tmp_path / "rel2").exists()


def test_gates_are_written_to_report_json_and_md(tmp_path: Path) -> None:
    report = ValidationReport(artifact="a", device="cpu", seed=0,
                              gates=[Gate("max-accuracy-drop 1.0 points", False, "W8A8 -1.4 vs BF16"),
                                     Gate("min-throughput 0.97x", True, "1.02x")])
    files = write_report(report, tmp_path)
    data = json.loads(files.json.read_text(encoding="utf-8"))
    assert data["gates"] == [{"name": "max-accuracy-drop 1.0 points", "passed": False, "detail": "W8A8 -1.4 vs BF16"},
                             {"name": "min-throughput 0.97x", "passed": True, "detail": "1.02x"}]
    md = files.markdown.read_text(encoding="utf-8")
    assert "## Gates" in md and "1 of 2 gate(s) FAILED." in md
    assert "| max-accuracy-drop 1.0 points | FAIL | W8A8 -1.4 vs BF16 |" in md
    assert "| min-throughput 0.97x | pass | 1.02x |" in md
    plain = write_report(ValidationReport(artifact="a", device="cpu", seed=0), tmp_path / "plain")
    assert "gates" not in json.loads(plain.json.read_text(encoding="utf-8"))
    assert "Gates" not in plain.markdown.read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------
# Copying and hashing in one pass


@pytest.mark.parametrize("size", [0, 1, 4096, 4097, 3 * 4096 + 5])
def test_copy_with_sha256_copies_and_hashes_every_byte(tmp_path: Path, size: int) -> None:
    data = bytes((i * 7 + 3) % 256 for i in range(size))
    (tmp_path / "src").write_bytes(data)
    digest = copy_with_sha256(tmp_path / "src", tmp_path / "dst", chunk=4096, depth=1)
    assert digest == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "dst").read_bytes() == data


def test_copy_with_sha256_reads_without_a_memory_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mmap

    def no_mmap(*args, **kwargs):
        raise AssertionError("copy_with_sha256 memory-mapped its source")

    monkeypatch.setattr(mmap, "mmap", no_mmap)
    data = os.urandom(3 * 4096 + 17)
    (tmp_path / "src").write_bytes(data)
    assert copy_with_sha256(tmp_path / "src", tmp_path / "dst", chunk=4096, depth=2) == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "dst").read_bytes() == data


def test_a_source_truncated_while_it_is_copied_ends_the_copy_short(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Truncated by someone else after its first chunk was written: no fault (a memory map gave "Bad address" or
    SIGBUS), and the digest returned is that of the bytes written, which differs from the source's as checked."""
    import npuport.checksums as checksums

    data = os.urandom(8 * 4096)
    src = tmp_path / "src"
    src.write_bytes(data)
    real_write = checksums.write_fully

    def write_then_truncate(out, piece) -> None:
        real_write(out, piece)
        if src.stat().st_size > 100:
            os.truncate(src, 100)

    monkeypatch.setattr(checksums, "write_fully", write_then_truncate)
    digest = copy_with_sha256(src, tmp_path / "dst", chunk=4096, depth=1)
    written = (tmp_path / "dst").read_bytes()
    assert digest == hashlib.sha256(written).hexdigest() != hashlib.sha256(data).hexdigest()
    assert data.startswith(written) and len(written) < len(data)


def test_copy_with_sha256_reports_a_failed_write_without_hanging(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import npuport.checksums as checksums

    def full_disk(out, data):
        raise OSError(28, "No space left on device")

    (tmp_path / "src").write_bytes(bytes(10 * 4096))
    monkeypatch.setattr(checksums, "write_fully", full_disk)
    with pytest.raises(OSError, match="No space left"):
        copy_with_sha256(tmp_path / "src", tmp_path / "dst", chunk=4096, depth=1)


# ---------------------------------------------------------------------------------------------------------
# The card says what ran: the question set, CPU speed figures, the title; verify-release checks the labels


def test_card_names_the_question_set_the_report_names(inputs: dict[str, Path], tmp_path: Path) -> None:
    report = make_report(tmp_path / "report", questions="arithmetic (GSM8K format)")
    name = json.loads(report.read_text(encoding="utf-8"))["settings"]["questions_name"]
    card = card_of(package_release(inputs["artifact"], tmp_path / "rel", report, log=silent))
    table = card.split("## Measured results", 1)[1].split("\n## ", 1)[0]
    assert f"Questions: {name}." in table
    assert f"| {name} accuracy % (accuracy) | aisbench, 0-shot | 5 | 60.00 | 80.00 | -20.00 |" in table
    assert f"| {name} invalid % |" in table and f"| {name} output tok/s on CPU |" in table
    assert "GSM8K accuracy" not in card and "GSM8K invalid" not in card and "GSM8K output" not in card
    md = (report.parent / "report.md").read_text(encoding="utf-8")
    assert f"## {name} accuracy" in md and f"### {name} generation" in md and "GSM8K generation" not in md
    assert verify_release(tmp_path / "rel") == []


def test_card_title_names_the_model(release: Path) -> None:
    _, body = front_matter_and_body(card_of(release))
    assert body.lstrip("\n").splitlines()[0] == f"# {SOURCE_NAME}, W8A8_DYNAMIC for Ascend NPUs"


def _speed_report(tmp_path: Path, device: str) -> Path:
    """A report whose two runs were timed three times each, with the spreads chosen so that the MTP run's decode
    is beyond noise of the plain run's, and its prefill within."""
    report = ValidationReport(
        artifact="a", device=device, seed=0, settings={"questions_name": "GSM8K"},
        throughput=[ThroughputRun("W8A8", mtp=False, batch_size=2, prefill_tokens_per_s=100.0,
                                  decode_tokens_per_s=20.0, model="W8A8", repeats=3,
                                  ranges={"prefill_tokens_per_s": [90.0, 110.0], "decode_tokens_per_s": [19.0, 21.0]}),
                    ThroughputRun("W8A8 + MTP k=2", mtp=True, batch_size=2, prefill_tokens_per_s=105.0,
                                  decode_tokens_per_s=30.0, model="W8A8", repeats=3, num_speculative_tokens=2,
                                  ranges={"prefill_tokens_per_s": [95.0, 112.0], "decode_tokens_per_s": [29.0, 31.0]})])
    return write_report(report, tmp_path / f"report-{device.split()[0]}").json


def test_cpu_speed_figures_are_marked_with_their_noise_verdict(inputs: dict[str, Path], tmp_path: Path) -> None:
    report = _speed_report(tmp_path, "cpu (x86_64, 2 threads)")
    differences = json.loads(report.read_text(encoding="utf-8"))["throughput_differences"]
    verdicts = {d["figure"]: d["within_noise"] for d in differences}
    assert verdicts == {"prefill_tokens_per_s": True, "decode_tokens_per_s": False}  # the report's own verdicts
    card = card_of(package_release(inputs["artifact"], tmp_path / "rel", report, log=silent))
    table = [line for line in card.splitlines() if line.startswith("| ") and "tok/s" in line]
    assert table and all(line.split(" | ")[0].endswith("tok/s on CPU") for line in table), table
    assert "Speed figures marked 'on CPU' were measured on a CPU (cpu (x86_64, 2 threads))" in card
    assert "- prefill tok/s on CPU, W8A8 + MTP k=2 against W8A8: +5.0, within timing noise" in card
    assert "- decode tok/s on CPU, W8A8 + MTP k=2 against W8A8: +10.0, beyond timing noise" in card
    assert verify_release(tmp_path / "rel") == []

    accelerator = card_of(package_release(inputs["artifact"], tmp_path / "rel-gpu",
                                          _speed_report(tmp_path, "cuda (NVIDIA H200)"), log=silent))
    assert "on CPU" not in accelerator and "| decode tok/s | W8A8, MTP off, batch 2 |" in accelerator


def _rewrite_card(folder: Path, old: str, new: str) -> None:
    """Change the card and rewrite SHA256SUMS to match, so that only the card's own checks can tell."""
    card = card_of(folder)
    assert card.count(old) == 1
    (folder / "README.md").write_text(card.replace(old, new), encoding="utf-8")
    sums = folder / "SHA256SUMS"
    lines = [line if not line.endswith("  README.md") else
             f"{hashlib.sha256((folder / 'README.md').read_bytes()).hexdigest()}  README.md"
             for line in sums.read_text(encoding="utf-8").splitlines()]
    sums.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_a_changed_card_row_label_fails_verify(damaged: Path) -> None:
    _rewrite_card(damaged, "| GSM8K invalid % |", "| arithmetic invalid % |")
    assert verify_release(damaged) == [
        "README.md: results table lacks 'GSM8K invalid %' (aisbench, 0-shot) from report.json",
        "README.md: results row 'arithmetic invalid %' (aisbench, 0-shot) is not in report.json"]


def test_an_unmarked_cpu_speed_label_fails_verify(damaged: Path) -> None:
    _rewrite_card(damaged, "| decode tok/s on CPU | no MTP,", "| decode tok/s | no MTP,")
    problems = verify_release(damaged)
    assert "README.md: results row 'decode tok/s' (no MTP, MTP off, batch 1) is not in report.json" in problems
    assert "README.md: results table lacks 'decode tok/s on CPU' (no MTP, MTP off, batch 1) from report.json" \
        in problems


def test_a_card_without_the_cpu_note_fails_verify(damaged: Path) -> None:
    card = card_of(damaged)
    note = next(line for line in card.splitlines() if line.startswith("Speed figures marked 'on CPU'"))
    _rewrite_card(damaged, note, "")
    assert verify_release(damaged) == [
        "README.md: report.json's speed figures were measured on a CPU, but the card carries no 'Speed figures "
        "marked 'on CPU' ...' note saying so"]


def test_a_release_without_a_report_is_warned_of_by_package_and_verify_release(inputs: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    runner = CliRunner()
    packaged = runner.invoke(main, ["package", str(inputs["artifact"]), "--out", str(tmp_path / "rel")])
    assert packaged.exit_code == 0, packaged.output
    assert f"warning: no --report: {tmp_path / 'rel'} will carry no measurement" in packaged.output
    verified = runner.invoke(main, ["verify-release", str(tmp_path / "rel")])
    assert verified.exit_code == 0, verified.output
    assert f"warning: {tmp_path / 'rel'} carries no measurement: no validation/report.json" in verified.output
    measured = runner.invoke(main, ["verify-release", str(package_release(inputs["artifact"], tmp_path / "rel2",
                                                                           inputs["report"], log=silent))])
    assert measured.exit_code == 0 and "warning" not in measured.output, measured.output
    card = card_of(tmp_path / "rel")
    assert "# not validated: no report was packaged" in card


def test_a_report_below_chance_is_refused_and_forced_it_says_so_at_the_top(inputs: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    from npuport.runtime.validation.gates import CHANCE, min_accuracy_gate

    protocol = AISBenchProtocol(RECORDS)
    wrong = protocol.score(["answer: 0"] * len(RECORDS))
    gate = min_accuracy_gate(wrong, CHANCE)
    report = write_report(ValidationReport(artifact="a", device="cuda (test)", seed=0, accuracy=[AccuracyRow(wrong)],
                                           settings={"questions_name": "GSM8K"}, gates=[gate]), tmp_path / "r").json
    with pytest.raises(ReleaseError, match=r"gate failed: min-accuracy above chance \(20\.00 %\)"):
        package_release(inputs["artifact"], tmp_path / "rel", report, log=silent)
    assert not (tmp_path / "rel").exists()
    _, body = front_matter_and_body(card_of(package_release(inputs["artifact"], tmp_path / "rel", report,
                                                            force=True, log=silent)))
    head = body.lstrip("\n").splitlines()
    assert head[0].startswith("> **WARNING: packaged with --force.**") and "min-accuracy above chance" in head[2]
    assert "Gates: **1 of 1 gate(s) FAILED**" in body
    assert verify_release(tmp_path / "rel") == [f"validation/report.json: gate failed: {gate.name} ({gate.detail})"]
