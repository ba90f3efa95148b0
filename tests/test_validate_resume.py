"""`npuport validate` survives its own interruption: killed (SIGTERM and SIGKILL) at a seeded random point of each
phase - the artifact's answers, the reference's answers, fidelity, throughput - and continued with --resume (or the
same command again), it ends with the report of a run never stopped (answers, accuracy, paired statistics, fidelity,
MTP acceptance; timings aside). A run with an option that decides the results changed is refused in one line. And
progress is printed when stderr is a pipe, for validate and convert.

The commands run as forks of one process that imported npuport once (SERVER below): ten runs of the command cost
ten imports of torch otherwise. Each result line a killed run appends waits PAUSE_S first, so that a phase lasts
long enough to be signalled inside it, whatever the machine's speed; the signal comes a seeded random time after
the chosen number of results was seen, so it lands while a result is being made or just before one is written."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from npuport.runtime.validation.journal import PARTIAL_NAME, STATE_NAME, read_rows

SERVER = r"""
import json, os, sys, time

import torch

import npuport.runtime.validation.journal as journal
from npuport.cli import main

torch.set_num_threads(1)
real_write = journal.Appender.write
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        if request["pause"]:
            def write(self, row, pause=request["pause"]):
                time.sleep(pause)
                real_write(self, row)
            journal.Appender.write = write
        code = 0
        try:
            main(request["args"], prog_name="npuport")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""

QUESTIONS = 8
BATCH = 2
NEW_TOKENS = 16
MTP = 2
PAUSE_S = 0.25
SEED = 39
# (phase, as state.json names it, part; the file its results go to; how many results it has)
PHASES = (
    ("answers.jsonl", "answers.jsonl", QUESTIONS // BATCH),  # the artifact's answers: closed batches
    ("answers-reference.jsonl", "answers-reference.jsonl", QUESTIONS // BATCH),
    ("fidelity", "fidelity.jsonl", QUESTIONS),  # sequences
    ("throughput", "throughput.jsonl", 4),  # W8A8, W8A8 + MTP, BF16, BF16 + MTP
)


class Server:
    """The fork server: `start(args, log)` forks a run of `npuport ARGS`, `wait()` its exit status."""

    def __init__(self) -> None:
        env = {**os.environ, "NPUPORT_PROGRESS_INTERVAL": "0", "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=env)
        self.pid: int | None = None

    def start(self, args: list[str], log: Path, pause: float = 0.0) -> int:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"args": args, "log": str(log), "pause": pause}) + "\n")
        self.process.stdin.flush()
        self.pid = int(self.process.stdout.readline())
        return self.pid

    def wait(self) -> int:
        assert self.process.stdout is not None
        return int(self.process.stdout.readline())

    def run(self, args: list[str], log: Path) -> int:
        self.start(args, log)
        return self.wait()

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The shipped trained tiny model (its MTP head is accepted) and its W8A8 artifact."""
    import shutil

    from npuport.convert.converter import convert_qwen35
    from npuport.fixtures.train_tiny import trained_tiny_path

    root = tmp_path_factory.mktemp("resume-models")
    source = root / "source"
    shutil.copytree(trained_tiny_path(), source, ignore=shutil.ignore_patterns("README.md"))
    artifact = convert_qwen35(source, root / "artifact", show_progress=False, log=lambda _: None).out
    return source, artifact


def validate_args(models, out: Path, *extra: str) -> list[str]:
    from npuport.fixtures.arithmetic import arithmetic_path

    source, artifact = models
    return ["validate", "--gsm8k", str(artifact), "--reference", str(source), "--data", str(arithmetic_path()),
            "--num-questions", str(QUESTIONS), "--max-new-tokens", str(NEW_TOKENS), "--batch-size", str(BATCH),
            "--mtp", str(MTP), "--device", "cpu", "--dtype", "float32", "--out", str(out), *extra]


def done_in(out: Path, name: str) -> int:
    """Results a phase has finished, as its file says (answers: closed batches)."""
    path = out / name
    if not path.exists():
        return 0
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return sum("batch" in r for r in lines) if name.startswith("answers") else len(lines)


def phase_of(out: Path) -> str:
    try:
        return json.loads((out / STATE_NAME).read_text())["phase"]
    except (OSError, ValueError, KeyError):
        return ""


def without_timings(report: dict, out: Path) -> dict:
    """report.json less what a clock measured (latencies, throughput figures), its folder `out` named OUT."""
    report = json.loads(json.dumps(report).replace(str(out), "OUT"))
    for row in report["gsm8k"]:
        for side in ("candidate", "reference"):
            for key in ("latency_s", "output_throughput"):
                row[side].pop(key, None)
    report["throughput"] = [{k: run[k] for k in ("label", "mtp", "batch_size", "model", "repeats")}
                            for run in report["throughput"]]
    report.pop("throughput_differences", None)
    report.pop("mtp_decode_speedup", None)
    return report


def test_validate_killed_in_every_phase_resumes_to_the_uninterrupted_report(server, models, tmp_path):
    rng = random.Random(SEED)
    started = time.monotonic()
    whole = tmp_path / "whole"
    assert server.run(validate_args(models, whole), tmp_path / "whole.log") == 0
    uninterrupted_s = time.monotonic() - started

    out, log = tmp_path / "stopped", tmp_path / "stopped.log"
    first = True
    runs = 0
    for phase, name, total in PHASES:
        for signum in (signal.SIGTERM, signal.SIGKILL):
            # the first run starts the folder; later ones continue it, with --resume or as the same command again
            extra = [] if first or runs % 2 else ["--resume"]
            pid = server.start(validate_args(models, out, *extra), log, pause=PAUSE_S)
            first, runs = False, runs + 1
            deadline = time.monotonic() + 300
            while phase not in phase_of(out):
                assert time.monotonic() < deadline, f"never reached {phase}: {log.read_text()[-2000:]}"
                time.sleep(0.01)
            at = rng.randrange(done_in(out, name), total)  # results done when signalled: at least one is left
            while done_in(out, name) < at:
                assert time.monotonic() < deadline, f"stuck in {phase}: {log.read_text()[-2000:]}"
                time.sleep(0.01)
            time.sleep(rng.uniform(0, PAUSE_S * 0.8))
            os.kill(pid, signum)
            code = server.wait()
            assert code == (128 + signum if signum == signal.SIGTERM else -signum), log.read_text()[-2000:]
            assert phase in phase_of(out), f"{signum.name} meant for {phase} came in {phase_of(out)}"
            assert (out / PARTIAL_NAME).is_file() and not (out / "report.md").exists()
        if phase == "answers.jsonl":  # an option that decides the results changed: refused, naming it
            code = server.run(validate_args(models, out, "--resume", "--seed", "7"), log)
            assert code == 1 and "--seed 1234, and this run has --seed 7" in log.read_text()
    assert server.run(validate_args(models, out, "--resume"), log) == 0, log.read_text()[-2000:]
    took = time.monotonic() - started

    resumed, reference = (json.loads((o / "report.json").read_text()) for o in (out, whole))
    assert without_timings(resumed, out) == without_timings(reference, whole)
    assert (out / "completions.jsonl").read_text() == (whole / "completions.jsonl").read_text()
    assert resumed["fidelity"] == reference["fidelity"] and resumed["mtp"] == reference["mtp"]
    assert not (out / PARTIAL_NAME).exists() and json.loads((out / STATE_NAME).read_text())["status"] == "complete"
    text = log.read_text()
    assert "resuming the validation" in text and "kept from the stopped run" in text
    assert "keeps what was finished; the same command with --resume continues it" in text  # said on SIGTERM
    # --resume on a finished folder writes the same report again, measuring nothing
    assert server.run(validate_args(models, out, "--resume"), log) == 0
    again = json.loads((out / "report.json").read_text())
    assert without_timings(again, out) == without_timings(reference, whole)
    assert "its report is written again from its results" in log.read_text()
    assert f"/{QUESTIONS} questions" in text and "fidelity: " in text and "calls" in text  # progress lines
    print(f"uninterrupted run {uninterrupted_s:.1f} s; 8 kills and resumes {took - uninterrupted_s:.1f} s")


def test_a_cut_last_line_is_dropped_and_cut_from_the_file(tmp_path):
    path = tmp_path / "answers.jsonl"
    path.write_text('{"question": 0, "text": "4"}\n{"question": 1, "te')
    assert read_rows(path) == [{"question": 0, "text": "4"}]
    assert path.read_text() == '{"question": 0, "text": "4"}\n'


def test_resume_needs_a_stopped_run(models, tmp_path):
    from npuport.errors import NpuportError
    from npuport.runtime.validation.validate import ValidateOptions, run_validation

    with pytest.raises(NpuportError, match="holds no validation to resume"):
        run_validation(ValidateOptions(models[1], resume=True, device="cpu"), tmp_path / "none", log=lambda _: None)


# ---------------------------------------------------------------------------------------------------------
# Progress when stderr is not a terminal


class PipeStderr:
    """sys.stderr replaced by the write end of a pipe, read by a thread; `text` once closed."""

    def __enter__(self) -> PipeStderr:
        read, write = os.pipe()
        self.reader, self.writer = os.fdopen(read, "r"), os.fdopen(write, "w")
        self.chunks: list[str] = []
        self.thread = threading.Thread(target=lambda: self.chunks.append(self.reader.read()))
        self.thread.start()
        self.saved, sys.stderr = sys.stderr, self.writer
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stderr = self.saved
        self.writer.close()
        self.thread.join()
        self.reader.close()
        self.text = "".join(self.chunks)


@pytest.mark.usefixtures("one_cpu_thread")
def test_progress_lines_appear_when_stderr_is_a_pipe(models, tmp_path, monkeypatch):
    from npuport.convert.converter import convert_qwen35
    from npuport.fixtures.arithmetic import arithmetic_path
    from npuport.runtime.validation.validate import ValidateOptions, run_validation

    monkeypatch.setenv("NPUPORT_PROGRESS_INTERVAL", "0")
    source, artifact = models
    with PipeStderr() as converted:
        assert not sys.stderr.isatty()
        convert_qwen35(source, tmp_path / "artifact", log=lambda _: None)
    assert "convert: " in converted.text and "GB of the source" in converted.text and "\r" not in converted.text

    options = ValidateOptions(artifact, data=arithmetic_path(), num_questions=2, max_new_tokens=8, batch_size=1,
                              reference=source, device="cpu", dtype="float32", throughput=False)
    with PipeStderr() as validated:
        run_validation(options, tmp_path / "validation", log=lambda _: None)
    lines = validated.text.splitlines()
    for label in ("W8A8", "BF16"):
        assert any(line.startswith(label) and "1/2 questions" in line and "tokens" in line and "left" in line
                   for line in lines), validated.text
    assert any(line.startswith("fidelity: 2/2 sequences") for line in lines), validated.text
    assert "\r" not in validated.text
