"""The reference ops against straightforward math (CPU), and gradcheck in float64 where it applies.

The reference ops compute in at least fp32 and keep float64 inputs in float64, so every op is
gradchecked at gradcheck's default float64 tolerances.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mcore.ops import reference as ref


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float64, requires_grad=False):
    t = torch.randn(*shape, generator=_gen(seed), dtype=torch.float64).to(dtype)
    return t.requires_grad_(requires_grad)


def _gradcheck_fp32_internal(fn, inputs):
    """Strict float64 gradcheck (the name is historical: the ops once computed in fp32 internally)."""
    assert torch.autograd.gradcheck(fn, inputs)


# --- normalisation --------------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_matches_formula(with_bias):
    x = _randn(3, 5, 24, seed=1)
    w, b = _randn(24, seed=2), (_randn(24, seed=3) if with_bias else None)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    expect = (x - mean) / torch.sqrt(var + 1e-5) * w + (b if with_bias else 0.0)
    got = ref.layer_norm(x, w, b, 1e-5)
    assert got.dtype == x.dtype
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def test_layer_norm_keeps_input_dtype_with_fp32_params():
    x = _randn(4, 16, dtype=torch.bfloat16)
    got = ref.layer_norm(x, torch.ones(16), torch.zeros(16), 1e-5)
    assert got.dtype == torch.bfloat16


def test_rms_norm_matches_formula():
    x = _randn(2, 7, 32, seed=4)
    w = _randn(32, seed=5)
    expect = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-6), expect, rtol=1e-5, atol=1e-5)


def test_rms_norm_rounds_before_weight_like_megatron():
    x = _randn(3, 64, seed=6, dtype=torch.bfloat16)
    w = _randn(64, seed=7, dtype=torch.bfloat16)
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-5), normed * w, rtol=0, atol=0)


def test_norms_gradcheck():
    x = _randn(3, 10, seed=8, requires_grad=True)
    w = (_randn(10, seed=9) + 2).requires_grad_()
    b = _randn(10, seed=10, requires_grad=True)
    _gradcheck_fp32_internal(lambda x, w, b: ref.layer_norm(x, w, b, 1e-5), (x, w, b))
    _gradcheck_fp32_internal(lambda x, w: ref.rms_norm(x, w, 1e-5), (x, w))


# --- rotary ---------------------------------------------------------------------------------------


def _naive_rotary(x, freqs):
    r = freqs.shape[-1]
    half = r // 2
    out = x.clone()
    f = freqs.expand(*x.shape[:-1], r)
    for i in range(half):
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * torch.cos(f[..., i]) - b * torch.sin(f[..., i])
        out[..., i + half] = b * torch.cos(f[..., i + half]) + a * torch.sin(f[..., i + half])
    return out


def _angles(s, r, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    return torch.cat([ang, ang], dim=-1)  # [s, r], halves equal as mcore builds them


@pytest.mark.parametrize("rot", [16, 8])
def test_rotary_matches_pairwise_rotation(rot):
    s, b, n, d = 6, 2, 3, 16
    x = _randn(s, b, n, d, seed=11)
    freqs = _angles(s, rot).view(s, 1, 1, rot)
    got = ref.rotary_embedding(x, freqs)
    torch.testing.assert_close(got, _naive_rotary(x, freqs), rtol=1e-5, atol=1e-5)
    # channels past the rotary dim pass through untouched
    torch.testing.assert_close(got[..., rot:], x[..., rot:], rtol=0, atol=0)


def test_rotary_is_a_complex_rotation_when_halves_match():
    s, d = 5, 8
    x = _randn(s, 1, 1, d, seed=12)
    freqs = _angles(s, d).view(s, 1, 1, d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * torch.exp(1j * freqs[..., : d // 2])
    expect = torch.cat([z.real, z.imag], dim=-1)
    torch.testing.assert_close(ref.rotary_embedding(x, freqs), expect, rtol=1e-5, atol=1e-5)
    # a rotation keeps the norm of every row
    torch.testing.assert_close(ref.rotary_embedding(x, freqs).norm(dim=-1), x.norm(dim=-1))


def test_rotary_gradcheck():
    x = _randn(4, 2, 2, 8, seed=13, requires_grad=True)
    freqs = _angles(4, 6).view(4, 1, 1, 6)
    _gradcheck_fp32_internal(lambda x: ref.rotary_embedding(x, freqs), (x,))


# --- activations ----------------------------------------------------------------------------------


def test_swiglu_matches_formula_and_gradcheck():
    x = _randn(3, 4, 10, seed=14, requires_grad=True)
    g, u = x[..., :5], x[..., 5:]
    expect = g / (1 + torch.exp(-g)) * u
    torch.testing.assert_close(ref.swiglu(x), expect)
    assert torch.autograd.gradcheck(ref.swiglu, (x,))


def test_weighted_swiglu_matches_formula_gradcheck_and_keeps_only_its_inputs():
    x = _randn(6, 10, seed=17, requires_grad=True)
    w = torch.rand(6, dtype=torch.float64, generator=torch.Generator().manual_seed(18)).requires_grad_()
    torch.testing.assert_close(ref.weighted_swiglu(x, w), ref.swiglu(x) * w[:, None])
    assert torch.autograd.gradcheck(ref.weighted_swiglu, (x, w))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = ref.weighted_swiglu(x.detach().bfloat16().requires_grad_(), w.detach().float().requires_grad_())
    assert y.dtype == torch.bfloat16
    assert sorted(tuple(t.shape) for t in saved) == [(6,), (6, 10)]  # x and weights, not swiglu(x)
    with pytest.raises(ValueError, match=r"weighted_swiglu: x \(6, 10\) must be \[N, 2F\]"):
        ref.weighted_swiglu(x, w[:3])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu_matches_formula_and_gradcheck(approximate, with_bias):
    x = _randn(4, 9, seed=15, requires_grad=True)
    b = _randn(9, seed=16, requires_grad=True) if with_bias else None
    t = x + b if with_bias else x
    if approximate == "tanh":
        expect = 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t**3)))
    else:
        expect = 0.5 * t * (1 + torch.erf(t / math.sqrt(2)))
    torch.testing.assert_close(ref.bias_gelu(x, b, approximate), expect)
    inputs = (x, b) if with_bias else (x,)
    fn = (
        (lambda x, b: ref.bias_gelu(x, b, approximate))
        if with_bias
        else (lambda x: ref.bias_gelu(x, None, approximate))
    )
    assert torch.autograd.gradcheck(fn, inputs)


def test_bias_dropout_add_eval_is_exact_and_gradcheck():
    x, r = _randn(5, 8, seed=17, requires_grad=True), _randn(5, 8, seed=18, requires_grad=True)
    b = _randn(8, seed=19, requires_grad=True)
    torch.testing.assert_close(ref.bias_dropout_add(x, b, r, 0.3, False), r + x + b)
    torch.testing.assert_close(ref.bias_dropout_add(x, None, r, 0.0, True), r + x)
    assert torch.autograd.gradcheck(lambda x, b, r: ref.bias_dropout_add(x, b, r, 0.5, False), (x, b, r))


def test_bias_dropout_add_training_drops_and_rescales():
    p = 0.25
    x, r = _randn(256, 256, seed=20), _randn(256, 256, seed=21)
    torch.manual_seed(0)
    y = ref.bias_dropout_add(x, None, r, p, True)
    delta = y - r
    kept = delta != 0
    torch.testing.assert_close(delta[kept], x[kept] / (1 - p))
    assert abs(kept.double().mean().item() - (1 - p)) < 0.01


# --- softmax and attention ------------------------------------------------------------------------


def _naive_attention(q, k, v, causal, mask, bias, scale):
    b, n, sq, d = q.shape
    g, sk = k.shape[1], k.shape[2]
    out = torch.zeros_like(q)
    full_mask = torch.zeros(b, n, sq, sk, dtype=torch.bool) if mask is None else mask.expand(b, n, sq, sk)
    full_bias = torch.zeros(b, n, sq, sk, dtype=q.dtype) if bias is None else bias.expand(b, n, sq, sk)
    for bi in range(b):
        for h in range(n):
            kv = h // (n // g)
            scores = q[bi, h] @ k[bi, kv].T * scale + full_bias[bi, h]
            for i in range(sq):
                for j in range(sk):
                    if (causal and j > i + (sk - sq)) or full_mask[bi, h, i, j]:
                        scores[i, j] = float("-inf")
            out[bi, h] = torch.softmax(scores, dim=-1) @ v[bi, kv]
    return out


ATTN_CASES = {
    "causal": dict(n=4, g=4, sq=6, sk=6, causal=True),
    "full": dict(n=4, g=4, sq=6, sk=6, causal=False),
    "gqa": dict(n=4, g=2, sq=5, sk=5, causal=True),
    "mqa": dict(n=4, g=1, sq=5, sk=5, causal=True),
    "padding_mask": dict(n=2, g=2, sq=6, sk=6, causal=True, mask=True),
    "bias": dict(n=2, g=2, sq=5, sk=5, causal=True, bias=True),
    "sq_lt_sk": dict(n=2, g=1, sq=3, sk=7, causal=True),
}


@pytest.mark.parametrize("name", list(ATTN_CASES))
def test_attention_matches_naive_loops(name):
    c = ATTN_CASES[name]
    b, d = 2, 8
    q = _randn(b, c["n"], c["sq"], d, seed=23)
    k = _randn(b, c["g"], c["sk"], d, seed=24)
    v = _randn(b, c["g"], c["sk"], d, seed=25)
    mask = None
    if c.get("mask"):
        mask = torch.zeros(b, 1, 1, c["sk"], dtype=torch.bool)
        mask[0, ..., -2:] = True  # padded keys of the first sequence
    bias = _randn(1, c["n"], c["sq"], c["sk"], seed=26) if c.get("bias") else None
    got = ref.attention(q, k, v, causal=c["causal"], mask=mask, bias=bias)
    expect = _naive_attention(q, k, v, c["causal"], mask, bias, 1 / math.sqrt(d))
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def test_attention_gradcheck_gqa_causal_bias():
    q = _randn(1, 2, 3, 4, seed=27, requires_grad=True)
    k = _randn(1, 1, 5, 4, seed=28, requires_grad=True)
    v = _randn(1, 1, 5, 4, seed=29, requires_grad=True)
    bias = _randn(1, 2, 3, 5, seed=30)
    _gradcheck_fp32_internal(lambda q, k, v: ref.attention(q, k, v, causal=True, bias=bias), (q, k, v))


# --- cross-entropy --------------------------------------------------------------------------------


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_matches_formula(smoothing):
    logits = _randn(3, 4, 11, seed=31) * 3
    labels = torch.randint(0, 11, (3, 4), generator=_gen(32))
    labels[0, 1] = -100  # ignored, as F.cross_entropy's default ignore_index
    lse = torch.logsumexp(logits, dim=-1)
    x_y = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    expect = (1 - smoothing) * (lse - x_y) + smoothing * (lse - logits.mean(-1))
    expect = expect.masked_fill(labels == -100, 0.0)
    got = ref.cross_entropy(logits, labels, smoothing)
    assert got.dtype == torch.float64 and got.shape == labels.shape  # at least fp32: float64 stays
    torch.testing.assert_close(got, expect, rtol=1e-10, atol=1e-10)


def test_cross_entropy_from_bf16_logits_computes_in_fp32():
    logits = (_randn(8, 50, seed=33) * 4).to(torch.bfloat16)
    labels = torch.randint(0, 50, (8,), generator=_gen(34))
    expect = F.cross_entropy(logits.double(), labels, reduction="none").float()
    torch.testing.assert_close(ref.cross_entropy(logits, labels), expect, rtol=1e-5, atol=1e-5)


def test_cross_entropy_gradcheck_with_smoothing():
    logits = _randn(4, 7, seed=35, requires_grad=True)
    labels = torch.tensor([1, 6, -100, 0])
    _gradcheck_fp32_internal(lambda x: ref.cross_entropy(x, labels, 0.1), (logits,))


# --- optimizer ------------------------------------------------------------------------------------


@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_step_matches_torch_optim(decoupled):
    shapes = [(7, 5), (13,), (3, 4, 2)]
    params = [_randn(*s, seed=40 + i, dtype=torch.float32) for i, s in enumerate(shapes)]
    torch_params = [p.clone().requires_grad_() for p in params]
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)(torch_params, **hp)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(1, 6):
        grads = [_randn(*s, seed=100 * step + i, dtype=torch.float32) for i, s in enumerate(shapes)]
        for tp, g in zip(torch_params, grads):
            tp.grad = g.clone()
        opt.step()
        ref.adam_step(
            params, [g.clone() for g in grads], m, v, step=step, lr=hp["lr"], beta1=0.9, beta2=0.95,
            eps=hp["eps"], weight_decay=hp["weight_decay"], decoupled_weight_decay=decoupled,
        )  # fmt: skip
    for p, tp in zip(params, torch_params):
        torch.testing.assert_close(p, tp.detach(), rtol=1e-6, atol=1e-6)
    for i, tp in enumerate(torch_params):
        torch.testing.assert_close(m[i], opt.state[tp]["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v[i], opt.state[tp]["exp_avg_sq"], rtol=1e-6, atol=1e-9)
