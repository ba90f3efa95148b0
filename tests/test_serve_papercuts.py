"""What a client of `npuport serve` meets first, through the official `openai` client where one is involved:
log-probabilities in streams (the chunks add up to the answer without stream), prompt scoring with echo and
max_tokens 0 (transformers' log-softmax), chat's default max_tokens (the context's room, not 16), fields the server
does not implement refused by name, the request log's lines, batch-invariant answers under 16 concurrent greedy
requests, and the served model's name."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from npuport.fixtures.train_tiny import trained_tiny_path
from npuport.runtime.serving.limits import ServeLimits
from npuport.runtime.serving.serve import make_server, served_names
from npuport.runtime.text_completions import RuntimeCompletions
from tests.test_serve import post, running

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PROMPT = "Question: Tom has 3 apples and buys 4 more. How many now?\nAnswer:"
MESSAGES = [{"role": "user", "content": "What is 3 + 4?"}]


@pytest.fixture(scope="module")
def runner() -> RuntimeCompletions:
    return RuntimeCompletions.load(trained_tiny_path(), device="cpu", dtype="float32", batch_size=4)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def joined(chunks: list, field: str) -> list:
    """One field of the completions `logprobs` of every chunk that carries them, in order, as one list."""
    return [x for chunk in chunks for c in chunk.choices if c.logprobs is not None for x in getattr(c.logprobs, field)]


def test_a_stream_with_logprobs_carries_the_answers_logprobs_chunk_by_chunk(runner):
    with running(make_server(runner, "trained")) as url:
        api = client(url)
        whole = api.completions.create(model="trained", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
        chunks = list(api.completions.create(model="trained", prompt=PROMPT, max_tokens=12, temperature=0,
                                             logprobs=3, stream=True))
        chat = api.chat.completions.create(model="trained", messages=MESSAGES, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=2)
        chat_chunks = list(api.chat.completions.create(model="trained", messages=MESSAGES, max_tokens=10,
                                                       temperature=0, logprobs=True, top_logprobs=2, stream=True))
    want = whole.choices[0].logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert joined(chunks, "tokens") == want.tokens and len(want.tokens) == 12
    assert joined(chunks, "token_logprobs") == want.token_logprobs
    assert joined(chunks, "top_logprobs") == want.top_logprobs
    assert joined(chunks, "text_offset") == want.text_offset
    assert all(len(c.choices[0].logprobs.tokens) == 1 for c in chunks if c.choices and c.choices[0].logprobs)
    streamed = [e for c in chat_chunks for ch in c.choices if ch.logprobs is not None for e in ch.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in chat.choices[0].logprobs.content]
    assert len(streamed) == chat.usage.completion_tokens
    assert "".join(ch.delta.content or "" for c in chat_chunks for ch in c.choices) == chat.choices[0].message.content


def test_echo_with_max_tokens_0_scores_the_prompt_as_transformers_does(tiny_checkpoints):
    source = tiny_checkpoints["dense-text"]
    runner = RuntimeCompletions.load(source, device="cpu", dtype="float32", batch_size=2)
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids = runner.encode(PROMPT)
    with running(make_server(runner, "tiny")) as url:
        scored = client(url).completions.create(model="tiny", prompt=[ids, ids[:7]], max_tokens=0, echo=True,
                                                logprobs=1, temperature=0)
        without_echo = post(url, {"prompt": PROMPT, "max_tokens": 0})
    with torch.no_grad():
        want = torch.log_softmax(reference(torch.tensor([ids])).logits[0].double(), dim=-1)
    for choice, prompt in zip(scored.choices, (ids, ids[:7]), strict=True):
        assert choice.text == runner.decode(prompt) and choice.finish_reason == "length"
        got = choice.logprobs.token_logprobs
        assert len(got) == len(prompt) and got[0] is None
        assert got[1:] == pytest.approx([want[i - 1, prompt[i]].item() for i in range(1, len(prompt))], abs=1e-4)
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids) + 7
    assert without_echo[0] == 400 and "0 only with echo" in without_echo[1]["error"]["message"]


def test_chat_without_max_tokens_generates_to_the_servers_limit_not_16(runner):
    no_eos = RuntimeCompletions(runner.model, runner.tokenizer, batch_size=1, context_tokens=runner.context_tokens)
    with running(make_server(no_eos, "trained", limits=ServeLimits(max_tokens=40))) as url:
        chat = client(url).chat.completions.create(model="trained", messages=MESSAGES, temperature=0)
        completion = client(url).completions.create(model="trained", prompt=PROMPT, temperature=0)
    assert chat.usage.completion_tokens == 40 and chat.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 16  # the completions API's own default, as OpenAI and vLLM


@pytest.mark.parametrize(("fields", "named"), [
    ({"presence_penalty": 0.5}, ["presence_penalty"]),
    ({"frequency_penalty": 1.0, "logit_bias": {"5": 10}}, ["frequency_penalty", "logit_bias"]),
    ({"response_format": {"type": "json_object"}}, ["response_format"]),
    ({"tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}], "tool_choice": "auto"},
     ["tools", "tool_choice"]),
])
def test_fields_the_server_does_not_implement_are_refused_by_name(runner, fields, named):
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"},
               "tools": [], "tool_choice": "none"}
    with running(make_server(runner, "trained")) as url:
        api = client(url)
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(model="trained", messages=MESSAGES, max_tokens=2, extra_body=fields)
        with pytest.raises(openai.BadRequestError) as refused_completion:
            api.completions.create(model="trained", prompt=PROMPT, max_tokens=2, extra_body=fields)
        accepted = api.chat.completions.create(model="trained", messages=MESSAGES, max_tokens=2,
                                               extra_body={k: neutral[k] for k in fields})
    for error in (refused.value, refused_completion.value):
        assert error.body["param"] == named[0] and error.body["code"] == "unsupported_parameter"
        assert all(f"'{name}'" in error.body["message"] for name in named)
    assert accepted.usage.completion_tokens == 2


def test_every_request_is_one_timed_line_of_the_log(runner):
    logs: list[str] = []
    with running(make_server(runner, "trained", log=logs.append)) as url:
        api = client(url)
        completion = api.completions.create(model="trained", prompt=PROMPT, max_tokens=5, temperature=0)
        list(api.chat.completions.create(model="trained", messages=MESSAGES, max_tokens=4, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
        with pytest.raises(openai.NotFoundError):
            api.completions.create(model="other", prompt=PROMPT, max_tokens=2)
    pattern = re.compile(r"(\S+) 127\.0\.0\.1 (GET|POST) (\S+) (\d{3}) (\d+\.\d) ms tokens (\S+)")
    lines = [pattern.fullmatch(line) for line in logs]
    assert len(lines) == 3 and all(lines), logs
    for match in lines:
        assert datetime.fromisoformat(match[1]).tzinfo is not None and float(match[5]) > 0
    assert [(m[2], m[3], m[4]) for m in lines] == [("POST", "/v1/completions", "200"),
                                                   ("POST", "/v1/chat/completions", "200"),
                                                   ("POST", "/v1/completions", "404")]
    assert lines[0][6] == f"{completion.usage.prompt_tokens}/5" and lines[1][6].endswith("/4") and lines[2][6] == "-"


def test_batch_invariant_serving_answers_16_concurrent_greedy_requests_as_each_alone():
    runner = RuntimeCompletions.load(trained_tiny_path(), device="cpu", dtype="bfloat16", batch_size=16)
    asks = [("chat", [{"role": "user", "content": f"Sam has {a} pens and buys {a * 3 + 1} more. How many?"}])
            if a % 2 else ("text", f"Question: Sam has {a} pens and buys {a * 3 + 1} more." + " He sells one." * (a % 4)
                           + " How many now?\nAnswer:") for a in range(16)]
    with running(make_server(runner, "trained", invariant=True)) as url:
        api = client(url)

        def ask(item: tuple[str, object]) -> str:
            kind, prompt = item
            if kind == "chat":
                return api.chat.completions.create(model="trained", messages=prompt, max_tokens=24,
                                                   temperature=0).choices[0].message.content
            return api.completions.create(model="trained", prompt=prompt, max_tokens=24, temperature=0).choices[0].text

        alone = [ask(item) for item in asks]
        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(ask, asks))
    assert together == alone
    assert len(set(alone)) > 1


def test_the_served_name_is_the_folders_and_the_path_is_accepted_too(runner, tmp_path):
    folder = tmp_path / "models" / "my-model"
    name, aliases = served_names(folder, None)
    assert name == "my-model" and str(folder) in aliases
    custom, custom_aliases = served_names(folder, "custom")
    assert custom == "custom" and str(folder) in custom_aliases
    relative = Path("models") / "my-model"
    assert served_names(relative, None)[1][0] == "models/my-model"
    with running(make_server(runner, name, aliases=aliases)) as url:
        api = client(url)
        listed = [m.id for m in api.models.list()]
        by_path = api.completions.create(model=str(folder), prompt=PROMPT, max_tokens=2, temperature=0)
        with pytest.raises(openai.NotFoundError):
            api.completions.create(model="models", prompt=PROMPT, max_tokens=2)
    assert listed == ["my-model"] and by_path.model == "my-model"
