"""`npuport serve`: the OpenAI-compatible endpoint on the built-in runtime, checked against generate() and
the protocol's own stop-string rule, its refusals, and `npuport validate --endpoint` against a real
`npuport serve` process giving what the built-in runtime gives on the same questions."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner

from npuport.cli import main
from npuport.runtime.completion import cut_at_stop
from npuport.runtime.generate import generate
from npuport.runtime.serving.serve import make_server
from npuport.runtime.text_completions import RuntimeCompletions
from npuport.runtime.validation.endpoint import CompletionsEndpoint

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

KIND = "dense-text"
PROMPTS = ["Question: Tom has 3 apples and buys 4 more. How many now?\nAnswer:", "Question: 12 + 30 =\nAnswer:"]
START_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def runner(tiny_artifacts) -> RuntimeCompletions:
    return RuntimeCompletions.load(tiny_artifacts[KIND], device="cpu", batch_size=4)


@contextmanager
def running(server) -> Iterator[str]:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.url
    finally:
        server.shutdown()
        server.server_close()


def call(url: str, body: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(url: str, payload: dict) -> tuple[int, dict]:
    return call(url + "/v1/completions", json.dumps(payload).encode())


def test_completions_are_generate_decoded_and_cut_at_the_first_stop_string(runner):
    ids = [runner.tokenizer.encode(p) for p in PROMPTS]
    tokens = generate(runner.model, ids, 12, stop_tokens=runner.stop_tokens).tokens
    full = [runner.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    stop = full[0][4:7]  # a piece of the first continuation: that one must stop there
    with running(make_server(runner, "tiny")) as url:
        status, answer = post(url, {"model": "tiny", "prompt": PROMPTS, "max_tokens": 12, "temperature": 0,
                                    "stop": [stop]})
    assert status == 200 and answer["object"] == "text_completion" and answer["model"] == "tiny"
    choices = answer["choices"]
    assert [c["text"] for c in choices] == [cut_at_stop(f, [stop]) for f in full]
    assert choices[0]["finish_reason"] == "stop"

    def generated(t: list[int], text: str) -> int:
        """What a server checking after every token generates: up to the first token whose text holds the stop."""
        if stop not in text:
            return len(t)
        return next(n for n in range(1, len(t) + 1) if stop in runner.tokenizer.decode(t[:n], skip_special_tokens=True))

    assert answer["usage"]["completion_tokens"] == sum(generated(t, f) for t, f in zip(tokens, full, strict=True))
    assert answer["usage"]["prompt_tokens"] == sum(map(len, ids))


def test_the_library_client_reads_the_server(runner):
    with running(make_server(runner, "tiny")) as url:
        batch = CompletionsEndpoint(url, "tiny", parallel=2, timeout_s=60, retries=0).complete(PROMPTS, max_tokens=6)
        status, models = call(url + "/v1/models")
    direct = runner.complete(PROMPTS, max_tokens=6)
    assert batch.texts == direct.texts
    assert batch.completion_tokens == direct.completion_tokens == 12
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]


@pytest.mark.parametrize(("payload", "status", "message"), [
    ({"model": "other", "prompt": "x"}, 404, "is not served here"),
    ({"prompt": 5}, 400, "'prompt' must be"),
    ({"prompt": "x", "stream": True, "echo": True}, 400, "not streamed"),
    ({"prompt": "x", "presence_penalty": 0.5, "tools": [{"type": "function"}]}, 400,
     "'presence_penalty', 'tools' are not implemented"),
    ({"prompt": "x", "n": 17}, 400, "'n' is 17"),
    ({"prompt": ["x"] * 10, "n": 16}, 400, "make 160 completions"),
    ({"prompt": "x", "logprobs": 21}, 400, "'logprobs' is 21"),
    ({"prompt": [5, 999999]}, 400, "outside the vocabulary"),
    ({"prompt": [[5, 6], []]}, 400, "'prompt' must be"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens >= 1"),
    ({"prompt": "x", "stop": [""]}, 400, "'stop'"),
    ({"prompt": ""}, 400, "at least one token"),
])
def test_bad_requests_get_an_openai_style_error(runner, payload, status, message):
    with running(make_server(runner, "tiny")) as url:
        got, answer = post(url, payload)
        not_json = call(url + "/v1/completions", b"{not json")
        wrong_path = call(url + "/v1/embeddings", b"{}")
    assert got == status and message in answer["error"]["message"]
    assert not_json[0] == 400 and "not JSON" in not_json[1]["error"]["message"]
    assert wrong_path[0] == 404


@contextmanager
def serve_process(model: Path, *options: str) -> Iterator[str]:
    """`npuport serve MODEL --port 0 [options]` in its own process on 127.0.0.1; yields its URL once it listens."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "npuport.cli", "serve", str(model), "--port", "0",
                                "--device", "cpu", "--quiet", *options], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    try:
        seen = []
        while True:
            try:
                line = lines.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"npuport serve printed no URL within {START_TIMEOUT_S} s: {seen}")
            seen.append(line)
            if " on http://" in line:
                yield line.split(" on ", 1)[1].split("/v1", 1)[0]
                break
            if process.poll() is not None:
                pytest.fail(f"npuport serve exited with {process.returncode}: {''.join(seen)}")
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_validate_through_npuport_serve_equals_the_built_in_runtime(tiny_artifacts, tmp_path):
    """Same questions, same greedy decoding: the endpoint path must give the same texts, token counts and
    scores. The server runs one request at a time (batch 1), so the built-in run uses batch 1 as well (a
    different batch changes float rounding, which may change a token)."""
    artifact = tiny_artifacts[KIND]
    common = ["validate", "--gsm8k", str(artifact), "--num-questions", "3", "--max-new-tokens", "12", "--min-accuracy",
              "off"]  # random weights answer at chance, which the default floor fails
    with serve_process(artifact) as url:
        assert url.startswith("http://127.0.0.1:")
        by_endpoint = CliRunner().invoke(main, [*common, "--endpoint", url, "--parallel", "2", "--retries", "0",
                                                "--timeout", "60", "--out", str(tmp_path / "endpoint")])
    assert by_endpoint.exit_code == 0, by_endpoint.output
    built_in = CliRunner().invoke(main, [*common, "--batch-size", "1", "--device", "cpu", "--no-throughput",
                                         "--out", str(tmp_path / "runtime")])
    assert built_in.exit_code == 0, built_in.output

    def rows(folder: str) -> list[dict]:
        """The completions without the model's label: the built-in run names its compute dtype (float32 on a CPU),
        a server's dtype is not known to validate."""
        lines = (tmp_path / folder / "completions.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "model"} for line in lines]

    def scores(folder: str) -> dict:
        candidate = json.loads((tmp_path / folder / "report.json").read_text())["gsm8k"][0]["candidate"]
        return {k: candidate[k] for k in ("scores", "golds", "completion_tokens", "num_questions")}

    assert rows("endpoint") == rows("runtime")
    assert len(rows("endpoint")) == 3
    assert scores("endpoint") == scores("runtime")
    report = json.loads((tmp_path / "endpoint" / "report.json").read_text())
    assert report["device"] == f"endpoint {url}/v1/completions" and "throughput" not in report


def test_validate_sends_the_api_key_that_a_protected_serve_asks_for(runner, tiny_artifacts, tmp_path, monkeypatch):
    """`npuport serve --api-key` refuses requests without the bearer key (401); `validate --endpoint` sends it when
    given as --api-key or in NPUPORT_API_KEY / OPENAI_API_KEY, and every question is then answered."""
    for name in ("NPUPORT_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    artifact = tiny_artifacts[KIND]
    with running(make_server(runner, "tiny", api_key="k-1618")) as url:
        def validate(folder: str, *extra: str, env: dict | None = None):
            args = ["validate", "--gsm8k", str(artifact), "--endpoint", url, "--endpoint-model", "tiny",
                    "--num-questions", "2", "--max-new-tokens", "6", "--retries", "0", "--min-accuracy", "off",
                    "--out", str(tmp_path / folder)]
            return CliRunner().invoke(main, [*args, *extra], env=env)

        refused = validate("none")
        assert refused.exit_code == 1 and "401" in refused.output, refused.output
        for folder, extra, env in (("option", ("--api-key", "k-1618"), None),
                                   ("npuport", (), {"NPUPORT_API_KEY": "k-1618"}),
                                   ("openai", (), {"OPENAI_API_KEY": "k-1618"})):
            result = validate(folder, *extra, env=env)
            assert result.exit_code == 0, (folder, result.output)
            report = json.loads((tmp_path / folder / "report.json").read_text())
            assert report["gsm8k"][0]["candidate"]["num_questions"] == 2
            assert [f["failed"] for f in report["failed_questions"]] == [0]


def test_serve_starts_serving_with_its_startup_heap_frozen_out_of_the_collectors_reach(tiny_artifacts, monkeypatch):
    """Once `serve_model` has loaded the model and made its server, the model is in the collector's permanent
    generation (gc.get_objects lists the tracked objects of the generations a collection walks, not frozen ones)
    before the first request can arrive."""
    import gc

    from npuport.runtime.serving import serve

    seen = {}

    def serve_forever(server, *args, **kwargs):
        model = server.service.runner.model
        seen["frozen"] = gc.get_freeze_count()
        seen["walked"] = any(obj is model for obj in gc.get_objects())
        raise KeyboardInterrupt

    monkeypatch.setattr(serve.CompletionsServer, "serve_forever", serve_forever)
    try:
        serve.serve_model(tiny_artifacts[KIND], device="cpu", dtype="float32", announce=lambda line: None,
                          warn=lambda line: None)
    finally:
        gc.unfreeze()
    assert seen["frozen"] > 0
    assert seen["walked"] is False


def test_serve_help_states_the_prefill_budgets_the_batcher_uses():
    """The CLI keeps torch out of its import, so `serve --help` states the default prefill budgets as text: they
    must be the batcher's own."""
    from npuport.runtime.serving.continuous import PREFILL_TOKENS_CPU, PREFILL_TOKENS_DEVICE

    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0, result.output
    assert (f"Default: {PREFILL_TOKENS_CPU} on a CPU, {PREFILL_TOKENS_DEVICE} on a GPU / NPU."
            in " ".join(result.output.split()))
