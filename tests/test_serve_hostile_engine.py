"""What one hostile request can make the model side of `npuport serve` do: a long prompt's prefill runs in
chunks of bounded width (its memory stays bounded, its output that of one pass), a huge text prompt is refused
by its size before it is tokenized and is tokenized without holding up other requests, a request whose client
left stops generating, and a request with many long rows does not keep a later one waiting until it ends."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from npuport.runtime.generate import generate
from npuport.runtime.loader import load_model
from npuport.runtime.prefill import pad_prompts, prefill, prefill_chunk_width
from npuport.runtime.sampling import SamplingParams
from npuport.runtime.serving.api_requests import ChatRequest, CompletionRequest, Generation, RequestError
from npuport.runtime.serving.batching import Job, RequestBatcher
from npuport.runtime.serving.service import OpenAIService, peer_closed
from npuport.runtime.text_completions import RuntimeCompletions, TextRequest

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

KIND = "dense-text"


# -- a long prompt: its prefill in chunks of bounded width ----------------------------------------------------

@pytest.fixture(scope="module")
def model64(tiny_checkpoints):
    return load_model(tiny_checkpoints[KIND], "cpu", torch.float64)


def long_prompts(lengths: list[int]) -> list[list[int]]:
    return [[(97 * i + 13 * row) % 1900 + 5 for i in range(n)] for row, n in enumerate(lengths)]


@torch.no_grad()
def test_a_long_prompt_is_prefilled_in_chunks_with_the_output_of_one_pass(model64):
    """Prompts longer than the default chunk (four rows: 512 tokens wide; two rows: 1,024): the greedy tokens,
    with and without MTP, are those of a prefill in one pass, and forward's hidden states, gathered chunk by
    chunk, are one pass's (float64)."""
    prompts = long_prompts([800, 200, 600, 530])
    assert prefill_chunk_width(len(prompts)) < 800
    for mtp in (0, 2):
        chunked = generate(model64, prompts, 6, mtp=mtp)
        assert chunked.tokens == generate(model64, prompts, 6, mtp=mtp, prefill_chunk=800).tokens
    tokens, lengths = pad_prompts(long_prompts([1100, 600]), model64.device)
    assert prefill_chunk_width(2) < 1100
    chunked_states: list[torch.Tensor] = []
    whole_states: list[torch.Tensor] = []
    chunked = prefill(model64, model64.new_state(2, 1100), tokens, lengths, hidden_states=chunked_states)
    whole = prefill(model64, model64.new_state(2, 1100), tokens, lengths, 1100, hidden_states=whole_states)
    assert len(chunked_states) == len(whole_states) == len(model64.layers) + 1
    for got, want in zip([chunked, *chunked_states], [whole, *whole_states], strict=True):
        for row, n in enumerate(lengths.tolist()):
            torch.testing.assert_close(got[row, :n], want[row, :n], rtol=1e-10, atol=1e-10)


@torch.no_grad()
def test_echoed_log_probabilities_come_from_logits_a_chunk_of_positions_at_a_time(model64, monkeypatch):
    """An echo + logprobs request over a long prompt: never the whole prompt's logits at once (at Qwen3.5's
    vocabulary [T, V] is 16 GB for 32k tokens), and the values a naive float64 log-softmax over one pass's logits
    gives."""
    from npuport.runtime import token_logprobs as logprobs_module

    sequence = long_prompts([700])[0]
    logits = model64.logits(prefill(model64, model64.new_state(1, 700), *pad_prompts([sequence], "cpu"), 700))[0]
    naive = torch.log_softmax(logits, dim=-1)
    widest, real_logits = [], model64.logits

    def logits_noting_rows(hidden: torch.Tensor) -> torch.Tensor:
        widest.append(hidden.shape[:-1].numel())  # positions, whatever the leading dimensions
        return real_logits(hidden)

    monkeypatch.setattr(model64, "logits", logits_noting_rows)
    got = logprobs_module.sequence_logprobs(model64, sequence, 3)
    assert max(widest) <= logprobs_module.LOGPROB_CHUNK < len(sequence)
    assert [p.token for p in got] == sequence[1:]
    for i, position in enumerate(got, start=1):
        assert position.logprob == pytest.approx(naive[i - 1, sequence[i]].item(), abs=1e-9)
        values, ids = naive[i - 1].topk(3)
        assert [t for t, _ in position.top] == ids.tolist()
        assert [v for _, v in position.top] == pytest.approx(values.tolist(), abs=1e-9)


PEAK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from npuport.runtime.generate import generate
    from npuport.runtime.loader import load_model

    def peak_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024

    torch.set_num_threads(1)
    model = load_model(sys.argv[1], "cpu", torch.bfloat16)
    generate(model, [[5, 6, 7]], 2)  # every lazy allocation of a generate call made
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak back to the present
    before = peak_mb()
    generate(model, [[(97 * i) % 1900 + 5 for i in range(int(sys.argv[2]))]], 1)
    print(json.dumps({"growth_mb": peak_mb() - before}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak resident memory from /proc")
def test_the_peak_memory_of_an_8k_token_prefill_stays_bounded(tiny_checkpoints):
    """The peak resident memory an 8,192-token prompt adds, in a fresh process (VmHWM: ru_maxrss would start at
    the parent's peak, which exec keeps): one pass holds an attention mask (and its float copy) of 8,192 x 8,192
    positions, about 230 MB on this model; chunks of at most 2,048 positions hold a quarter of it."""
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tiny_checkpoints[KIND]), "8192"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    growth = json.loads(done.stdout.strip().splitlines()[-1])["growth_mb"]
    assert growth < 110, f"an 8,192-token prefill grew the peak memory by {growth:.0f} MB"


# -- the service: tokenizing, clients that leave, fair turns ---------------------------------------------------

PROMPT = "Question: Tom has 3 apples and buys 4 more. How many now?\nAnswer:"
GENEROUS_S = 60.0  # bounds a hang only


@pytest.fixture(scope="module")
def runner(tiny_checkpoints) -> RuntimeCompletions:
    """The model without its stop tokens: a row ends at its max_tokens (or when cancelled), never early by EOS."""
    loaded = RuntimeCompletions.load(tiny_checkpoints[KIND], device="cpu", dtype="float32")
    return RuntimeCompletions(loaded.model, loaded.tokenizer, (), batch_size=4, context_tokens=loaded.context_tokens)


@pytest.fixture
def service(runner) -> Iterator[OpenAIService]:
    service = OpenAIService(runner, "tiny", runner.batch_size)
    yield service
    service.close()


def completion(prompts: list, max_tokens: int, n: int = 1, **generation) -> CompletionRequest:
    return CompletionRequest(prompts, Generation(max_tokens, [], SamplingParams(), n, **generation))


def until(condition: Callable[[], bool], timeout: float = GENEROUS_S) -> bool:
    """Whether condition() comes true within timeout seconds (looked at every 10 ms)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def inside(thread: threading.Thread, function: str) -> bool:
    """Whether `thread` is running `function` now, by its stack as the interpreter holds it."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def in_thread(target: Callable[[], object]) -> tuple[threading.Thread, dict]:
    """target() started in a thread of its own; the dict gets its "result" or its "error"."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = target()
        except Exception as e:  # noqa: BLE001 - handed to the test
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_small_request_is_answered_while_a_huge_text_prompt_is_tokenized(service):
    """A text prompt of 1 MB (a few seconds to tokenize): while its request's thread is inside the tokenizer, a
    small request is tokenized, generated and answered, and the huge one then ends on its own (refused: more
    tokens than the model's context)."""
    huge = ("Tom has 3 apples and buys 4 more. " * 31000)[:1_000_000]
    big, outcome = in_thread(lambda: service.prepare_completion(completion([huge], 1)))
    assert until(lambda: inside(big, "encode") or not big.is_alive())
    assert big.is_alive(), "the huge prompt was tokenized before the small request could start"
    answer = service.answer(service.prepare_completion(completion([PROMPT], 2)))
    still_tokenizing = big.is_alive()
    big.join(GENEROUS_S)
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 2
    assert still_tokenizing, "the small request waited for the huge prompt's tokenization"
    assert isinstance(outcome.get("error"), RequestError) and "context" in str(outcome["error"])


def test_a_text_prompt_over_the_byte_limit_is_refused_untokenized(runner):
    service = OpenAIService(runner, "tiny", 1, max_prompt_bytes=1000)
    try:
        with pytest.raises(RequestError, match="prompt 1 is 1,200 bytes of text; this server tokenizes at most "
                                               "1,000") as refused:
            service.prepare_completion(completion(["x", "é" * 600], 1))
        assert refused.value.status == 400 and refused.value.param == "prompt"
        with pytest.raises(RequestError, match="the rendered chat is .* bytes of text") as refused:
            service.prepare_chat(ChatRequest([{"role": "user", "content": "y" * 1000}],
                                             Generation(1, [], SamplingParams())))
        assert refused.value.param == "messages"
        assert service.prepare_completion(completion(["x" * 1000], 1)).prompt_ids[0]
    finally:
        service.close()


def test_a_text_prompt_is_counted_against_the_prompt_limit_once_tokenized(service):
    """The limit's default byte bound: 16 bytes for each token the request's prompts may have."""
    with pytest.raises(RequestError, match="prompt 1 has .* tokens; this server takes at most 5"):
        service.prepare_completion(completion(["a", PROMPT], 1, max_prompt_tokens=5))
    with pytest.raises(RequestError, match="at most 80 bytes"):
        service.prepare_completion(completion(["a" * 81], 1, max_prompt_tokens=5))


def connected_pair() -> tuple[socket.socket, socket.socket]:
    """(the client's end, the server's end) of a real TCP connection on loopback."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname(), timeout=GENEROUS_S)
        server_end, _ = listener.accept()
    return client, server_end


def test_a_request_whose_client_left_stops_generating_and_the_worker_goes_idle(service):
    """A request for 200,000 tokens whose client closes its connection once generation runs: its wait ends with
    ConnectionAbortedError, its rows stop at their next check, a short request is answered and nothing is left
    in flight."""
    client, server_end = connected_pair()
    with server_end:
        prepared = service.prepare_completion(completion([PROMPT], 200_000))
        waiting, outcome = in_thread(lambda: service.answer(prepared, client_gone=lambda: peer_closed(server_end)))
        assert until(lambda: inside(service.batcher.worker, "_decode"))
        assert not peer_closed(server_end)
        client.close()
        waiting.join(GENEROUS_S)
        assert isinstance(outcome.get("error"), ConnectionAbortedError)
        short, short_outcome = in_thread(lambda: service.answer(service.prepare_completion(completion([PROMPT], 2))))
        short.join(GENEROUS_S)
        assert short_outcome["result"]["usage"]["completion_tokens"] == 2
        assert until(lambda: service.batcher.in_flight == 0), "the request whose client left is still generating"
        worker = service.batcher.worker
        assert until(lambda: inside(worker, "_arrivals") and not inside(worker, "_iterate"))  # waits for work


def test_a_client_that_leaves_a_non_streaming_request_stops_its_generation_over_http(runner):
    """Through `npuport serve`'s HTTP layer: a request for 20,000 tokens whose client closes its connection once
    the server works on it: its rows stop (cancelled), nothing stays in flight, the next short request is
    answered."""
    from contextlib import closing

    from npuport.runtime.serving.limits import ServeLimits
    from npuport.runtime.serving.serve import make_server
    from tests.test_serve import post, running
    from tests.test_serve_limits import address

    server = make_server(runner, "tiny", limits=ServeLimits(max_tokens=20_000))  # a failure ends, if slowly
    with running(server) as url:
        body = json.dumps({"prompt": PROMPT, "max_tokens": 20_000, "temperature": 0}).encode()
        with closing(socket.create_connection(address(url))) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            assert until(lambda: server.service.batcher.in_flight == 1)
        assert until(lambda: server.service.batcher.in_flight == 0), "the request whose client left still runs"
        status, answer = post(url, {"prompt": PROMPT, "max_tokens": 2})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_client_left_is_logged_as_cancelled_not_as_a_dropped_connection(runner, stream):
    """A client that closes its connection while its request generates: the server's request log says the request
    was cancelled, and the operator's error channel (internal errors, dropped connections) hears nothing of it."""
    from contextlib import closing

    from npuport.runtime.serving.limits import ServeLimits
    from npuport.runtime.serving.serve import make_server
    from tests.test_serve import running
    from tests.test_serve_limits import address

    logs: list[str] = []
    reports: list[str] = []
    server = make_server(runner, "tiny", limits=ServeLimits(max_tokens=20_000), log=logs.append,
                         report=reports.append)
    with running(server) as url:
        body = json.dumps({"prompt": PROMPT, "max_tokens": 20_000, "temperature": 0, "stream": stream}).encode()
        with closing(socket.create_connection(address(url))) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            assert until(lambda: server.service.batcher.in_flight == 1)
            if stream:
                assert client.recv(1)  # the stream has begun
        assert until(lambda: server.service.batcher.in_flight == 0), "the request whose client left still runs"
        assert until(lambda: any("cancelled" in line for line in logs))
    [line] = [line for line in logs if "cancelled" in line]
    assert line.split(" ", 1)[1].startswith("127.0.0.1 POST /v1/completions cancelled ")
    assert line.endswith(": the client went away")
    assert reports == []


def test_a_cancelled_jobs_rows_stop_at_their_next_check_reported_cancelled(runner):
    """Cancelled once its rows have made tokens, a job of 100,000-token rows ends within a few checks of that."""
    batcher = RequestBatcher(runner, 4)
    made: list[int] = []
    job = Job([TextRequest(runner.encode(PROMPT), 100_000)] * 2, SamplingParams(),
              on_tokens=lambda row, new: made.extend(new))
    try:
        future = batcher.submit(job)
        assert until(lambda: len(made) >= 16)
        job.cancel()
        rows = future.result(GENEROUS_S)
    finally:
        batcher.close()
    assert [r.result.completion.finish_reason for r in rows] == ["cancelled", "cancelled"]
    assert all(0 < len(r.result.token_ids) < 1000 for r in rows)


def test_a_request_after_a_big_one_is_answered_long_before_it(service):
    """8 rows of 100,000 tokens each (a batch holds 4) and then a request of 2 tokens: the small one is answered
    while the big one still runs, which then goes on until its client leaves."""
    big_gone = threading.Event()
    prepared = service.prepare_completion(completion([PROMPT], 100_000, n=8))
    big, big_outcome = in_thread(lambda: service.answer(prepared, client_gone=big_gone.is_set))
    try:
        assert until(lambda: inside(service.batcher.worker, "_decode"))
        small, small_outcome = in_thread(lambda: service.answer(service.prepare_completion(completion([PROMPT], 2))))
        small.join(GENEROUS_S)
        big_running = big.is_alive()
    finally:
        big_gone.set()
        big.join(GENEROUS_S)
    assert small_outcome["result"]["usage"]["completion_tokens"] == 2
    assert big_running, "the big request ended before the small one was answered"
    assert isinstance(big_outcome.get("error"), ConnectionAbortedError)
    assert until(lambda: service.batcher.in_flight == 0)


@pytest.fixture(scope="module")
def runner64(tiny_checkpoints) -> RuntimeCompletions:
    return RuntimeCompletions.load(tiny_checkpoints[KIND], device="cpu", dtype="float64", batch_size=2)


def test_rows_that_give_way_and_resume_answer_as_if_never_interrupted(runner64):
    """Three greedy requests, one row a call, rounds of 8 tokens: each row is interrupted and resumed several times
    (its prompt and tokens prefilled again), yet answers - text, tokens, finish reason, stop string, streamed
    tokens - as its own uninterrupted run does (float64); a seeded request answers the same whatever waits."""
    stopped = runner64.encode("Question: 5 x 6 =\nAnswer:")
    free = runner64.run([TextRequest(stopped, 40)])[0][0]
    stop = free.completion.text[len(runner64.decode(free.token_ids[:20])):][:3]  # its text after 20 tokens
    rows = [TextRequest(runner64.encode(PROMPT), 40), TextRequest(runner64.encode("Question: 12 + 30 =\nAnswer:"), 33),
            TextRequest(stopped, 40, (stop,))]
    alone = [runner64.run([row])[0][0] for row in rows]
    calls: list[int] = []

    class Counted(RuntimeCompletions):
        def run(self, requests, *args, **kwargs):
            calls.append(len(requests))
            return super().run(requests, *args, **kwargs)

    counted = Counted(runner64.model, runner64.tokenizer, runner64.stop_tokens, context_tokens=runner64.context_tokens)
    batcher = RequestBatcher(counted, 1, round_tokens=8)
    streamed: dict[int, list[int]] = {i: [] for i in range(len(rows))}
    try:
        jobs = [Job([row], SamplingParams(), on_tokens=lambda _, new, i=i: streamed[i].extend(new))
                for i, row in enumerate(rows)]
        answers = [future.result(GENEROUS_S)[0].result for future in [batcher.submit(job) for job in jobs]]
        greedy_calls = len(calls)
        seeded = SamplingParams(temperature=1.0, seed=11)
        by_itself = batcher.submit(Job([rows[0]], seeded)).result(GENEROUS_S)[0].result
        with_others = [batcher.submit(job) for job in (Job([rows[1]], SamplingParams()), Job([rows[0]], seeded))]
        with_others = with_others[1].result(GENEROUS_S)[0].result
    finally:
        batcher.close()
    assert [a.completion for a in answers] == [a.completion for a in alone]
    assert alone[2].completion.finish_reason == "stop"
    for got, want, tokens in zip(answers, alone, streamed.values(), strict=True):
        taken = want.completion.completion_tokens  # beyond it, tokens made before the stop check saw the stop
        assert got.token_ids[:taken] == want.token_ids[:taken] and tokens == got.token_ids
    assert greedy_calls >= sum(len(a.token_ids) for a in alone) // 10  # a call for about every round of 8 tokens
    assert with_others == by_itself and len(by_itself.token_ids) == 40
