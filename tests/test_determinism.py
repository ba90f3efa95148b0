"""Determinism of greedy output as `validate` measures it: completions compared question by question; --repeat
against a server whose answers change between calls, against `npuport serve` and on the built-in runtime;
--mtp-reference-endpoint against scripted servers and against two `npuport serve` of one model (with MTP and
without); validation through an endpoint with only a tokenizer at hand; reports at 0 and at N of N correct."""

from __future__ import annotations

import json
import math
import shutil
import threading
from collections import Counter
from pathlib import Path
from statistics import NormalDist

import pytest
from click.testing import CliRunner

from npuport.cli import main
from npuport.runtime.completion import Completion
from npuport.runtime.validation.determinism import compare_completions
from tests.test_endpoint import completion, scripted_server
from tests.test_endpoint_faults import (
    NUM_QUESTIONS,
    answer_text,
    gold,
    question_of,
    write_gsm8k,
)
from tests.test_serve import serve_process

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

KIND = "dense-text"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def wilson_by_hand(k: int, n: int, z: float = NormalDist().inv_cdf(0.975)) -> tuple[float, float]:
    """The Wilson score interval in closed form: (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)."""
    p = k / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - spread) / (1 + z * z / n), (centre + spread) / (1 + z * z / n)


def endpoint_args(url: str, data: Path, out: Path, *extra: str) -> list[str]:
    return ["validate", "--gsm8k", "--endpoint", url, "--data", str(data), "--shots", "1", "--num-questions",
            str(NUM_QUESTIONS), "--timeout", "30", "--retries", "0", "--min-accuracy", "off", "--out", str(out),
            *extra]  # --min-accuracy off: these models answer at chance, which the default floor fails


def read_report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def candidate_texts(out: Path, run: str = "") -> list[str]:
    """completions.jsonl's texts of the candidate's run named `run` ("", " run 2", " without MTP"), in question
    order."""
    label = read_report(out)["labels"]["candidate"] + run
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    texts = [r["text"] for r in rows if r["model"] == label]
    assert texts, f"no completions of {label!r}"
    return texts


def share_by_hand(first: list[str], other: list[str]) -> tuple[float, list[int]]:
    differing = [i for i, (a, b) in enumerate(zip(first, other, strict=True)) if a != b]
    return 1 - len(differing) / len(first), differing


@pytest.fixture
def model_folder(tmp_path) -> Path:
    """The folder validate is told the server serves; with --endpoint only its checksum is read."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture
def tokenizer_only(tiny_checkpoints, tmp_path) -> Path:
    """A folder holding only the tokenizer files of the tiny model: no config, no weights."""
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in TOKENIZER_FILES:
        if (tiny_checkpoints[KIND] / name).exists():
            shutil.copy(tiny_checkpoints[KIND] / name, folder / name)
    return folder


# ---------------------------------------------------------------------------------------------------------
# The comparison


def test_compare_completions_lists_the_differing_questions_and_leaves_failed_ones_out():
    first = [Completion("a", 1), Completion("b", 1), Completion("c", 1), Completion.failed("HTTP 500"),
             Completion("e", 1)]
    other = [Completion("a", 1), Completion("B", 1), Completion("c", 2), Completion("d", 1),
             Completion.failed("timeout")]
    agreement = compare_completions("run 2 against run 1", first, other, accuracy=0.5)
    assert agreement.differing == (1,) and agreement.not_compared == (3, 4)
    assert (agreement.identical, agreement.num_compared, agreement.share) == (2, 3, 2 / 3)
    assert agreement.to_dict()["differing"] == [1] and agreement.to_dict()["accuracy"] == 0.5
    with pytest.raises(ValueError, match="not the same questions"):
        compare_completions("x", first, other[:2])


# ---------------------------------------------------------------------------------------------------------
# Scripted servers


CHANGED = {1, 4, 6}  # questions answered differently the second time they are asked


def flipped_answer(k: int) -> str:
    """answer_text's verdict turned round: right for odd questions, wrong for even ones."""
    return f"so #### {gold(k) if k % 2 else 999}"


def test_repeat_reports_the_share_of_completions_a_changing_server_repeats(model_folder, tmp_path):
    asked: Counter[int] = Counter()
    lock = threading.Lock()

    def respond(body: dict, number: int) -> tuple[int, bytes]:
        k = question_of(body["prompt"])
        with lock:
            asked[k] += 1
            again = asked[k] > 1
        return 200, completion(flipped_answer(k) if again and k in CHANGED else answer_text(k), 4)

    data, out = write_gsm8k(tmp_path / "gsm8k.jsonl"), tmp_path / "report"
    with scripted_server(respond) as (url, received):
        result = CliRunner().invoke(main, [*endpoint_args(url, data, out, "--repeat", "2"), str(model_folder)])
    assert result.exit_code == 0, result.output
    assert len(received) == 2 * NUM_QUESTIONS

    report = read_report(out)
    assert report["gsm8k"][0]["candidate"]["accuracy"] == 4 / 8  # run 1's: the even questions right
    (run2,) = report["determinism"]["repeat"]["runs"]
    assert run2["differing"] == sorted(CHANGED) and run2["identical"] == NUM_QUESTIONS - len(CHANGED)
    assert run2["share"] == pytest.approx((NUM_QUESTIONS - len(CHANGED)) / NUM_QUESTIONS)
    assert run2["accuracy"] == (4 - 2 + 1) / 8  # questions 4 and 6 now wrong, 1 now right
    assert candidate_texts(out, " run 2") == [flipped_answer(k) if k in CHANGED else answer_text(k)
                                              for k in range(NUM_QUESTIONS)]
    assert (out / "answers-run2.jsonl").exists()
    markdown = (out / "report.md").read_text()
    assert "## Determinism of greedy output" in markdown and "batch-invariant" in markdown
    assert "| run 2 against run 1 | 5 of 8 | 62.50 % | 37.50 % | 1, 4, 6 |" in markdown


def test_mtp_reference_endpoint_reports_the_share_the_server_without_mtp_repeats(model_folder, tmp_path):
    def with_mtp(body: dict, number: int) -> tuple[int, bytes]:
        return 200, completion(answer_text(question_of(body["prompt"])), 4)

    def without_mtp(body: dict, number: int) -> tuple[int, bytes]:
        k = question_of(body["prompt"])
        return 200, completion(flipped_answer(k) if k == 2 else answer_text(k), 4)

    data, out = write_gsm8k(tmp_path / "gsm8k.jsonl"), tmp_path / "report"
    with scripted_server(with_mtp) as (url, sent), scripted_server(without_mtp) as (plain_url, sent_plain):
        result = CliRunner().invoke(main, [*endpoint_args(url, data, out, "--mtp-reference-endpoint", plain_url,
                                                          "--mtp-reference-endpoint-model", "plain"),
                                           str(model_folder)])
    assert result.exit_code == 0, result.output
    assert sorted(r["prompt"] for r in sent) == sorted(r["prompt"] for r in sent_plain)
    assert all(r["temperature"] == 0 and r["model"] == "plain" for r in sent_plain)

    mtp = read_report(out)["determinism"]["mtp"]
    assert mtp["differing"] == [2] and mtp["share"] == pytest.approx(7 / 8)
    assert plain_url in mtp["without_mtp"] and "speculative decoding" in mtp["explained"]
    assert (out / "answers-without-mtp.jsonl").exists()
    assert "| without MTP against run 1 (with MTP) | 7 of 8 | 87.50 % |" in (out / "report.md").read_text()


def test_every_answer_right_through_an_endpoint_with_only_a_tokenizer_writes_the_report(tokenizer_only, tmp_path):
    """No ARTIFACT: --tokenizer stands in for its tokenizer, the checksum is said not taken; at N of N correct the
    interval's upper bound is exactly 1 and the lower one Wilson's."""
    def respond(body: dict, number: int) -> tuple[int, bytes]:
        return 200, completion(f"so #### {gold(question_of(body['prompt']))}", 4)

    data, out = write_gsm8k(tmp_path / "gsm8k.jsonl"), tmp_path / "report"
    with scripted_server(respond) as (url, received):
        result = CliRunner().invoke(main, endpoint_args(url, data, out, "--tokenizer", str(tokenizer_only),
                                                        "--endpoint-model", "served-name"))
    assert result.exit_code == 0, result.output
    assert {r["model"] for r in received} == {"served-name"}
    report = read_report(out)
    candidate = report["gsm8k"][0]["candidate"]
    assert candidate["accuracy"] == 1.0
    low, high = candidate["interval"]
    assert high == 1.0 and low == pytest.approx(wilson_by_hand(NUM_QUESTIONS, NUM_QUESTIONS)[0], abs=1e-12)
    assert report["artifact_checksum"] is None and "not taken" in report["settings"]["artifact_checksum"]
    assert report["settings"]["tokenizer"] == str(tokenizer_only) and "served-name" in report["artifact"]
    assert "not taken: no local files" in (out / "report.md").read_text()
    assert (out / "accuracy.png").stat().st_size > 0


@pytest.mark.parametrize(("args", "message"), [
    ([], "give ARTIFACT (the model's folder), or --endpoint URL with --tokenizer DIR"),
    (["--endpoint", "http://127.0.0.1:9"], "give ARTIFACT (the model's folder), or --endpoint URL with --tokenizer"),
])
def test_validate_without_artifact_or_tokenizer_is_a_one_line_error(args, message, tmp_path):
    result = CliRunner().invoke(main, ["validate", "--gsm8k", *args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and message in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("extra", "message"), [
    (["--mtp-reference-endpoint", "http://127.0.0.1:9"], "--mtp-reference-endpoint is compared with --endpoint"),
    (["--compare-without-mtp"], "--compare-without-mtp needs MTP on the built-in runtime"),
    (["--tokenizer", "."], "--tokenizer is for --endpoint"),
])
def test_determinism_options_that_cannot_be_measured_are_refused_in_one_line(tiny_artifacts, tmp_path, extra,
                                                                             message):
    result = CliRunner().invoke(main, ["validate", "--gsm8k", str(tiny_artifacts[KIND]), *extra, "--out",
                                       str(tmp_path / "out")])
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


# ---------------------------------------------------------------------------------------------------------
# The built-in runtime


def test_a_model_that_answers_nothing_right_gets_its_report_and_the_runtime_repeats_itself(tiny_checkpoints,
                                                                                          tmp_path):
    """Random weights against golds no few tokens reach: 0 of N, lower bound exactly 0. The same batches again
    give the same completions; without MTP, the share is what the completions say."""
    data = tmp_path / "far.jsonl"
    rows = [{"question": "Shot?", "answer": "s\n#### 1"}]
    rows += [{"question": f"Q{k}?", "answer": f"w\n#### {987654321 + k}"} for k in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["validate", "--gsm8k", str(tiny_checkpoints[KIND]), "--data", str(data),
                                       "--shots", "1", "--max-new-tokens", "6", "--device", "cpu", "--dtype",
                                       "float32", "--no-throughput", "--mtp", "1", "--repeat", "2",
                                       "--compare-without-mtp", "--min-accuracy", "off", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = read_report(out)
    candidate = report["gsm8k"][0]["candidate"]
    assert candidate["accuracy"] == 0.0
    low, high = candidate["interval"]
    assert low == 0.0 and high == pytest.approx(wilson_by_hand(0, 3)[1], abs=1e-12)
    assert (out / "accuracy.png").stat().st_size > 0

    determinism = report["determinism"]
    assert determinism["repeat"]["runs"][0]["share"] == 1.0 and candidate_texts(out, " run 2") == candidate_texts(out)
    share, differing = share_by_hand(candidate_texts(out), candidate_texts(out, " without MTP"))
    assert determinism["mtp"]["share"] == pytest.approx(share) and determinism["mtp"]["differing"] == differing
    assert "MTP off" in determinism["mtp"]["without_mtp"]


# ---------------------------------------------------------------------------------------------------------
# npuport serve


def test_repeat_against_npuport_serve_is_identical_one_request_at_a_time(tiny_artifacts, tokenizer_only, tmp_path):
    """One request in flight, so every question runs in a batch of one, both times: greedy output repeats
    exactly. The served name comes from /v1/models; only the tokenizer is local."""
    out = tmp_path / "report"
    with serve_process(tiny_artifacts[KIND]) as url:
        result = CliRunner().invoke(main, ["validate", "--gsm8k", "--endpoint", url, "--tokenizer",
                                           str(tokenizer_only), "--num-questions", "3", "--max-new-tokens", "8",
                                           "--parallel", "1", "--repeat", "2", "--retries", "0", "--timeout", "60",
                                           "--min-accuracy", "off",
                                           "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = read_report(out)
    (run2,) = report["determinism"]["repeat"]["runs"]
    assert run2["share"] == 1.0 and run2["differing"] == [] and candidate_texts(out, " run 2") == candidate_texts(out)
    assert tiny_artifacts[KIND].name in report["artifact"] and report["artifact_checksum"] is None


def test_mtp_reference_endpoint_against_npuport_serve_with_and_without_mtp(tiny_checkpoints, tokenizer_only, tmp_path):
    """The same float32 model served twice, with MTP k=1 and without: the share reported is the share of
    identical texts in completions.jsonl, and each server's texts are its own greedy answers."""
    source, out = tiny_checkpoints[KIND], tmp_path / "report"
    with serve_process(source, "--dtype", "float32", "--mtp", "1") as url, \
            serve_process(source, "--dtype", "float32") as plain_url:
        result = CliRunner().invoke(main, ["validate", "--gsm8k", "--endpoint", url, "--tokenizer",
                                           str(tokenizer_only), "--mtp-reference-endpoint", plain_url,
                                           "--num-questions", "3", "--max-new-tokens", "8", "--parallel", "1",
                                           "--retries", "0", "--timeout", "60", "--min-accuracy", "off",
                                           "--out", str(out)])
    assert result.exit_code == 0, result.output
    mtp = read_report(out)["determinism"]["mtp"]
    share, differing = share_by_hand(candidate_texts(out), candidate_texts(out, " without MTP"))
    assert mtp["share"] == pytest.approx(share) and mtp["differing"] == differing and mtp["compared"] == 3
    assert plain_url in mtp["without_mtp"]
