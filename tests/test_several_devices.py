"""`--devices N` on the command line: the commands run split over N processes (gloo on CPU), rank 0 driving and the
others following its loads and calls (runtime/lockstep.py). In float32 their output is the single-process
output: the same tokens, texts, stop decisions and acceptance for generate, the same answers for validate."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from npuport.cli import main
from npuport.runtime.dispatch import dispatch
from npuport.runtime.expert_parallel import recording_dispatch
from npuport.runtime.generate import generate
from npuport.runtime.loader import load_model
from npuport.runtime.several_devices import on_devices

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def run(args: list[str]) -> str:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("kind", ["moe-text-per-expert", "dense-text"])
def test_generate_on_two_devices_gives_the_single_device_output(tiny_checkpoints, kind):
    args = ["generate", str(tiny_checkpoints[kind]), "--prompt", "Question: what is 2+2?", "--prompt-ids", "5,6,7",
            "--max-new-tokens", "8", "--mtp", "2", "--dtype", "float32", "--device", "cpu", "--json"]
    one, two = json.loads(run(args)), json.loads(run([*args, "--devices", "2"]))
    assert (one["devices"], two["devices"]) == (1, 2)
    assert two["requests"] == one["requests"] and two["acceptance"] == one["acceptance"]


def test_validate_on_two_devices_answers_as_on_one(tiny_artifacts, tmp_path):
    args = ["validate", str(tiny_artifacts["moe-multimodal-fused"]), "--gsm8k", "--num-questions", "2",
            "--max-new-tokens", "12", "--batch-size", "2", "--mtp", "1", "--no-throughput", "--dtype", "float32",
            "--device", "cpu", "--min-accuracy", "off"]  # random weights answer at chance: the default floor fails
    run([*args, "--out", str(tmp_path / "one")])
    run([*args, "--devices", "2", "--out", str(tmp_path / "two")])
    one, two = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("one", "two"))
    answers = [[s["predictions"] for s in r["gsm8k"][0]["candidate"]["scores"]] for r in (one, two)]
    assert answers[1] == answers[0]
    assert two["mtp"] == one["mtp"]
    assert "x 2 (tensor + expert parallel)" in two["device"] and "x 2" not in one["device"]
    rows = [(tmp_path / d / "completions.jsonl").read_text().splitlines() for d in ("one", "two")]
    assert [json.loads(r)["text"] for r in rows[1]] == [json.loads(r)["text"] for r in rows[0]]


def test_devices_with_an_endpoint_is_refused(tiny_artifacts):
    result = CliRunner().invoke(main, ["validate", str(tiny_artifacts["dense-text"]), "--gsm8k", "--devices", "2",
                                       "--endpoint", "http://127.0.0.1:9/v1"])
    assert result.exit_code == 1 and "--devices splits the built-in runtime's model" in result.output


def test_more_devices_than_the_model_has_heads_fail_in_one_line(tiny_checkpoints):
    result = CliRunner().invoke(main, ["generate", str(tiny_checkpoints["dense-text"]), "--prompt-ids", "1,2",
                                       "--device", "cpu", "--devices", "3"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "error: 3 devices do not divide the 4 attention heads; use a device count that divides it"]


def generate_under_bf16_dispatch(path: str) -> tuple[list[list[int]], set]:
    model = load_model(path, "cpu", torch.float32)
    with recording_dispatch() as records, dispatch(bf16=True):
        tokens = generate(model, [[5, 6, 7], [9, 8, 7, 6, 5]], 4).tokens
    return tokens, {r.payload for r in records}


def test_rank_0s_dispatch_setting_holds_on_every_rank(tiny_artifacts):
    path = str(tiny_artifacts["moe-multimodal-fused"])  # W8A8 experts: int8 dispatch unless told otherwise
    tokens, payloads = on_devices(generate_under_bf16_dispatch, (path,), 2, "cpu")
    assert payloads == {torch.float32}
    assert tokens == generate_under_bf16_dispatch(path)[0]


def test_serve_on_two_devices_answers_as_on_one_and_stops_every_rank(tiny_artifacts):
    from tests.test_serve import post, serve_process

    model = tiny_artifacts["moe-multimodal-fused"]
    payload = {"model": str(model), "prompt": ["Question: 2 + 3 =", "Tom has 4 apples."], "max_tokens": 8,
               "temperature": 0}
    answers, scores, ranks = [], [], set()
    for options in ((), ("--devices", "2")):
        with serve_process(model, "--dtype", "float32", *options) as url:
            status, body = post(url, payload)
            assert status == 200, body
            answers.append([choice["text"] for choice in body["choices"]])
            # echo + logprobs: the prompt's prefill and the logits' gathers are collectives on two devices
            status, scored = post(url, {**payload, "max_tokens": 2, "echo": True, "logprobs": 2})
            assert status == 200, scored
            scores.append([choice["logprobs"] for choice in scored["choices"]])
            ranks = spawned_descendants()
    assert answers[1] == answers[0] and all(answers[0])
    for one, two in zip(*scores, strict=True):
        assert one["tokens"] == two["tokens"]
        for top_one, top_two in zip(one["top_logprobs"][1:], two["top_logprobs"][1:], strict=True):
            assert top_one.keys() == top_two.keys()  # float32: the split rounds sums in another order
            assert list(top_one.values()) == pytest.approx(list(top_two.values()), abs=1e-4)
    assert len(ranks) == 2, ranks  # the server's own ranks, whatever else runs on the machine
    deadline = time.monotonic() + 60  # bounds a hang only
    while {pid for pid in ranks if alive(pid)} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not {pid for pid in ranks if alive(pid)}  # stopping the server stopped its ranks


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie counts as gone)."""
    try:
        return ") Z " not in (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False


def spawned_descendants() -> set[int]:
    """Live processes below this one started by torch.multiprocessing's spawn."""
    parents, spawned = {}, set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            status = (proc / "status").read_text()
            parents[int(proc.name)] = int(status.split("PPid:")[1].split()[0])
            if b"spawn_main" in (proc / "cmdline").read_bytes() and alive(int(proc.name)):
                spawned.add(int(proc.name))
        except (OSError, IndexError, ValueError):
            continue

    def below_this_process(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    return {pid for pid in spawned if below_this_process(pid)}
