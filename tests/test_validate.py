"""`npuport validate --gsm8k`: stop strings as a server applies them, the fidelity measures against direct
computations, fidelity separating a W8A8 artifact from a broken one, the whole command end to end on CPU, and
the gates."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from npuport.cli import main
from npuport.kernels.implementations import OPERATORS
from npuport.runtime.completion import cut_at_stop
from npuport.runtime.generate import generate
from npuport.runtime.loader import load_model
from npuport.runtime.text_completions import finish_completion
from npuport.runtime.textgen import load_tokenizer, stop_token_ids
from npuport.runtime.validation import throughput
from npuport.runtime.validation.fidelity import greedy_token_agreement, kl_divergence
from npuport.runtime.validation.gates import accuracy_drop_gate
from npuport.runtime.validation.gsm8k import (
    AISBENCH_INSTRUCTION,
    GSM8KRecord,
    SGLangProtocol,
    gsm8k_path,
    make_protocol,
)
from npuport.runtime.validation.report import AccuracyRow
from npuport.runtime.validation.validate import THROUGHPUT_REPEATS

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

KIND = "moe-multimodal-fused"  # multimodal names and an MTP head with fused experts, as the hubs publish
QUESTIONS = 4
NEW_TOKENS = 16
MTP = 2


def run_validate(*args: str) -> tuple[int, str]:
    if "--min-accuracy" not in args:  # random weights answer at chance, which the default floor fails (test_gates.py)
        args = (*args, "--min-accuracy", "off")
    result = CliRunner().invoke(main, ["validate", "--gsm8k", *args, "--device", "cpu"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def broken_copy(artifact: Path, dest: Path) -> Path:
    """The artifact with every weight_scale doubled: right format, wrong numbers."""
    shutil.copytree(artifact, dest)
    for shard in dest.glob("*.safetensors"):
        tensors = load_file(shard)
        save_file({k: v * 2 if k.endswith(".weight_scale") else v for k, v in tensors.items()}, shard,
                  metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def validated(tiny_checkpoints, tiny_artifacts, tmp_path_factory):
    """One validate run of the artifact and one of the broken artifact, both against the source."""
    root = tmp_path_factory.mktemp("validate")
    source, artifact = tiny_checkpoints[KIND], tiny_artifacts[KIND]
    common = ["--reference", str(source), "--num-questions", str(QUESTIONS), "--max-new-tokens", str(NEW_TOKENS)]
    good = run_validate(str(artifact), *common, "--batch-size", "2", "--mtp", str(MTP), "--out", str(root / "good"))
    broken = broken_copy(artifact, root / "broken-artifact")
    bad = run_validate(str(broken), *common, "--no-throughput", "--out", str(root / "bad"))
    return {"good": (*good, root / "good"), "bad": (*bad, root / "bad"), "source": source, "artifact": artifact}


def read_report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


# What validate calls the two models on a CPU, where it computes in float32 by default (runtime/validation/labels.py)
W8A8_CPU, BF16_CPU = "W8A8 (float32 compute)", "BF16 weights (float32 compute)"


def read_completions(folder: Path, model: str) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "completions.jsonl").read_text().splitlines()]
    return [r for r in rows if r["model"] == model]


# ---------------------------------------------------------------------------------------------------------
# Stop strings


def test_a_stop_string_ends_the_completion_at_the_fewest_tokens_that_hold_it(tiny_checkpoints):
    tokenizer = load_tokenizer(tiny_checkpoints[KIND])
    tokens = tokenizer.encode("She has 3 apples.\nAnswer: 7\n\nQuestion: How many pears? Answer: 9")

    def decode(t):
        return tokenizer.decode(list(t), skip_special_tokens=True)

    got = finish_completion(tokens, decode, ["Question", "Assistant:"], frozenset())
    # independent: scan every prefix
    first = next(n for n in range(1, len(tokens) + 1) if "Question" in decode(tokens[:n]))
    assert got.completion_tokens == first
    assert got.text == "She has 3 apples.\nAnswer: 7\n\n"
    assert got.finish_reason == "stop"

    plain = finish_completion(tokens, decode, ["Nowhere"], frozenset())
    assert (plain.text, plain.completion_tokens, plain.finish_reason) == (decode(tokens), len(tokens), "length")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ended = finish_completion(tokens + [eos], decode, [], frozenset([eos]))
    assert (ended.text, ended.completion_tokens, ended.finish_reason) == (decode(tokens), len(tokens) + 1, "stop")


# ---------------------------------------------------------------------------------------------------------
# The fidelity measures against direct computations


def test_kl_divergence_matches_torch_kl_div():
    gen = torch.Generator().manual_seed(0)
    ref, cand = torch.randn(5, 50, generator=gen) * 3, torch.randn(5, 50, generator=gen) * 3
    want = torch.nn.functional.kl_div(torch.log_softmax(cand, -1), torch.log_softmax(ref, -1), log_target=True,
                                      reduction="none").sum(-1)
    torch.testing.assert_close(kl_divergence(ref, cand), want)
    torch.testing.assert_close(kl_divergence(ref.bfloat16(), ref.bfloat16()), torch.zeros(5))


def test_greedy_token_agreement_counts_same_position_tokens_of_the_reference():
    reference = [[1, 2, 3, 4], [5, 6]]
    candidate = [[1, 2, 9, 4, 7], [5]]  # 3 of 4, then 1 of 2 (the missing position disagrees)
    assert greedy_token_agreement(candidate, reference) == pytest.approx(4 / 6)
    assert greedy_token_agreement(reference, reference) == 1.0


def test_throughput_splits_prefill_from_decode(monkeypatch):
    """A stand-in for generate that sleeps PREFILL_S per call and STEP_S per further token: the figures must
    come back as those times imply."""
    prefill_s, step_s, batch, new_tokens = 0.06, 0.01, 3, 9

    def fake_generate(model, prompts, max_new_tokens, **kwargs):
        time.sleep(prefill_s + step_s * (max_new_tokens - 1))

    monkeypatch.setattr(throughput, "generate", fake_generate)
    prompts = [[1] * 100, [2] * 50, [3] * 30]
    run = throughput.measure_throughput(SimpleNamespace(device=torch.device("cpu")), prompts, new_tokens, mtp=2,
                                        label="fake", repeats=2)
    assert run.prefill_tokens_per_s == pytest.approx(180 / prefill_s, rel=0.3)
    assert run.decode_tokens_per_s == pytest.approx(batch / step_s, rel=0.3)
    assert run.time_per_output_token_ms == pytest.approx(step_s * 1000, rel=0.3)
    assert run.output_tokens_per_s == pytest.approx(batch * new_tokens / (prefill_s + step_s * 8), rel=0.3)
    assert (run.mtp, run.num_speculative_tokens, run.batch_size) == (True, 2, batch)


def test_throughput_repeats_keep_a_slow_one_token_call_out_of_the_decode_rate(monkeypatch):
    """Decode time is the full call less the one-token call: a one-token call slowed by something else on the
    machine would make decode look faster than it is. The median of THROUGHPUT_REPEATS repeats keeps it out."""
    prefill_s, step_s, hiccup_s, new_tokens = 0.05, 0.01, 0.15, 6
    one_token_calls = 0

    def fake_generate(model, prompts, max_new_tokens, **kwargs):
        nonlocal one_token_calls
        slow = max_new_tokens == 1 and one_token_calls == 0  # the first timed one-token call only
        one_token_calls += max_new_tokens == 1
        time.sleep(prefill_s + step_s * (max_new_tokens - 1) + (hiccup_s if slow else 0.0))

    monkeypatch.setattr(throughput, "generate", fake_generate)
    run = throughput.measure_throughput(SimpleNamespace(device=torch.device("cpu")), [[1] * 10], new_tokens,
                                        label="fake", repeats=THROUGHPUT_REPEATS)
    assert run.time_per_output_token_ms == pytest.approx(step_s * 1000, rel=0.3)


# ---------------------------------------------------------------------------------------------------------
# The command end to end


def test_validate_writes_the_report_the_plots_and_the_completions(validated):
    code, output, out = validated["good"]
    assert code == 0, output
    assert "report:" in output and str(out / "report.md") in output
    for name in ("report.json", "report.md", "accuracy.png", "mtp_acceptance.png", "throughput.png",
                 "completions.jsonl"):
        assert (out / name).is_file(), name
    report = read_report(out)
    row = report["gsm8k"][0]
    assert row["protocol"] == "sglang" and row["candidate"]["num_questions"] == QUESTIONS
    assert row["reference"]["num_questions"] == QUESTIONS and row["comparison"]["num_questions"] == QUESTIONS
    assert [r["label"] for r in report["throughput"]] == [W8A8_CPU, f"{W8A8_CPU} + MTP k={MTP}", BF16_CPU,
                                                          f"{BF16_CPU} + MTP k={MTP}"]
    assert all(r["batch_size"] == 2 and r["prefill_tokens_per_s"] > 0 and r["output_tokens_per_s"] > 0
               for r in report["throughput"])
    # decode = full call - prefill call: None only where machine noise exceeded the decode time
    assert all(r["decode_tokens_per_s"] is None or r["decode_tokens_per_s"] > 0 for r in report["throughput"])
    assert report["mtp"]["num_speculative_tokens"] == MTP and len(report["mtp"]["per_position"]) == MTP
    assert 1.0 <= report["mtp"]["mean_acceptance_length"] <= MTP + 1
    ref_mtp, change = report["mtp_reference"], report["mtp_change"]
    assert ref_mtp["num_speculative_tokens"] == MTP and ref_mtp["num_rounds"] > 0
    mtp = report["mtp"]
    assert change["mean_acceptance_length"] == mtp["mean_acceptance_length"] - ref_mtp["mean_acceptance_length"]
    assert change["per_position"] == [c - r for c, r in zip(mtp["per_position"], ref_mtp["per_position"], strict=True)]
    assert [g["name"] for g in report["gates"]] == ["max-accuracy-drop 1 points"]
    assert report["settings"]["protocol"] == "sglang" and report["seed"] == 1234
    assert f"each figure over {THROUGHPUT_REPEATS} repeats" in report["settings"]["throughput"]
    assert report["versions"]["torch"] and report["device"].startswith("cpu")
    # which implementation ran each operator: on the CPU, every one its PyTorch reference
    ran = dict(entry.rsplit(" ", 1) for entry in report["settings"]["implementations"].split(", "))
    assert ran == dict.fromkeys(OPERATORS, "reference")
    md = (out / "report.md").read_text()
    assert "## Fidelity against BF16" in md and "## Throughput" in md and "## MTP acceptance" in md


def test_validate_artifact_checksum_is_the_sha256_of_its_sha256sums_listing(validated):
    artifact = validated["artifact"]
    lines = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(artifact).as_posix()}\n"
                    for p in sorted(artifact.rglob("*"), key=lambda p: p.relative_to(artifact).as_posix())
                    if p.is_file())
    assert read_report(validated["good"][2])["artifact_checksum"] == hashlib.sha256(lines.encode()).hexdigest()


def test_validate_completions_and_scores_are_what_generate_gives(validated):
    """Independently of the validate code: generate() on each model, decode, cut at the protocol's stop
    strings, score. Greedy MTP output equals plain greedy output, so plain decoding is the reference here."""
    out = validated["good"][2]
    protocol = make_protocol("sglang", max_new_tokens=NEW_TOKENS)
    for label, path in ((W8A8_CPU, validated["artifact"]), (BF16_CPU, validated["source"])):
        tokenizer = load_tokenizer(path)
        ids = [tokenizer.encode(p) for p in protocol.prompts(QUESTIONS)]
        tokens = generate(load_model(path, "cpu", torch.float32), ids, NEW_TOKENS,
                          stop_tokens=stop_token_ids(path)).tokens
        texts = [cut_at_stop(tokenizer.decode(t, skip_special_tokens=True), protocol.stop) for t in tokens]
        rows = read_completions(out, label)
        assert [r["text"] for r in rows] == texts, label
        assert all(r["completion_tokens"] <= len(t) for r, t in zip(rows, tokens, strict=True))
        side = "candidate" if label == W8A8_CPU else "reference"
        assert read_report(out)["gsm8k"][0][side]["scores"][0]["correct"] == protocol.score(texts).correct


def test_aisbench_prompts_go_through_the_artifacts_chat_template(tiny_artifacts, tmp_path):
    artifact = tiny_artifacts[KIND]
    code, output = run_validate(str(artifact), "--protocol", "aisbench", "--num-questions", "2", "--max-new-tokens",
                                "8", "--no-throughput", "--out", str(tmp_path))
    assert code == 0, output
    tokenizer = load_tokenizer(artifact)
    questions = [json.loads(line)["question"] for line in open(gsm8k_path("test"), encoding="utf-8")][:2]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": AISBENCH_INSTRUCTION.format(question=q)}],
                                             tokenize=False, add_generation_prompt=True) for q in questions]
    assert all(p.startswith("<|im_start|>user\n") for p in prompts)
    tokens = generate(load_model(artifact, "cpu", torch.float32), [tokenizer.encode(p) for p in prompts], 8,
                      stop_tokens=stop_token_ids(artifact)).tokens
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]  # aisbench sends no stop strings
    assert [r["text"] for r in read_completions(tmp_path, W8A8_CPU)] == texts
    assert read_report(tmp_path)["settings"]["protocol"] == "aisbench"


def test_fidelity_puts_the_w8a8_artifact_close_to_bf16_and_a_broken_one_far(validated):
    code, output, _ = validated["bad"]
    assert code == 0, output  # accuracy of random models: both ~0, the drop gate passes; fidelity tells them apart
    good, bad = read_report(validated["good"][2])["fidelity"], read_report(validated["bad"][2])["fidelity"]
    assert good["num_prompts"] == bad["num_prompts"] == QUESTIONS
    assert good["num_tokens"] == bad["num_tokens"] > QUESTIONS * NEW_TOKENS  # prompts + reference continuations
    # close: the same next token at most positions, a KL far below the broken one's, every layer aligned
    assert good["top1_agreement"] > 0.8 and bad["top1_agreement"] < 0.5
    assert good["mean_kl"] < 0.5 and bad["mean_kl"] > 20 * good["mean_kl"]
    assert min(good["layer_cosine"]) > 0.98 and max(bad["layer_cosine"]) < min(good["layer_cosine"]) - 0.1
    assert good["greedy_token_agreement"] > bad["greedy_token_agreement"]


def test_fidelity_of_the_source_against_itself_is_exact(tiny_checkpoints, tmp_path):
    source = tiny_checkpoints[KIND]
    code, output = run_validate(str(source), "--reference", str(source), "--num-questions", "2",
                                "--max-new-tokens", "8", "--no-throughput", "--out", str(tmp_path))
    assert code == 0, output
    fidelity = read_report(tmp_path)["fidelity"]
    assert fidelity["greedy_token_agreement"] == fidelity["top1_agreement"] == 1.0
    assert fidelity["mean_kl"] == pytest.approx(0.0, abs=1e-6)
    assert fidelity["layer_cosine"] == pytest.approx([1.0] * len(fidelity["layer_cosine"]), abs=1e-5)


# ---------------------------------------------------------------------------------------------------------
# Gates and refusals


def test_a_failed_acceptance_gate_is_reported_and_exits_1(tiny_artifacts, tmp_path):
    """k + 1 is the most a mean acceptance length can be; a random MTP head does not reach it."""
    code, output = run_validate(str(tiny_artifacts[KIND]), "--num-questions", "2", "--max-new-tokens", "8",
                                "--mtp", str(MTP), "--min-acceptance", str(MTP + 1), "--no-throughput",
                                "--out", str(tmp_path))
    report = read_report(tmp_path)
    assert report["mtp"]["mean_acceptance_length"] < MTP + 1
    assert [(g["name"], g["passed"]) for g in report["gates"]] == [(f"min-acceptance {MTP + 1} (mean acceptance "
                                                                    "length)", False)]
    assert code == 1 and "gate FAILED: min-acceptance" in output and "1 gate(s) failed" in output


def test_the_accuracy_gate_fails_beyond_the_allowed_drop():
    records = [GSM8KRecord(f"Q{i}?", f"w\n#### {i + 1}") for i in range(5)]
    protocol = SGLangProtocol(records, shots=1)  # scores Q1..Q4, golds 2..5
    reference = protocol.score(["2", "3", "4", "0"])  # 3 of 4
    candidate = protocol.score(["2", "3", "0", "0"])  # 2 of 4: 25 points lower
    row = AccuracyRow.paired(candidate, reference, seed=0, resamples=200)
    assert not accuracy_drop_gate(row, 1.0).passed
    assert "-25.00 points" in accuracy_drop_gate(row, 1.0).detail
    assert accuracy_drop_gate(row, 25.0).passed
    assert accuracy_drop_gate(AccuracyRow.paired(reference, candidate, seed=0, resamples=200), 0.0).passed


@pytest.mark.parametrize(("extra", "message"), [
    (["--min-acceptance", "2"], "--min-acceptance needs MTP"),
    (["--endpoint", "http://127.0.0.1:9", "--mtp", "2"], "the server decides"),
    (["--chat-template-kwargs", "{oops"], "not JSON"),
])
def test_unmeasurable_options_are_refused_in_one_line(tiny_artifacts, tmp_path, extra, message):
    code, output = run_validate(str(tiny_artifacts[KIND]), *extra, "--out", str(tmp_path))
    assert code == 1 and message in output and "Traceback" not in output
    assert not (tmp_path / "report.json").exists()


def test_an_unreachable_endpoint_is_a_clear_error(tiny_artifacts, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    code, output = run_validate(str(tiny_artifacts[KIND]), "--endpoint", f"http://127.0.0.1:{port}",
                                "--retries", "0", "--timeout", "5", "--num-questions", "1", "--out", str(tmp_path))
    assert code == 1 and f"http://127.0.0.1:{port}/v1/completions" in output and "unreachable" in output
