"""Training pieces of `npuport train-tiny`: the GDN reference is differentiable (its gradients are those of the
token-by-token recurrence), the training losses are computed by the same model as decoding (token by token,
through the KV caches and the recurrent GDN path), and the training text is what few-shot prompts look like."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from npuport.fixtures.train_tiny import RECORD_SEPARATOR, token_batches, trained_tiny_path
from npuport.kernels.gated_delta_rule import (
    chunk_gated_delta_rule_reference,
    fused_recurrent_gated_delta_rule_reference,
)
from npuport.runtime.loader import load_model
from npuport.runtime.state import commit_accepted
from npuport.runtime.textgen import load_tokenizer
from npuport.runtime.training import sequence_losses
from npuport.runtime.validation.gsm8k import few_shot_prompt, load_records

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_gdn_chunk_reference_has_the_gradients_of_the_token_recurrence():
    g = torch.Generator().manual_seed(0)
    b, t, h, hv, kd, vd = 2, 11, 1, 2, 8, 6

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = rand(b, t, h, kd), rand(b, t, h, kd), rand(b, t, hv, vd)
    gate, beta = -torch.rand(b, t, hv, generator=g, dtype=torch.float64), torch.rand(b, t, hv, generator=g,
                                                                                  dtype=torch.float64)
    initial = 0.1 * rand(b, hv, kd, vd)
    inputs = [x.requires_grad_(True) for x in (q, k, v, gate, beta, initial)]
    w_out, w_state = rand(b, t, hv, vd), rand(b, hv, kd, vd)

    out, final = chunk_gated_delta_rule_reference(*inputs[:5], inputs[5], chunk_size=4)  # three chunks
    chunked = torch.autograd.grad((out * w_out).sum() + (final * w_state).sum(), inputs)

    state = inputs[5].clone()
    out = fused_recurrent_gated_delta_rule_reference(*inputs[:5], state)  # stores the final state in place
    recurrent = torch.autograd.grad((out * w_out).sum() + (state * w_state).sum(), inputs)
    for name, a, r in zip(("q", "k", "v", "g", "beta", "initial_state"), chunked, recurrent, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("kind", ["dense-multimodal", "moe-text-per-expert"])
def test_training_losses_are_those_of_token_by_token_decoding(tiny_checkpoints, kind):
    model = load_model(tiny_checkpoints[kind], "cpu", torch.float64)
    tokens = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    batch, length = tokens.shape
    losses = sequence_losses(model, tokens)

    one = torch.ones(batch, dtype=torch.long)
    state, mtp_state = model.new_state(batch, length), model.new_mtp_state(batch, length)
    hidden = []
    for i in range(length):
        hidden.append(model.step(tokens[:, i : i + 1], state)[:, 0])
        commit_accepted(state, one, 1)
    mtp_logits = []
    for i in range(length - 2):
        logits, _ = model.mtp_forward(tokens[:, i + 1 : i + 2], hidden[i][:, None], mtp_state)
        commit_accepted(mtp_state, one, 1)
        mtp_logits.append(logits[:, 0])
    target_logits = model.logits(torch.stack(hidden[:-1], dim=1))
    target = F.cross_entropy(target_logits.flatten(0, 1), tokens[:, 1:].flatten())
    mtp = F.cross_entropy(torch.stack(mtp_logits, dim=1).flatten(0, 1), tokens[:, 2:].flatten())
    torch.testing.assert_close(losses.target, target, rtol=1e-10, atol=0)
    torch.testing.assert_close(losses.mtp, mtp, rtol=1e-10, atol=0)


def test_training_text_tokenizes_as_a_few_shot_prompt():
    """Records encoded one by one and joined with the separator's tokens are the few-shot prompt's tokens."""
    tokenizer = load_tokenizer(trained_tiny_path())
    shots = load_records(split="train")[:5]
    question = load_records(split="test")[0].question
    joined = []
    for r in shots:
        joined += tokenizer.encode(f"Question: {r.question}\nAnswer: {r.answer}") + tokenizer.encode(RECORD_SEPARATOR)
    joined += tokenizer.encode(f"Question: {question}\nAnswer:")
    assert joined == tokenizer.encode(few_shot_prompt(shots, question))


def test_each_epoch_holds_every_record_once_in_a_seeded_order():
    records = [[100 + i] * (i % 3 + 1) for i in range(40)]
    separator = [0]
    stream_len = sum(len(r) + len(separator) for r in records)
    batch_size, seq_len = 2, 5
    n_batches = stream_len // seq_len // batch_size

    def first_epoch(seed: int) -> list[int]:
        batches = token_batches(records, separator, batch_size, seq_len, seed)
        return torch.cat([next(batches).flatten() for _ in range(n_batches)]).tolist()

    epoch = first_epoch(7)
    assert first_epoch(7) == epoch and first_epoch(8) != epoch
    # The windows are consecutive pieces of one stream of whole records, each followed by the separator.
    pieces, current = [], []
    for tok in epoch:
        if tok == separator[0]:
            pieces.append(current)
            current = []
        else:
            current.append(tok)
    assert all(piece in records for piece in pieces)
    assert len({piece[0] for piece in pieces}) == len(pieces)
    assert len(pieces) >= len(records) - (stream_len - len(epoch))  # only the cut-off tail may be missing


def test_the_tokenizer_file_reads_text_as_transformers_and_the_engines_do(tmp_path):
    """make-tiny's tokenizer.json, read by the `tokenizers` library, gives the ids transformers' Qwen3.5 tokenizer
    (what the runtime and the engines load) gives - numbers included, which Qwen3.5 splits into digits. Trained
    on other pre-tokens, "15" was one token in training and two digits at inference."""
    from tokenizers import Tokenizer

    from npuport.fixtures.arithmetic import arithmetic_train_records
    from npuport.fixtures.tiny_checkpoint import TinySpec, write_metadata
    from npuport.fixtures.train_tiny import encode_records

    write_metadata(tmp_path, TinySpec(size="trained-tiny"))
    engine = load_tokenizer(tmp_path)
    library = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    texts = [f"Question: {r.question}\nAnswer: {r.answer}" for r in load_records(split="test")[:50]]
    texts.append("Café costs $1,234.56 for 15 items, i.e. 82.3 each.\n\n")
    for text in texts:
        assert library.encode(text).ids == engine.encode(text), text
    assert engine.tokenize(" 15") == ["Ġ", "1", "5"]
    records, _ = encode_records(engine, "arithmetic")
    first = arithmetic_train_records()[0]
    assert records[0] == library.encode(f"Question: {first.question}\nAnswer: {first.answer}").ids
