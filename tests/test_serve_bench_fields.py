"""The fields serving benchmarks and vLLM's clients send, as vLLM defines them, against `npuport serve`:
`ignore_eos`, `min_tokens`, `stop_token_ids`, `include_stop_str_in_output` (the token counts checked against
generate() on the same model with no stop token, scanned here), `logprobs=0` (the chosen token's entry, no
alternatives), and a lone surrogate in a prompt or a chat message refused with 400 naming the field. Through the
`openai` client where it can send them (extra_body), raw HTTP for the rest (the client cannot encode a lone
surrogate at all; raw JSON carries it as the escape "\\ud800").

The shipped trained tiny model never writes its EOS in these answers, so the EOS cases run on the same model
with "\\n" standing as its EOS (a runner whose stop tokens are that id)."""

from __future__ import annotations

import json

import openai
import pytest

from npuport.fixtures.train_tiny import trained_tiny_path
from npuport.runtime.generate import generate
from npuport.runtime.serving.serve import make_server
from npuport.runtime.text_completions import RuntimeCompletions, TextRequest
from tests.test_serve import call, post, running

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PROMPT = "Question: Tom has 3 apples and buys 4 more. How many now?\nAnswer:"
NEW = 40


@pytest.fixture(scope="module")
def runner() -> RuntimeCompletions:
    return RuntimeCompletions.load(trained_tiny_path(), device="cpu", dtype="float32", batch_size=4)


@pytest.fixture(scope="module")
def free(runner) -> list[int]:
    """The greedy tokens of PROMPT with nothing stopping them: the reference every count below is scanned from."""
    return generate(runner.model, [runner.encode(PROMPT)], NEW, stop_tokens=()).tokens[0]


@pytest.fixture(scope="module")
def newline(runner, free) -> int:
    """A token the answer writes several times (its first at least 5 tokens in), to stand as a stop token."""
    token = runner.encode("\n")[-1]
    at = [i for i, t in enumerate(free) if t == token]
    assert len(at) >= 2 and at[0] >= 5, (at, free)
    return token


@pytest.fixture(scope="module")
def eos_runner(runner, newline) -> RuntimeCompletions:
    """The same model whose EOS is "\\n"."""
    return RuntimeCompletions(runner.model, runner.tokenizer, [newline], batch_size=4,
                              context_tokens=runner.context_tokens)


def completion(url: str, **fields) -> dict:
    status, answer = post(url, {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, **fields})
    assert status == 200, answer
    return answer


def test_stop_token_ids_and_min_tokens_end_where_vllm_ends_them(runner, free, newline):
    first, second = [i for i, t in enumerate(free) if t == newline][:2]
    client_answers = {}
    with running(make_server(runner, "trained")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for name, extra in (("stop", {"stop_token_ids": [newline]}),
                            ("min", {"stop_token_ids": [newline], "min_tokens": first + 1}),
                            ("kept", {"stop_token_ids": [newline], "include_stop_str_in_output": True})):
            client_answers[name] = client.completions.create(model="trained", prompt=PROMPT, max_tokens=NEW,
                                                             temperature=0, extra_body=extra)
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model="trained", prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True,
            extra_body={"stop_token_ids": [newline], "min_tokens": first + 1}) if chunk.choices)
        unknown = completion(url, stop_token_ids=[999_999])  # a token the model cannot write: nothing ends early
    stop, min_, kept = client_answers["stop"], client_answers["min"], client_answers["kept"]
    # the stop token counts, its text is not in the answer (unless include_stop_str_in_output)
    assert stop.usage.completion_tokens == first + 1 and stop.choices[0].finish_reason == "stop"
    assert stop.choices[0].text == runner.decode(free[:first])
    assert kept.choices[0].text == runner.decode(free[:first + 1])
    # min_tokens: the first "\n" comes before it, so the row goes on to the next one
    assert min_.usage.completion_tokens == second + 1 and min_.choices[0].finish_reason == "stop"
    assert min_.choices[0].text == runner.decode(free[:second])
    assert streamed == min_.choices[0].text
    assert unknown["usage"]["completion_tokens"] == NEW and unknown["choices"][0]["finish_reason"] == "length"


def test_ignore_eos_generates_max_tokens_through_the_eos(eos_runner, free, newline):
    first = free.index(newline)
    with running(make_server(eos_runner, "trained")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        plain = client.completions.create(model="trained", prompt=PROMPT, max_tokens=NEW, temperature=0)
        ignoring = client.completions.create(model="trained", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                             extra_body={"ignore_eos": True})
        floor = client.completions.create(model="trained", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                          extra_body={"min_tokens": NEW - 4})
        chat = client.chat.completions.create(model="trained", messages=[{"role": "user", "content": "2 + 2?"}],
                                              max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert plain.usage.completion_tokens == first + 1 and plain.choices[0].finish_reason == "stop"
    assert ignoring.usage.completion_tokens == NEW and ignoring.choices[0].finish_reason == "length"
    assert ignoring.choices[0].text == eos_runner.decode(free)  # generate's tokens with no stop token
    later = [i for i, t in enumerate(free) if t == newline and i >= NEW - 4]
    assert floor.usage.completion_tokens == (later[0] + 1 if later else NEW)
    assert chat.usage.completion_tokens == 12 and chat.choices[0].finish_reason == "length"


def test_rows_of_one_generate_call_keep_their_own_stop_rules(eos_runner, free, newline):
    """One call of four rows: plain (ends at its EOS), ignore_eos, min_tokens, a stop token of its own."""
    ids = eos_runner.encode(PROMPT)
    first, second = [i for i, t in enumerate(free) if t == newline][:2]
    comma = free[3]
    rows = [TextRequest(ids, NEW), TextRequest(ids, NEW, ignore_eos=True), TextRequest(ids, NEW, min_tokens=first + 1),
            TextRequest(ids, NEW, stop_token_ids=(comma,), ignore_eos=True)]
    results, _ = eos_runner.run(rows)
    assert [r.completion.completion_tokens for r in results] == [first + 1, NEW, second + 1, free.index(comma) + 1]
    for result in results:  # whatever a row made past its end is generate's own continuation
        assert result.token_ids == free[:len(result.token_ids)]


def test_logprobs_0_gives_the_chosen_tokens_entry_and_no_alternatives(runner):
    with running(make_server(runner, "trained")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        zero = client.completions.create(model="trained", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
        one = client.completions.create(model="trained", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
        streamed = [c.choices[0].logprobs for c in client.completions.create(
            model="trained", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0, stream=True)
            if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.tokens]
    got = zero.choices[0].logprobs
    assert len(got.tokens) == 6
    assert got.top_logprobs == [{t: lp} for t, lp in zip(got.tokens, got.token_logprobs, strict=True)]
    assert got.top_logprobs == one.choices[0].logprobs.top_logprobs  # greedy: the chosen token is the top one
    assert [t for s in streamed for t in s.top_logprobs] == got.top_logprobs


@pytest.mark.parametrize(("path", "payload", "param"), [
    ("/v1/completions", {"prompt": "Question: \ud800 2 + 2 =", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "bad \udfff"], "max_tokens": 2}, "prompt[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x \ud800"}], "max_tokens": 2},
     "messages[0].content"),
    ("/v1/completions", {"prompt": "fine", "max_tokens": 2, "stop": ["\ud800"]}, "stop[0]"),
], ids=["prompt", "prompt-list", "chat-message", "stop"])
def test_a_lone_surrogate_is_refused_with_400_naming_the_field(runner, path, payload, param):
    body = json.dumps(payload).encode()  # ensure_ascii: the surrogate travels as the escape "\ud800"
    assert b"\\ud" in body
    paired = json.dumps({"prompt": "an emoji \U0001F600 is a pair", "max_tokens": 2}).encode()
    with running(make_server(runner, "trained")) as url:
        status, answer = call(url + path, body)
        fine, _ = call(url + "/v1/completions", paired)
    assert status == 400, answer
    assert answer["error"]["param"] == param and "surrogate" in answer["error"]["message"]
    assert fine == 200


@pytest.mark.parametrize(("fields", "param"), [
    ({"min_tokens": NEW + 1}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
])
def test_bad_values_of_the_benchmark_fields_are_refused_naming_them(runner, fields, param):
    with running(make_server(runner, "trained")) as url:
        status, answer = post(url, {"prompt": PROMPT, "max_tokens": NEW, **fields})
    assert status == 400 and answer["error"]["param"] == param, answer
