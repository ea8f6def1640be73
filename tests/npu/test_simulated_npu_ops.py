"""The NPU op adapters and the SIMULATED torch_npu they call: conventions, not just numbers.

The conformance suite (test_simulated_npu_conformance.py) checks every adapted op against the
reference. These tests pin down what the adapters send to torch_npu (layout strings, sparse modes,
the compressed mask, scale, head_num, GQA, AdamW powers) and that the simulated ops implement the
documented torch_npu semantics (layouts BSH/SBH/BSND/BNSD/TND, True = masked, sparse modes 0-4,
argument checks), so that a wrong call fails here rather than on an NPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from mcore.backends.npu.ops import build_npu_ops, compressed_causal_mask

from mcore.ops import reference


def _qkv(b=2, n=4, g=2, sq=8, sk=8, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, heads, s, d, generator=gen) for heads, s in ((n, sq), (g, sk), (g, sk)))


def _spy(module, name):
    calls = []
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    setattr(module, name, wrapper)
    return calls


# --- the simulated torch_npu itself ------------------------------------------------------------


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
def test_simulated_fusion_attention_layouts(simulated_npu, layout):
    q, k, v = _qkv()
    b, n, s, d = q.shape
    g = k.shape[1]
    expected = reference.attention(q, k, v, causal=True)

    def to_layout(t):
        heads = t.shape[1]
        return {
            "BNSD": t,
            "BSND": t.transpose(1, 2),
            "BSH": t.transpose(1, 2).reshape(b, s, heads * d),
            "SBH": t.permute(2, 0, 1, 3).reshape(s, b, heads * d),
        }[layout]

    out, softmax_max, softmax_sum, _, *ints = simulated_npu.npu_fusion_attention(
        to_layout(q), to_layout(k), to_layout(v), n, layout,
        atten_mask=compressed_causal_mask(q.device), scale=1 / math.sqrt(d), sparse_mode=2,
    )  # fmt: skip
    torch.testing.assert_close(out, to_layout(expected), rtol=1e-5, atol=1e-6)
    assert softmax_max.shape == softmax_sum.shape == (b, n, s, 8) and softmax_max.dtype == torch.float32
    assert len(ints) == 3 and all(isinstance(i, int) for i in ints)
    assert g < n  # GQA went through the op


def test_simulated_fusion_attention_mask_polarity_and_sparse_modes(simulated_npu):
    q, k, v = _qkv(n=2, g=2, sq=4, sk=8)
    scale = 0.25
    i, j = torch.arange(4)[:, None], torch.arange(8)[None, :]
    cases = {
        # sparse_mode: (atten_mask, kwargs, the mask the op must apply, True = masked)
        0: (j > i + 4, {"next_tockens": 4}, j > i + 4),
        1: ((j % 3 == 0).expand(4, 8), {}, j % 3 == 0),
        2: (compressed_causal_mask(q.device), {}, j > i),  # top-left causal
        3: (compressed_causal_mask(q.device), {}, j > i + 4),  # bottom-right: aligned at the end
        4: (compressed_causal_mask(q.device), {"pre_tockens": 1, "next_tockens": 0}, (j - i - 4 > 0) | (j - i - 4 < -1)),
    }  # fmt: skip
    for mode, (mask, kwargs, applied) in cases.items():
        out = simulated_npu.npu_fusion_attention(
            q, k, v, 2, "BNSD", atten_mask=mask, scale=scale, sparse_mode=mode, **kwargs
        )[0]
        expected = reference.attention(q, k, v, causal=False, mask=applied, scale=scale)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, msg=f"sparse_mode={mode}")
    # Without a mask the op attends to everything, whatever the sparse mode says.
    full = simulated_npu.npu_fusion_attention(q, k, v, 2, "BNSD", scale=scale, sparse_mode=3)[0]
    torch.testing.assert_close(full, reference.attention(q, k, v, causal=False, scale=scale))


def test_simulated_fusion_attention_tnd_varlen(simulated_npu):
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 5, 4]
    q, k, v = (torch.randn(sum(lengths), heads, 8, generator=gen) for heads in (4, 2, 2))
    cumulative = [3, 8, 12]
    out = simulated_npu.npu_fusion_attention(
        q, k, v, 4, "TND", atten_mask=compressed_causal_mask(q.device), scale=0.5, sparse_mode=3,
        actual_seq_qlen=cumulative, actual_seq_kvlen=cumulative,
    )[0]  # fmt: skip
    start = 0
    for length in lengths:
        piece = [t[start : start + length].transpose(0, 1)[None] for t in (q, k, v)]
        expected = reference.attention(*piece, causal=True, scale=0.5)[0].transpose(0, 1)
        torch.testing.assert_close(out[start : start + length], expected, rtol=1e-5, atol=1e-6)
        start += length
    with pytest.raises(TypeError, match="list of ints"):
        simulated_npu.npu_fusion_attention(
            q, k, v, 4, "TND", actual_seq_qlen=torch.tensor(cumulative), actual_seq_kvlen=cumulative
        )


def test_simulated_fusion_attention_checks_what_the_kernel_checks(simulated_npu):
    q, k, v = _qkv(n=4, g=3)
    fa = simulated_npu.npu_fusion_attention
    with pytest.raises(RuntimeError, match="multiple of key/value heads"):
        fa(q, k, v, 4, "BNSD")
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="compressed 2048x2048"):
        fa(q, k, v, 4, "BNSD", atten_mask=torch.ones(8, 8, dtype=torch.bool).triu(1), sparse_mode=2)
    with pytest.raises(RuntimeError, match="triu"):
        fa(q, k, v, 4, "BNSD", atten_mask=~compressed_causal_mask(q.device), sparse_mode=2)
    with pytest.raises(RuntimeError, match="padding_mask is not supported"):
        fa(q, k, v, 4, "BNSD", padding_mask=torch.zeros(1))
    with pytest.raises(TypeError, match="does not support"):
        fa(q.double(), k.double(), v.double(), 4, "BNSD")
    with pytest.raises(RuntimeError, match="input_layout"):
        fa(q, k, v, 4, "NSD")
    with pytest.raises(TypeError, match="unexpected keyword"):
        fa(q, k, v, 4, "BNSD", pre_tokens=0)  # the real spelling is pre_tockens


def test_simulated_rms_norm_rotary_swiglu_signatures(simulated_npu):
    x = torch.randn(3, 4, 16)
    y, rstd = simulated_npu.npu_rms_norm(x, torch.ones(16), epsilon=1e-6)
    assert rstd.dtype == torch.float32 and rstd.shape == (3, 4, 1)
    torch.testing.assert_close(y, reference.rms_norm(x, torch.ones(16), 1e-6))
    with pytest.raises(TypeError):
        simulated_npu.npu_rms_norm(x, torch.ones(16), eps=1e-6)  # the real spelling is epsilon
    assert simulated_npu.npu_swiglu(torch.randn(2, 8)).shape == (2, 4)
    t = torch.randn(5, 2, 3, 8)
    with pytest.raises(RuntimeError, match="4-D"):
        simulated_npu.npu_rotary_mul(t[0], t[0], t[0])
    cos = torch.randn(1, 2, 3, 8)  # broadcasts, but "1BND" is not a pattern the kernel takes
    with pytest.raises(RuntimeError, match="not a supported broadcast"):
        simulated_npu.npu_rotary_mul(t, cos, cos)


def test_simulated_swiglu_backward_is_the_gradient_of_npu_swiglu(simulated_npu):
    x = torch.randn(3, 5, 8, dtype=torch.float32, requires_grad=True)
    dy = torch.randn(3, 5, 4)
    (want,) = torch.autograd.grad(simulated_npu.npu_swiglu(x, dim=-1), x, dy)
    torch.testing.assert_close(simulated_npu.npu_swiglu_backward(dy, x.detach(), dim=-1), want)
    with pytest.raises(TypeError, match="must match"):
        simulated_npu.npu_swiglu_backward(dy.bfloat16(), x.detach())
    with pytest.raises(RuntimeError, match="halved along dim"):
        simulated_npu.npu_swiglu_backward(torch.randn(3, 5, 8), x.detach())
    with pytest.raises(TypeError, match="does not support"):
        simulated_npu.npu_swiglu_backward(dy.double(), x.detach().double())


# --- what the adapters send ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_simulated_weighted_swiglu_adapter(simulated_npu, dtype):
    """``npu_swiglu`` times the weights forward, ``npu_swiglu_backward`` for ``dx``; keeps ``x`` and the
    weights only; the reference's results (bf16: within its roundings); no rows run the reference."""
    fn = build_npu_ops(simulated_npu)["weighted_swiglu"]
    calls = _spy(simulated_npu, "npu_swiglu_backward")
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 2 * 24, generator=gen).to(dtype), torch.rand(9, generator=gen)
    dy = torch.randn(9, 24, generator=gen).to(dtype)
    results = []
    for op in (fn, reference.weighted_swiglu):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, kept=kept: kept.append(t.shape) or t, lambda t: t
        ):
            out = op(xa, wa)
        out.backward(dy)
        results.append((out, xa.grad, wa.grad, sorted(tuple(k) for k in kept)))
    (out, dx, dw, kept), (ref, ref_dx, ref_dw, _) = results
    assert len(calls) == 1 and calls[0][1] == {"dim": -1} and calls[0][0][0].dtype == dtype
    assert kept == [(9,), (9, 48)] and dw.dtype == torch.float32 and out.dtype == dx.dtype == dtype
    tol = {} if dtype == torch.float32 else dict(rtol=2**-6, atol=1e-2)
    for got, want in ((out, ref), (dx, ref_dx), (dw, ref_dw)):
        torch.testing.assert_close(got, want, **tol)
    empty = fn(torch.zeros(0, 8, dtype=dtype), torch.zeros(0))
    assert empty.shape == (0, 4) and len(calls) == 1


def test_simulated_attention_adapter_call_conventions(simulated_npu):
    ops = build_npu_ops(simulated_npu)
    calls = _spy(simulated_npu, "npu_fusion_attention")
    q, k, v = _qkv(n=8, g=2, d=16)
    ops["attention"](q, k, v)
    (args, kwargs) = calls[-1]
    assert args[3:] == (8, "BNSD")  # head_num = query heads; K/V keep their 2 heads (GQA)
    assert args[1].shape[1] == 2
    assert kwargs["scale"] == pytest.approx(1 / math.sqrt(16))  # explicit: the op's default is 1.0
    assert kwargs["sparse_mode"] == 2 and kwargs["atten_mask"].shape == (2048, 2048)
    assert kwargs["keep_prob"] == 1.0
    ops["attention"](*_qkv(sq=4, sk=8), dropout_p=0.0)
    assert calls[-1][1]["sparse_mode"] == 3  # causal aligned at the end = rightDownCausal
    mask = torch.zeros(2, 1, 1, 8, dtype=torch.bool)
    mask[0, ..., -2:] = True
    ops["attention"](*_qkv(), mask=mask)
    kwargs = calls[-1][1]
    assert kwargs["sparse_mode"] == 0 and kwargs["next_tockens"] == 0
    assert kwargs["atten_mask"].shape == (2, 1, 8, 8) and kwargs["atten_mask"].dtype == torch.bool
    assert kwargs["atten_mask"][0, 0, 0, -1] and not kwargs["atten_mask"][1, 0, 7, 7]  # True = masked


def test_simulated_attention_adapter_falls_back_where_the_kernel_cannot(simulated_npu):
    ops = build_npu_ops(simulated_npu)
    calls = _spy(simulated_npu, "npu_fusion_attention")
    q, k, v = _qkv()
    out = ops["attention"](q, k, v, bias=torch.zeros(1, 4, 8, 8))  # ALiBi: placement in the op unverified
    torch.testing.assert_close(out, reference.attention(q, k, v, bias=torch.zeros(1, 4, 8, 8)))
    ops["attention"](*_qkv(sq=8, sk=4))  # more queries than keys under a causal mask
    assert calls == []
    q, k, v = _qkv(n=512, g=2, sq=2, sk=2, d=4)  # GQA above the op's 256-head limit: K/V repeated
    torch.testing.assert_close(ops["attention"](q, k, v), reference.attention(q, k, v))
    assert calls[-1][0][1].shape[1] == 512


def test_simulated_rotary_adapter_caches_cos_sin_per_freqs_tensor(simulated_npu):
    ops = build_npu_ops(simulated_npu)
    calls = _spy(simulated_npu, "npu_rotary_mul")
    freqs = torch.rand(6, 1, 1, 8)
    q, k = torch.randn(6, 2, 4, 8), torch.randn(6, 2, 2, 8)
    ops["rotary_embedding"](q, freqs)
    ops["rotary_embedding"](k, freqs)
    assert calls[0][0][1] is calls[1][0][1]  # one cos tensor for every layer's q and k
    freqs.mul_(2.0)  # changed in place: recomputed
    ops["rotary_embedding"](q, freqs)
    assert calls[2][0][1] is not calls[0][0][1]
    torch.testing.assert_close(ops["rotary_embedding"](q, freqs), reference.rotary_embedding(q, freqs))


def test_simulated_adam_adapter_passes_beta_powers_of_the_previous_step(simulated_npu):
    ops = build_npu_ops(simulated_npu)
    calls = _spy(simulated_npu, "npu_apply_adam_w")
    p, g, m, v = torch.randn(4), torch.randn(4), torch.zeros(4), torch.zeros(4)
    ops["adam_step"]([p], [g], [m], [v], step=3, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)
    args, kwargs = calls[0]
    assert args[:2] == (pytest.approx(0.9**2), pytest.approx(0.99**2))
    assert len(args) == 11 and kwargs["out"][0] is p
