"""`npuport serve` speaks the OpenAI API the harnesses use: prompts as token ids, `echo` and `logprobs` (checked
against transformers' log-softmax on the same checkpoint, float32: 1e-4), `n`, streaming (the chunks add up to
the answer a request without stream gets), chat completions through the model's own chat template (checked
against transformers' apply_chat_template), and requests in flight batched together (float64: each answer the
same as the request alone, and fewer generate calls than requests)."""

from __future__ import annotations

import json
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from npuport.fixtures.train_tiny import trained_tiny_path
from npuport.runtime.serving.serve import make_server
from npuport.runtime.text_completions import RuntimeCompletions
from tests.test_serve import call, post, running

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PROMPT = "Question: Tom has 3 apples and buys 4 more. How many now?\nAnswer:"


@pytest.fixture(scope="module")
def source(tiny_checkpoints):
    return tiny_checkpoints["dense-text"]


@pytest.fixture(scope="module")
def runner(source) -> RuntimeCompletions:
    return RuntimeCompletions.load(source, device="cpu", dtype="float32", batch_size=8)


def events(url: str, path: str, payload: dict) -> list:
    """The server-sent events of a streamed request, parsed; the literal [DONE] kept as a string."""
    request = urllib.request.Request(url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        body = response.read().decode()
    out = []
    for block in body.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_token_id_prompts_are_served_as_their_text_is(runner):
    ids = runner.encode(PROMPT)
    with running(make_server(runner, "tiny")) as url:
        by_text = post(url, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})[1]
        by_ids = post(url, {"prompt": ids, "max_tokens": 8, "temperature": 0})[1]
        several = post(url, {"prompt": [ids, ids[:5]], "max_tokens": 8, "temperature": 0})[1]
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)
    assert [c["index"] for c in several["choices"]] == [0, 1]
    assert several["choices"][0]["text"] == by_text["choices"][0]["text"]


def test_echo_and_logprobs_are_transformers_log_softmax(runner, source):
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids = runner.encode(PROMPT)
    with running(make_server(runner, "tiny")) as url:
        echoed = post(url, {"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 5,
                            "return_tokens_as_token_ids": True})[1]["choices"][0]
        plain = post(url, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 2})[1]["choices"][0]
    tokens = [int(t.removeprefix("token_id:")) for t in echoed["logprobs"]["tokens"]]
    assert tokens[:len(ids)] == ids and len(tokens) == len(ids) + 3
    assert echoed["text"] == runner.decode(ids) + plain["text"]
    with torch.no_grad():
        want = torch.log_softmax(reference(torch.tensor([tokens])).logits[0].double(), dim=-1)
    got = echoed["logprobs"]
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    for i in range(1, len(tokens)):
        assert abs(got["token_logprobs"][i] - want[i - 1, tokens[i]].item()) < 1e-4, i
        top = {int(t.removeprefix("token_id:")): lp for t, lp in got["top_logprobs"][i].items()}
        values, order = want[i - 1].topk(5)
        assert list(top) == order.tolist(), i
        assert max(abs(top[t] - v) for t, v in zip(order.tolist(), values.tolist(), strict=True)) < 1e-4
    # without echo: the generated tokens only, as text
    assert len(plain["logprobs"]["tokens"]) == 3 and "".join(plain["logprobs"]["tokens"]) == plain["text"]
    assert all(len(top) == 2 for top in plain["logprobs"]["top_logprobs"])
    assert plain["logprobs"]["token_logprobs"] == pytest.approx(got["token_logprobs"][len(ids):], abs=1e-4)


def test_n_gives_n_choices_and_a_seed_the_same_draws(runner):
    with running(make_server(runner, "tiny")) as url:
        greedy = post(url, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "n": 3})[1]["choices"]
        sampled = [post(url, {"prompt": [PROMPT, "Question: 2 + 2 =\nAnswer:"], "max_tokens": 6, "temperature": 1.0,
                              "n": 3, "seed": 7})[1]["choices"] for _ in range(2)]
    assert [c["index"] for c in greedy] == [0, 1, 2] and len({c["text"] for c in greedy}) == 1
    assert len(sampled[0]) == 6 and [c["text"] for c in sampled[0]] == [c["text"] for c in sampled[1]]
    assert len({c["text"] for c in sampled[0][:3]}) > 1  # three draws, not one repeated


def test_a_stream_adds_up_to_the_answer_without_stream(runner):
    body = {"prompt": [PROMPT, "Question: 12 + 30 =\nAnswer:"], "max_tokens": 24, "temperature": 0}
    with running(make_server(runner, "tiny")) as url:
        whole = post(url, body)[1]
        text = whole["choices"][0]["text"]
        stop = text[6:9]
        stopped = post(url, {**body, "stop": [stop]})[1]
        chunks = events(url, "/v1/completions", {**body, "stop": [stop], "stream": True,
                                                 "stream_options": {"include_usage": True}})
    assert chunks[-1] == "[DONE]" and chunks[-2]["usage"] == stopped["usage"] and chunks[-2]["choices"] == []
    for choice in stopped["choices"]:
        mine = [c["choices"][0] for c in chunks[:-2] if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1])
    assert stopped["choices"][0]["finish_reason"] == "stop" and stop not in stopped["choices"][0]["text"]
    assert len([c for c in chunks[:-2] if c["choices"][0]["index"] == 0]) > 2  # it came in pieces


@pytest.fixture(scope="module")
def chat_runner() -> RuntimeCompletions:
    return RuntimeCompletions.load(trained_tiny_path(), device="cpu", dtype="float32", batch_size=4)


def test_chat_renders_the_models_template_and_streams(chat_runner):
    messages = [{"role": "system", "content": "You solve maths."},
                {"role": "user", "content": [{"type": "text", "text": "What is 3 + 4?"}]}]
    rendered = AutoTokenizer.from_pretrained(trained_tiny_path()).apply_chat_template(
        [messages[0], {"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True)
    with running(make_server(chat_runner, "trained")) as url:
        chat = post_chat(url, {"messages": messages, "max_completion_tokens": 20, "temperature": 0,
                               "logprobs": True, "top_logprobs": 3})
        plain = post(url, {"prompt": rendered, "max_tokens": 20, "temperature": 0})[1]
        chunks = events(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 20, "temperature": 0,
                                                      "stream": True})
    choice = chat["choices"][0]
    assert chat["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == plain["choices"][0]["text"]
    assert chat["usage"] == plain["usage"]
    content = choice["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] and all(len(e["top_logprobs"]) == 3 for e in content)
    assert all(e["logprob"] <= 0 and e["bytes"] == list(e["token"].encode()) for e in content)
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert chunks[-1] == "[DONE]" and deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == choice["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]


def post_chat(url: str, payload: dict) -> dict:
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_requests_in_flight_share_batches_and_answer_as_alone(source, monkeypatch):
    runner = RuntimeCompletions.load(source, device="cpu", dtype="float64", batch_size=8)
    bodies = [{"prompt": f"Question: {a} + {b} =\nAnswer:", "max_tokens": 6 + a, "temperature": 0,
               "stop": ["\n\n"] if a % 2 else []} for a, b in [(1, 2), (3, 9), (10, 4), (7, 7), (2, 30), (5, 5)]]
    rows_per_step: list[int] = []
    decode = runner.decode_slots

    def counted(n, rounds):
        rows_per_step.append(n)
        return decode(n, rounds)

    with running(make_server(runner, "tiny")) as url:
        alone = [post(url, body)[1]["choices"][0] for body in bodies]
        monkeypatch.setattr(runner, "decode_slots", counted)
        gate = threading.Barrier(len(bodies))

        def together(body: dict) -> dict:
            gate.wait()
            return post(url, body)[1]["choices"][0]

        with ThreadPoolExecutor(len(bodies)) as pool:
            batched = list(pool.map(together, bodies))
        models = call(url + "/v1/models")[1]
    assert batched == alone
    assert max(rows_per_step) > 1  # requests in flight decoded side by side
    assert models["data"][0]["id"] == "tiny"
