"""Decode / verify attention over a static KV cache (kernels/decode_attention.py): the Triton kernels, through
Triton's interpreter, and the PyTorch reference against a naive float64 loop over requests, tokens and heads; the
unused cache holding inf / NaN; and batch invariance, bit for bit - a request's rows are the same alone or in a
batch, and a verify step's first tokens the same as a shorter step's.

Splits of 64 keys in blocks of 16 over a cache of 200 (the last split a partial one of 8 keys), so that every call
crosses several splits and blocks at the sizes the interpreter runs quickly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import npuport.kernels.decode_attention as attention_module  # noqa: E402
import npuport.kernels.launch as launch_module  # noqa: E402
from npuport.kernels.decode_attention import (  # noqa: E402
    MAX_TOKENS,
    decode_attention,
    decode_attention_reference,
    decode_attention_triton,
)

CAPACITY, SPLIT, BLOCK_N = 200, 64, 16
DTYPES = [torch.float32, torch.bfloat16]


def random(gen: torch.Generator, *shape: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=gen)).to(dtype)


def step_inputs(gen: torch.Generator, b: int, t: int, hq: int, hkv: int, d: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and gate as the model slices them out of one [B, T, Hq, 2D] projection (head stride 2D), and a full cache
    of keys and values [B, CAPACITY, Hkv, D]; keys scaled up so that some softmaxes are peaked."""
    q, gate = random(gen, b, t, hq, 2 * d, dtype=dtype).chunk(2, dim=-1)
    keys = random(gen, b, CAPACITY, hkv, d, scale=2, dtype=dtype)
    values = random(gen, b, CAPACITY, hkv, d, dtype=dtype)
    return q, gate, keys, values


def triton_attention(q, keys, values, start, gate=None, plan_tokens=None) -> torch.Tensor:
    return decode_attention_triton(q, keys, values, start, gate, split=SPLIT, block_n=BLOCK_N,
                                   plan_tokens=plan_tokens)


def naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """float64, one (request, token, query head) at a time: softmax over the keys at positions 0..start + t."""
    b, t, hq, d = q.shape
    group = hq // keys.shape[2]
    out = torch.empty((b, t, hq, d), dtype=torch.float64)
    for i in range(b):
        for j in range(t):
            seen = int(start[i]) + j + 1
            for h in range(hq):
                k, v = keys[i, :seen, h // group].double(), values[i, :seen, h // group].double()
                weights = torch.softmax(k @ q[i, j, h].double() * d**-0.5, dim=0)
                out[i, j, h] = weights @ v
    return out


def expected(naive: torch.Tensor, dtype: torch.dtype, gate: torch.Tensor | None) -> torch.Tensor:
    """The naive result as the model's dtype holds it: rounded to the dtype, then - with a gate - times
    sigmoid(gate) rounded to the dtype, the product in fp32 rounded to the dtype (PyTorch's out * sigmoid(gate))."""
    attn = naive.to(dtype)
    if gate is None:
        return attn
    wide = torch.promote_types(dtype, torch.float32)
    sig = torch.sigmoid(gate.to(wide)).to(dtype)
    return (attn.to(wide) * sig.to(wide)).to(dtype)


def assert_attention_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 within ~1e-5 relative; bf16 within 2 ulps of the correctly rounded value, or 1e-6 (the fp32
    arithmetic's own error, for values near 0), and mostly equal to it."""
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    if got.dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    elif got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        g, w = got.double(), want.double()
        ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(2.0**-126))) - 7)
        excess = (g - w).abs() - 2 * ulp - 1e-6
        assert (excess <= 0).all(), f"off by more than 2 bf16 ulps: worst excess {excess.max().item():.3g}"
        assert (got == want).double().mean() >= 0.95


def starts_for(t: int) -> torch.Tensor:
    """One request per edge: a first token seeing 1 key, exactly one split, one key past a block, and a last token
    at the last cache position."""
    return torch.tensor([0, SPLIT - 1, BLOCK_N, CAPACITY - t])


@pytest.mark.parametrize("hq, hkv, d", [(4, 1, 32), (8, 2, 64), (6, 2, 32)])
@pytest.mark.parametrize("t", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_a_naive_loop(dtype, t, hq, hkv, d):
    gen = torch.Generator().manual_seed(t * 100 + hq * 10 + hkv)
    start = starts_for(t)
    q, gate, keys, values = step_inputs(gen, len(start), t, hq, hkv, d, dtype)
    naive = naive_attention(q, keys, values, start)
    with_gate = (t + hq) % 2 == 0  # half the cases gated, each head layout both ways over the token counts
    got = triton_attention(q, keys, values, start, gate if with_gate else None)
    assert_attention_close(got, expected(naive, dtype, gate if with_gate else None))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_on_and_off_over_the_same_step(dtype):
    gen = torch.Generator().manual_seed(5)
    start = starts_for(2)
    q, gate, keys, values = step_inputs(gen, len(start), 2, 8, 2, 32, dtype)
    naive = naive_attention(q, keys, values, start)
    assert_attention_close(triton_attention(q, keys, values, start), expected(naive, dtype, None))
    assert_attention_close(triton_attention(q, keys, values, start, gate), expected(naive, dtype, gate))


def with_garbage_past(x: torch.Tensor, last: torch.Tensor, fill: list[float]) -> torch.Tensor:
    """x [B, S, H, D] with every position past last[b] holding the fill values in turn (inf, NaN, ...)."""
    x = x.clone()
    for i, pos in enumerate(last.tolist()):
        tail = x[i, pos + 1 :]
        pattern = torch.tensor(fill, dtype=x.dtype).repeat(tail.numel() // len(fill) + 1)[: tail.numel()]
        tail.copy_(pattern.view(tail.shape))
    return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_unused_cache_is_never_read(dtype):
    """inf and NaN past each request's last position (start + T - 1) change nothing, in the kernel (not a bit: those
    keys are never loaded) and in the reference."""
    gen = torch.Generator().manual_seed(6)
    t = 3
    start = torch.tensor([0, SPLIT - 2, 100])
    q, gate, keys, values = step_inputs(gen, len(start), t, 4, 2, 32, dtype)
    last = start + t - 1
    dirty_keys = with_garbage_past(keys, last, [float("nan"), float("inf"), float("-inf")])
    dirty_values = with_garbage_past(values, last, [float("inf"), float("nan")])
    clean = triton_attention(q, keys, values, start, gate)
    dirty = triton_attention(q, dirty_keys, dirty_values, start, gate)
    assert torch.isfinite(dirty).all() and torch.equal(dirty, clean)
    dirty_reference = decode_attention_reference(q, dirty_keys, dirty_values, start, gate)
    assert torch.isfinite(dirty_reference).all()
    assert torch.equal(dirty_reference, decode_attention_reference(q, keys, values, start, gate))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_request_gets_the_same_bits_alone_or_in_a_batch_and_in_a_shorter_step(dtype):
    """Batch invariance: a request's rows do not depend on the requests beside it, and the first tokens of a verify
    step of 3 are those of a step of 1 or 2 over the same cache - also where the later tokens reach into the next
    block (start 14: token 2 at 16) or split (start 62: token 2 at 64)."""
    gen = torch.Generator().manual_seed(7)
    t = 3
    start = torch.tensor([14, SPLIT - 2, 130])
    q, gate, keys, values = step_inputs(gen, len(start), t, 8, 2, 32, dtype)
    batch = triton_attention(q, keys, values, start, gate)
    for i in range(len(start)):
        one = slice(i, i + 1)
        alone = triton_attention(q[one], keys[one], values[one], start[one], gate[one])
        assert torch.equal(alone, batch[one]), f"request {i}"
    for shorter in (1, 2):
        step = triton_attention(q[:, :shorter], keys, values, start, gate[:, :shorter])
        assert torch.equal(step, batch[:, :shorter]), f"a step of {shorter}"
    ungated = triton_attention(q[:, :1], keys, values, start)
    assert torch.equal(ungated, triton_attention(q, keys, values, start)[:, :1])


@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES])
@pytest.mark.parametrize("with_gate", [False, True])
def test_reference_matches_the_naive_loop(dtype, with_gate):
    gen = torch.Generator().manual_seed(8)
    t = 3
    start = starts_for(t)
    q, gate, keys, values = step_inputs(gen, len(start), t, 6, 2, 32, dtype)
    got = decode_attention_reference(q, keys, values, start, gate if with_gate else None)
    assert_attention_close(got, expected(naive_attention(q, keys, values, start), dtype, gate if with_gate else None))


@pytest.mark.parametrize("with_gate", [False, True])
def test_the_reference_takes_long_steps_a_block_of_queries_at_a_time(monkeypatch, with_gate):
    """A step whose scores pass REFERENCE_SCORES (the MTP head's prefill chunks: 16 GiB for one row of 16,384
    tokens) goes a block of queries at a time, 8 blocks here, and gives the naive loop's result."""
    gen = torch.Generator().manual_seed(10)
    t = 37
    start = torch.tensor([0, 20])
    q, gate, keys, values = step_inputs(gen, len(start), t, 4, 2, 32, torch.float32)
    gate = gate if with_gate else None
    whole = decode_attention_reference(q, keys, values, start, gate)
    scores = len(start) * 4 * keys.shape[1]  # per query
    calls = []
    block = attention_module._attend_block
    monkeypatch.setattr(attention_module, "_attend_block", lambda q, *args: calls.append(q.shape[1]) or block(q, *args))
    monkeypatch.setattr(attention_module, "REFERENCE_SCORES", 5 * scores)  # blocks of 5 queries
    blocked = decode_attention_reference(q, keys, values, start, gate)
    assert calls == [5] * 7 + [2]
    naive = expected(naive_attention(q, keys, values, start), torch.float32, gate)
    assert_attention_close(blocked, naive)
    assert_attention_close(whole, naive)


@pytest.mark.parametrize("dtype, t, takes_the_kernel", [(torch.float32, 2, True), (torch.bfloat16, 1, True),
                                                        (torch.float64, 2, False),
                                                        (torch.float32, MAX_TOKENS + 1, False)])
def test_the_dispatcher_takes_the_kernel_for_decode_steps_except_in_float64(monkeypatch, dtype, t, takes_the_kernel):
    """With CPU tensors counted as a Triton device: a step of up to MAX_TOKENS tokens goes to the kernel, float64
    and longer steps to the reference."""
    monkeypatch.setattr(launch_module, "runs_triton", lambda device: True)
    monkeypatch.setattr("npuport.kernels.implementations.runs_triton", lambda device: True)  # CPU as a Triton device
    calls = []
    monkeypatch.setattr(attention_module, "decode_attention_triton",
                        lambda *args, **kw: calls.append(args) or triton_attention(*args, **kw))
    gen = torch.Generator().manual_seed(9)
    start = torch.tensor([3, 40])
    q, gate, keys, values = step_inputs(gen, len(start), t, 4, 2, 32, dtype)
    got = decode_attention(q, keys, values, start, gate)
    assert len(calls) == (1 if takes_the_kernel else 0)
    assert_attention_close(got, expected(naive_attention(q, keys, values, start), dtype, gate))
