"""The context-parallel attention ops' references (CPU, float64): ``attention_with_lse`` is the
``attention`` op plus its log-sum-exp; attention split into key blocks and merged with
``attention_merge`` is the unsplit attention (causal block pairs as the ring sees them, fully masked
rows); ``attention_with_lse_backward`` per block, given the merged results, sums to autograd of the
unsplit attention (GQA)."""

from __future__ import annotations

import pytest
import torch

from mcore.ops import reference as ref


def _qkv(b=2, n=4, g=2, sq=16, sk=16, d=8, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, sq, d, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(b, g, sk, d, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(b, g, sk, d, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _ring_pairs(s: int):
    """The block pairs of a causal sequence cut into two chunks: ``(q rows, k rows, causal)``; the
    pair (chunk 0 queries, chunk 1 keys) is fully in the future, so the ring skips it."""
    h = s // 2
    return [
        (slice(0, h), slice(0, h), True),
        (slice(h, s), slice(0, h), False),
        (slice(h, s), slice(h, s), True),
    ]


@pytest.mark.parametrize(("n", "g", "sq", "sk", "causal"), [(4, 4, 16, 16, True), (4, 2, 8, 16, True),
                                                          (4, 1, 12, 16, False), (6, 3, 16, 16, False)])  # fmt: skip
def test_out_equals_attention_op_and_lse_is_logsumexp(n, g, sq, sk, causal):
    q, k, v = _qkv(n=n, g=g, sq=sq, sk=sk)
    out, lse = ref.attention_with_lse(q, k, v, causal=causal, scale=0.3)
    _close(out, ref.attention(q, k, v, causal=causal, scale=0.3))
    scores = torch.matmul(q, k.repeat_interleave(n // g, dim=1).transpose(-1, -2)) * 0.3
    if causal:
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), float("-inf"))
    _close(lse, torch.logsumexp(scores, dim=-1))
    assert out.dtype == q.dtype and lse.shape == (2, n, sq)


def test_half_inputs_give_fp32_lse_and_input_dtype_out():
    q, k, v = _qkv(dtype=torch.bfloat16)
    out, lse = ref.attention_with_lse(q, k, v)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    o, l_ = ref.attention_merge(out, lse, out, lse)
    assert o.dtype == torch.bfloat16 and l_.dtype == torch.float32


def test_fully_masked_rows_give_zero_and_minus_inf():
    """Causal with more queries than keys: the first ``sq - sk`` rows see no key."""
    q, k, v = _qkv(sq=12, sk=8)
    out, lse = ref.attention_with_lse(q, k, v, causal=True)
    assert torch.isneginf(lse[:, :, :4]).all() and (out[:, :, :4] == 0).all()
    tail_out, tail_lse = ref.attention_with_lse(q[:, :, 4:], k, v, causal=True)
    _close(out[:, :, 4:], tail_out)
    _close(lse[:, :, 4:], tail_lse)


def _merged_ring(q, k, v, pairs):
    """Per query chunk: the merge of its blocks; returns the full ``(out, lse)``."""
    outs, lses = [], []
    for rows in sorted({p[0].start for p in pairs}):
        acc = None
        for qs, ks, causal in pairs:
            if qs.start != rows:
                continue
            part = ref.attention_with_lse(q[:, :, qs], k[:, :, ks], v[:, :, ks], causal=causal)
            acc = part if acc is None else ref.attention_merge(*acc, *part)
        outs.append(acc[0])
        lses.append(acc[1])
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


@pytest.mark.parametrize("g", [4, 1])
def test_ring_blocks_merged_equal_unsplit(g):
    q, k, v = _qkv(g=g, sq=16, sk=16)
    out, lse = _merged_ring(q, k, v, _ring_pairs(16))
    full_out, full_lse = ref.attention_with_lse(q, k, v, causal=True)
    _close(out, full_out)
    _close(lse, full_lse)


def test_kv_cache_causal_split_merged_equals_unsplit():
    """Fewer queries than keys (the triangle aligned at the end): earlier keys in full, the last
    ``sq`` keys causal."""
    q, k, v = _qkv(sq=8, sk=24)
    a = ref.attention_with_lse(q, k[:, :, :16], v[:, :, :16], causal=False)
    b = ref.attention_with_lse(q, k[:, :, 16:], v[:, :, 16:], causal=True)
    out, lse = ref.attention_merge(*a, *b)
    full_out, full_lse = ref.attention_with_lse(q, k, v, causal=True)
    _close(out, full_out)
    _close(lse, full_lse)


def test_merge_with_fully_masked_block_and_both_masked():
    q, k, v = _qkv(sq=12, sk=8)
    masked_out, masked_lse = ref.attention_with_lse(q, k, v, causal=True)  # rows 0..3 have no key
    real_out, real_lse = ref.attention_with_lse(q, k, v, causal=False)
    out, lse = ref.attention_merge(masked_out, masked_lse, real_out, real_lse)
    assert torch.isfinite(out).all()
    _close(out[:, :, :4], real_out[:, :, :4])
    _close(lse[:, :, :4], real_lse[:, :, :4])
    out, lse = ref.attention_merge(masked_out, masked_lse, masked_out, masked_lse)
    assert (out[:, :, :4] == 0).all() and torch.isneginf(lse[:, :, :4]).all()
    _close(out[:, :, 4:], masked_out[:, :, 4:])
    _close(lse[:, :, 4:], masked_lse[:, :, 4:] + torch.log(torch.tensor(2.0, dtype=torch.float64)))


@pytest.mark.parametrize("g", [2, 4])
def test_backward_per_block_sums_to_autograd_of_unsplit(g):
    q, k, v = _qkv(g=g, sq=16, sk=16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    full = ref.attention(*leaves, causal=True)
    dout = torch.randn(full.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    full.backward(dout)
    out, lse = _merged_ring(q, k, v, _ring_pairs(16))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, ks, causal in _ring_pairs(16):
        bq, bk, bv = ref.attention_with_lse_backward(
            dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, :, qs], causal=causal
        )
        dq[:, :, qs] += bq
        dk[:, :, ks] += bk
        dv[:, :, ks] += bv
    _close(dq, leaves[0].grad)
    _close(dk, leaves[1].grad)
    _close(dv, leaves[2].grad)


def test_backward_of_fully_masked_rows_is_zero():
    q, k, v = _qkv(sq=12, sk=8)
    out, lse = ref.attention_with_lse(q, k, v, causal=True)
    dout = torch.ones_like(out)
    dq, dk, dv = ref.attention_with_lse_backward(dout, q, k, v, out, lse, causal=True)
    assert (dq[:, :, :4] == 0).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    leaves = [t[:, :, 4:].clone().requires_grad_() if i == 0 else t.clone().requires_grad_()
              for i, t in enumerate((q, k, v))]  # fmt: skip
    ref.attention(*leaves, causal=True).backward(dout[:, :, 4:])
    _close(dq[:, :, 4:], leaves[0].grad)
    _close(dk, leaves[1].grad)
    _close(dv, leaves[2].grad)
