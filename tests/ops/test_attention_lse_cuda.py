"""The CUDA backend's context-parallel attention ops (``backends/cuda/attention_lse.py``).

Without a GPU: CPU tensors through the dispatchers give the reference's results exactly, and the op
table names who serves them. On a GPU (the ``needs a CUDA device`` tests): the conformance cases;
a causal sequence cut into the ring's block pairs (GQA, Llama's head dim), merged and backpropagated
per block, against the reference in fp32; every causal shape the kernel is split for (``sq < sk``,
``sq > sk`` with rows that see no key); the fallbacks.
"""

from __future__ import annotations

import pytest
import torch

from mcore.ops import reference
from mcore.testing import conformance

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
LSE_OPS = ("attention_with_lse", "attention_with_lse_backward", "attention_merge")
CASES = [c for c in conformance.OP_CASES if c.op in LSE_OPS]


def test_dispatchers_fall_back_to_reference_on_cpu_tensors():
    from mcore.backends.cuda import attention_lse, ops

    assert ops.PROVIDERS["attention_with_lse"] == ops.PROVIDERS["attention_with_lse_backward"] == "flash-sdpa"
    assert "attention_merge" not in ops.CUDA_OPS  # the reference serves it (see the module docstring)
    for case in CASES:
        if case.op not in ops.CUDA_OPS:
            continue
        for dtype in (torch.float32, torch.bfloat16):
            args, kwargs = case.make(dtype, torch.Generator().manual_seed(1))
            got = attention_lse.ATTENTION_LSE_OPS[case.op](*args, **kwargs)
            want = reference.REFERENCE_OPS[case.op](*args, **kwargs)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=0, msg=f"{case.name} {dtype}")


@pytest.fixture
def cuda_backend():
    from mcore.plugins.manager import select_backend

    return select_backend("cuda")


@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_conformance_cases(cuda_backend, case, dtype):
    conformance.check_op(cuda_backend, case, dtype)


def _qkv(b, n, g, sq, sk, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, sq, d, generator=gen)
    k, v = torch.randn(b, g, sk, d, generator=gen), torch.randn(b, g, sk, d, generator=gen)
    return [t.to("cuda", dtype) for t in (q, k, v)]


def _rel(got, want):
    got, want = got.float().cpu(), want.float().cpu()
    return ((got - want).norm() / want.norm()).item()


@needs_cuda
def test_ring_blocks_merged_and_backward_match_reference(cuda_backend):
    """A causal sequence of 4 chunks on 2 ranks (zigzag: rank 0 holds chunks 0 and 3), each rank's
    two ring steps through the CUDA ops, against the reference's unsplit attention in fp32."""
    ops = cuda_backend.ops
    s, c = 1024, 256
    q, k, v = _qkv(1, 8, 2, s, s, 128, torch.bfloat16)
    dout = _qkv(1, 8, 8, s, s, 128, torch.bfloat16, seed=1)[0]
    full_out, full_lse = reference.attention_with_lse(q.float(), k.float(), v.float())
    dq_want, dk_want, dv_want = reference.attention_with_lse_backward(
        dout.float(), q.float(), k.float(), v.float(), full_out, full_lse
    )
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(k, dtype=torch.float32)
    for chunks in ((0, 3), (1, 2)):
        mine = torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunks]).cuda()
        theirs = (1, 2) if chunks == (0, 3) else (0, 3)
        other = torch.cat([torch.arange(i * c, (i + 1) * c) for i in theirs]).cuda()
        ql, kl, vl, kr, vr = q[:, :, mine], k[:, :, mine], v[:, :, mine], k[:, :, other], v[:, :, other]
        out, lse = ops.attention_with_lse(ql, kl, vl, causal=True)
        # step 1: rank 0's late chunk sees all of rank 1's keys; rank 1's chunks see rank 0's first chunk
        rows, keys = (slice(c, 2 * c), slice(0, 2 * c)) if chunks[0] == 0 else (slice(0, 2 * c), slice(0, c))
        part = ops.attention_with_lse(ql[:, :, rows], kr[:, :, keys], vr[:, :, keys], causal=False)
        o, l_ = ops.attention_merge(out[:, :, rows], lse[:, :, rows], *part)
        out, lse = out.clone(), lse.clone()
        out[:, :, rows], lse[:, :, rows] = o, l_
        assert _rel(out, full_out[:, :, mine]) < 1e-2
        torch.testing.assert_close(lse.cpu(), full_lse[:, :, mine].cpu(), rtol=1e-3, atol=1e-3)
        do = dout[:, :, mine]
        gq, gk, gv = ops.attention_with_lse_backward(do, ql, kl, vl, out, lse, causal=True)
        rq, rk, rv = ops.attention_with_lse_backward(
            do[:, :, rows], ql[:, :, rows], kr[:, :, keys], vr[:, :, keys], out[:, :, rows], lse[:, :, rows],
            causal=False,
        )  # fmt: skip
        gq = gq.float()
        gq[:, :, rows] += rq.float()
        dq[:, :, mine] += gq
        dk[:, :, mine] += gk.float()
        dv[:, :, mine] += gv.float()
        dk[:, :, other[keys]] += rk.float()
        dv[:, :, other[keys]] += rv.float()
    for got, want in ((dq, dq_want), (dk, dk_want), (dv, dv_want)):
        assert _rel(got, want) < 2e-2


@needs_cuda
@pytest.mark.parametrize(("sq", "sk"), [(128, 384), (384, 128), (256, 256)])
@pytest.mark.parametrize("causal", [True, False])
def test_split_causal_shapes_match_reference(cuda_backend, sq, sk, causal):
    ops = cuda_backend.ops
    q, k, v = _qkv(2, 4, 2, sq, sk, 64, torch.bfloat16)
    out, lse = ops.attention_with_lse(q, k, v, causal=causal)
    want_out, want_lse = reference.attention_with_lse(q.float(), k.float(), v.float(), causal=causal)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (2, 4, sq)
    assert _rel(out, want_out) < 1e-2
    torch.testing.assert_close(lse.cpu(), want_lse.cpu(), rtol=1e-3, atol=1e-3)  # -inf rows equal too
    dout = torch.randn_like(q)
    got = ops.attention_with_lse_backward(dout, q, k, v, out, lse, causal=causal)
    want = reference.attention_with_lse_backward(dout.float(), q.float(), k.float(), v.float(), want_out, want_lse,
                                                 causal=causal)  # fmt: skip
    for g, w in zip(got, want):
        assert torch.isfinite(g).all() and _rel(g, w) < 2e-2


@needs_cuda
def test_fp32_and_odd_head_dims_fall_back(cuda_backend):
    from mcore.backends.cuda.attention_lse import flash_fits

    q, k, v = _qkv(1, 2, 2, 16, 16, 36, torch.bfloat16)
    assert not flash_fits(q, k, v)
    assert not flash_fits(*(t.float() for t in _qkv(1, 2, 2, 16, 16, 32, torch.bfloat16)))
    out, lse = cuda_backend.ops.attention_with_lse(q, k, v)
    want_out, want_lse = reference.attention_with_lse(q, k, v)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
