"""Fidelity from log-probabilities. The top-k KL estimate: exact when k covers the vocabulary, and no more than the
full KL when the candidate's top-k holds the reference's (the KL of coarsened distributions, against an
independent float64 computation). Two `npuport serve` processes - the trained tiny model's BF16 source and its
W8A8 artifact, float32 - validated against each other over HTTP: the estimate equals the same estimator on the
two models' full logits in this process (1e-4), top-1 agreement is the same, and the estimate is as far from the
full-vocabulary KL as the built-in runtime says the estimator is (its stated bias). A server that refuses echo
gets the shared-prefix estimate, and says so."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from npuport.cli import main
from npuport.convert.converter import convert_qwen35
from npuport.fixtures.train_tiny import trained_tiny_path
from npuport.runtime.generate import forward_logits
from npuport.runtime.loader import load_model
from npuport.runtime.textgen import load_tokenizer
from npuport.runtime.validation.endpoint import CompletionsEndpoint
from npuport.runtime.validation.endpoint_fidelity import (
    SHARED_PREFIX,
    TEACHER_FORCED,
    EchoRefused,
    EndpointLogprobs,
    logprob_fidelity,
)
from npuport.runtime.validation.fidelity import kl_divergence
from npuport.runtime.validation.gsm8k import make_protocol
from npuport.runtime.validation.topk_kl import topk_kl_estimate, topk_kl_from_logits
from tests.test_serve import serve_process

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

QUESTIONS, NEW_TOKENS, TOP_K = 3, 24, 5


def test_the_top_k_estimate_is_exact_over_the_vocabulary_and_below_the_kl_when_coarsened():
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        ref, cand = (torch.randn(40, generator=gen, dtype=torch.float64) * 2 for _ in range(2))
        full = kl_divergence(ref[None], cand[None])[0].item()
        ref_lp, cand_lp = torch.log_softmax(ref, -1), torch.log_softmax(cand, -1)
        everything = topk_kl_estimate(dict(enumerate(ref_lp.tolist())), dict(enumerate(cand_lp.tolist())))
        assert everything == pytest.approx(full, rel=1e-9, abs=1e-12)
        top = ref_lp.topk(5).indices.tolist()  # the candidate lists those tokens: exact probabilities there
        coarse_ref = torch.cat([ref_lp.exp()[top], 1 - ref_lp.exp()[top].sum()[None]])
        coarse_cand = torch.cat([cand_lp.exp()[top], 1 - cand_lp.exp()[top].sum()[None]])
        want = (coarse_ref * (coarse_ref.log() - coarse_cand.log())).sum().item()
        got = topk_kl_estimate({t: ref_lp[t].item() for t in top}, {t: cand_lp[t].item() for t in top})
        assert got == pytest.approx(want, rel=1e-9) and got <= full + 1e-12


@pytest.fixture(scope="module")
def trained_pair(tmp_path_factory):
    """The trained tiny source and its W8A8 artifact."""
    root = tmp_path_factory.mktemp("trained")
    artifact = convert_qwen35(trained_tiny_path(), root / "w8a8", show_progress=False, log=lambda _: None).out
    return trained_tiny_path(), artifact


def test_two_servers_give_the_fidelity_the_built_in_runtime_gives_within_the_estimators_bias(trained_pair, tmp_path):
    source, artifact = trained_pair
    tokenizer = load_tokenizer(artifact)
    protocol = make_protocol("sglang", max_new_tokens=NEW_TOKENS)
    prompts = [tokenizer.encode(p) for p in protocol.prompts(QUESTIONS)]
    options = ("--dtype", "float32", "--served-model-name")
    with serve_process(artifact, *options, "w8a8") as candidate_url, serve_process(source, *options, "bf16") as ref_url:
        def side(url: str, model: str) -> EndpointLogprobs:
            return EndpointLogprobs(CompletionsEndpoint(url, model, retries=0, timeout_s=120))

        measured = logprob_fidelity(side(candidate_url, "w8a8"), side(ref_url, "bf16"), prompts, NEW_TOKENS,
                                    protocol.stop, TOP_K)
        validated = CliRunner().invoke(main, [
            "validate", "--gsm8k", str(artifact), "--protocol", "sglang", "--num-questions", str(QUESTIONS),
            "--max-new-tokens", str(NEW_TOKENS), "--endpoint", candidate_url, "--endpoint-model", "w8a8",
            "--reference-endpoint", ref_url, "--retries", "0", "--min-accuracy", "off",
            "--out", str(tmp_path / "http")])
    assert validated.exit_code == 0, validated.output
    report = json.loads((tmp_path / "http" / "report.json").read_text())
    fields = ("greedy_token_agreement", "top1_agreement", "num_prompts", "num_tokens", "kl_method")
    assert {f: report["fidelity"][f] for f in fields} == {f: getattr(measured.fidelity, f) for f in fields}
    assert report["fidelity"]["mean_kl"] == pytest.approx(measured.fidelity.mean_kl, rel=1e-9)
    assert TEACHER_FORCED in measured.fidelity.kl_method and f"top-{TOP_K}" in measured.fidelity.kl_method
    assert report["gsm8k"][0]["reference"]["num_questions"] == QUESTIONS  # the reference ran GSM8K on its server

    # The same positions in this process, both models loaded: the estimator on full logits, and the full KL.
    bf16, w8a8 = (load_model(path, "cpu", torch.float32) for path in (source, artifact))
    positions = top1 = 0
    estimate = full = 0.0
    for sequence in measured.sequences:
        ref_logits, cand_logits = (forward_logits(m, [sequence])[0][0, :-1] for m in (bf16, w8a8))
        estimate += sum(topk_kl_from_logits(ref_logits, cand_logits, [TOP_K])[TOP_K])
        full += kl_divergence(ref_logits, cand_logits).sum().item()
        top1 += (ref_logits.argmax(-1) == cand_logits.argmax(-1)).sum().item()
        positions += ref_logits.shape[0]
    estimate, full = estimate / positions, full / positions
    fidelity = measured.fidelity
    assert fidelity.num_tokens == positions and fidelity.top1_agreement == top1 / positions
    assert fidelity.mean_kl == pytest.approx(estimate, abs=1e-4)
    assert abs(fidelity.mean_kl - full) <= abs(estimate - full) + 1e-4  # the bias the built-in runtime states

    built_in = CliRunner().invoke(main, [
        "validate", "--gsm8k", str(artifact), "--reference", str(source), "--protocol", "sglang", "--num-questions",
        str(QUESTIONS), "--max-new-tokens", str(NEW_TOKENS), "--dtype", "float32", "--device", "cpu",
        "--no-throughput", "--min-accuracy", "off", "--out", str(tmp_path / "built-in")])
    assert built_in.exit_code == 0, built_in.output
    stated = json.loads((tmp_path / "built-in" / "report.json").read_text())["fidelity"]
    assert set(stated["topk_kl_estimates"]) == {"5", "20"} and stated["kl_method"] == "full vocabulary"
    assert stated["topk_kl_estimates"]["5"] > 0 and stated["mean_kl"] > 0


class _NoEcho(EndpointLogprobs):
    def score(self, sequence, top_k):
        raise EchoRefused("echo refused")


def test_without_echo_the_shared_prefix_is_compared_and_said(trained_pair):
    source, artifact = trained_pair
    tokenizer = load_tokenizer(artifact)
    prompts = [tokenizer.encode(p) for p in make_protocol("sglang", max_new_tokens=12).prompts(2)]
    with serve_process(source, "--dtype", "float32") as url:
        same = _NoEcho(CompletionsEndpoint(url, str(source), retries=0, timeout_s=120))
        measured = logprob_fidelity(same, same, prompts, 12, (), TOP_K)
    fidelity = measured.fidelity
    assert SHARED_PREFIX in fidelity.kl_method and measured.sequences == []
    assert fidelity.greedy_token_agreement == fidelity.top1_agreement == 1.0
    assert fidelity.mean_kl == pytest.approx(0.0, abs=1e-9) and fidelity.num_tokens > 0
