"""The inputs of the op cases: seeded random tensors, RoPE angles, attention masks, and one maker per
kind of case, ``make(dtype, generator) -> (args, kwargs)``."""

from __future__ import annotations

import torch

from mcore.ops import reference


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def rotary_freqs(seq: int, rot_dim: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE angles ``[s, 1, 1, r]`` (or ``[s, b, 1, r]`` from ``positions [b, s]``), rotate-half layout."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    pos = torch.arange(seq, dtype=torch.float32)[:, None] if positions is None else positions.t().float()
    angles = pos[..., None] * inv
    return torch.cat((angles, angles), dim=-1)[:, :, None, :]


def padding_mask(gen: torch.Generator, b: int, sk: int) -> torch.Tensor:
    """``[b, 1, 1, sk]``: a few trailing keys masked per batch, never all of them."""
    lengths = torch.randint(sk // 2, sk + 1, (b,), generator=gen)
    return (torch.arange(sk)[None, :] >= lengths[:, None])[:, None, None, :]


def document_mask(b: int, s: int) -> torch.Tensor:
    """``[b, 1, s, s]`` causal masks that also block attention across two documents per sample."""
    doc = (torch.arange(s) >= s // 3).long()
    allowed = (torch.arange(s)[None, :] <= torch.arange(s)[:, None]) & (doc[None, :] == doc[:, None])
    return (~allowed)[None, None].expand(b, 1, s, s).contiguous()


def adam_make(dtype, gen):
    params = [randn(gen, 8, 16), randn(gen, 16)]
    grads = [randn(gen, *p.shape) for p in params]
    exp_avgs = [randn(gen, *p.shape, scale=0.1) for p in params]
    exp_avg_sqs = [randn(gen, *p.shape).abs() * 0.01 for p in params]
    hyper = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    return [params, grads, exp_avgs, exp_avg_sqs], hyper


def adam_l2_make(dtype, gen):
    args, hyper = adam_make(dtype, gen)
    return args, {**hyper, "step": 1, "decoupled_weight_decay": False}


def adam_flat_make(mode: str, device_step: bool = False):
    """Flat buffers of 1500 elements, three segments (two groups, one gap), in one of three storages;
    ``device_step``: the step as a 0-d integer tensor on the device (the optimizer's counter)."""

    def make(dtype, gen):
        from mcore.ops.flat import FlatSegments, split_master

        n_buffer, n_state = 1500, 1400
        state_index = torch.cat([torch.arange(0, 900), torch.arange(1000, 1500)])
        segments = FlatSegments.from_runs([(0, 0, 600, 0), (600, 600, 300, 1), (900, 1000, 500, 0)])
        masters = randn(gen, n_buffer)
        grads = randn(gen, n_buffer)
        exp_avgs = randn(gen, n_state, scale=0.1)
        exp_avg_sqs = randn(gen, n_state).abs() * 0.01
        if mode == "fp32":
            tensors = [grads, masters, None, None, exp_avgs, exp_avg_sqs]
        elif mode == "masters":
            tensors = [
                grads,
                masters.to(torch.bfloat16),
                masters[state_index].clone(),
                None,
                exp_avgs,
                exp_avg_sqs,
            ]
        else:  # precision-aware: bf16 grads and moments, remainders
            params, remainders = split_master(masters)
            tensors = [
                grads.to(torch.bfloat16),
                params,
                None,
                remainders[state_index].clone(),
                exp_avgs.to(torch.bfloat16),
                exp_avg_sqs.to(torch.bfloat16),
            ]
        hyper = dict(
            step=torch.tensor(3) if device_step else 3, lrs=[1e-2, 2e-2], weight_decays=[0.1, 0.0],
            beta1=0.9, beta2=0.95, eps=1e-8, grad_scale=torch.tensor(0.5), skip=torch.tensor(False),
        )  # fmt: skip
        return [*tensors, segments], hyper

    return make


def adam_flat_fp8_make(mode: str):
    """:func:`adam_flat_make`'s buffers with the FP8 copies of three FP8 weights (W=4, weight 2 has no
    piece here): pieces that start and end inside aligned blocks, non-FP8 parameters between them, one
    piece across two segments (a group change), a scale that saturates."""
    base = adam_flat_make(mode)

    def make(dtype, gen):
        from mcore.ops.flat import FlatFp8Weights

        args, hyper = base(dtype, gen)
        n_buffer = args[1].numel()
        data = torch.full((n_buffer,), 0x5A, dtype=torch.uint8).view(torch.float8_e4m3fn)  # a sentinel
        ranges = ((37, 410, 0), (560, 899, 3), (1003, 1497, 1))
        scales = torch.tensor([96.0, 200.0, 5.0, 0.75])  # saturates for the larger |p| of weight 1
        fp8 = FlatFp8Weights(data, ranges, scales, torch.full((4,), 7.0))
        return [*args, fp8], hyper

    return make


def accumulate_weight_grad_make(dtype, gen):
    """An fp32 gradient buffer ``[24, 40]`` (the mixed case for half dtypes) += ``dY^T X`` over 64 tokens."""
    main_grad = randn(gen, 24, 40)
    return [main_grad, randn(gen, 64, 24, dtype=dtype), randn(gen, 64, 40, dtype=dtype)], {}


def fp8_quantize_make(dtype, gen):
    """``[40, 48]`` with a few values past the e4m3 range after scaling (they saturate)."""
    x = randn(gen, 40, 48, scale=3.0, dtype=dtype)
    x[0, :2] = 1e4
    return [x, torch.tensor(20.0), torch.float8_e4m3fn], {}


FP8_FLAT_RUNS = ((5, 37, 0), (37, 37, 2), (40, 203, 1), (203, 210, 2), (250, 1499, 4))
"""``(start, end, weight)`` runs of a 1536-element buffer for the flat FP8 maps: starts and ends inside
16-element blocks, an empty run, weight 3 without a run, a long run."""


def fp8_quantize_flat_make(dtype, gen):
    """Flat parameters (``dtype``) quantized over :data:`FP8_FLAT_RUNS` into a sentinel-filled e4m3
    buffer; weight 2's scale saturates."""
    from mcore.ops.flat import FlatFp8Weights

    params = randn(gen, 1536, scale=3.0, dtype=dtype)
    data = torch.full((1536,), 0x5A, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.tensor([40.0, 96.0, 2000.0, 1.0, 0.5])
    return [params, FlatFp8Weights(data, FP8_FLAT_RUNS, scales, torch.zeros(5))], {}


def fp8_dequantize_flat_make(dtype, gen):
    """Random e4m3 bytes (no NaN) dequantized over :data:`FP8_FLAT_RUNS` into flat parameters
    (``dtype``) with a strided ``scale_inv`` (``[W, 4][:, 0]``, as ``--fp8-param-gather`` keeps it)."""
    params = randn(gen, 1536, scale=7.0, dtype=dtype)
    data = torch.randint(0, 256, (1536,), generator=gen, dtype=torch.uint8)
    data[(data & 0x7F) == 0x7F] = 0x11
    scale_inv = torch.ones(5, 4)
    scale_inv[:, 0] = torch.tensor([0.5, 1 / 96, 3e-3, 1.0, 1.03125])
    return [params, data.view(torch.float8_e4m3fn), scale_inv[:, 0], FP8_FLAT_RUNS], {}


def fp8_amax_make(dtype, gen):
    return [randn(gen, 40, 48, scale=3.0, dtype=dtype)], {}


def fp8_cast_make(from_amax: bool):
    """The cast and its transpose with the scale formed from an amax below the tensor's (the largest
    values saturate), or with a given scale and the amax recorded in place (the delayed recipe)."""

    def make(dtype, gen):
        (x, scale, fp8_dtype), _ = fp8_quantize_make(dtype, gen)
        if from_amax:
            return [x, torch.float8_e5m2], {"amax": torch.tensor(300.0), "margin": 1, "columnwise": True}
        return [x, fp8_dtype], {"scale": scale, "columnwise": True, "amax_record": torch.zeros(1)}

    return make


def fp8_cast_packed_make(dbias: bool):
    """A fused QKV projection's output gradient as its three parts (2 groups of ``[q 128 | k 64 | v
    64]`` columns, so that 64-wide column bands fit), a given scale, the amax recorded."""

    def make(dtype, gen):
        parts = [randn(gen, 40, 2 * w, scale=3.0, dtype=dtype) for w in (128, 64, 64)]
        parts[1][0, :2] = 1e4  # saturates
        return [parts, 2, torch.float8_e5m2], {
            "dbias": dbias, "scale": torch.tensor(20.0), "columnwise": True, "amax_record": torch.zeros(1)
        }  # fmt: skip

    return make


def fp8_operand(gen, rows: int, k: int, fp8_dtype=torch.float8_e4m3fn) -> torch.Tensor:
    return (torch.randn(rows, k, generator=gen) * 64).to(fp8_dtype)


def fp8_transpose_make(dtype, gen):
    """An FP8 ``[40, 72]`` (e4m3 for the fp32 pass, e5m2 for bf16): no side a multiple of a tile."""
    fp8_dtype = torch.float8_e4m3fn if dtype == torch.float32 else torch.float8_e5m2
    return [fp8_operand(gen, 40, 72, fp8_dtype)], {}


def scaled_linear_make(which: str):
    """FP8 NT operands (K = 32, outputs 48 x 64; the gradient operand e5m2 as in the hybrid format)
    with per-tensor scale inverses; bf16/fp32 outputs."""

    def make(dtype, gen):
        sa, sb = torch.tensor(0.0123), torch.tensor(0.0071)
        if which == "forward":
            a, b = fp8_operand(gen, 48, 32), fp8_operand(gen, 64, 32)
            return [a, b, sa, sb, randn(gen, 64, dtype=dtype), dtype], {}
        a, b = fp8_operand(gen, 48, 32, torch.float8_e5m2), fp8_operand(gen, 64, 32)
        if which == "dgrad":
            return [a, b, sa, sb, dtype], {}
        if which == "wgrad_overwrite":  # a step's first gradient: written over a stale main_grad
            return [a, b, sa, sb, dtype, randn(gen, 48, 64)], {"accumulate": False}
        return [a, b, sa, sb, dtype, randn(gen, 48, 64)], {}  # wgrad accumulated into a main_grad

    return make


def act_fp8_make(kind: str, backward: bool, bias: bool = True):
    """fc1's output ``h [40, 48]`` (SwiGLU ``[40, 96]``) with a bias, a few values past the FP8 range
    after scaling (they saturate); the activation or its backward (fc2's input gradient ``[40, 48]``)
    quantized to e4m3 (forward) or e5m2 (backward) with a given scale, the amax recorded in place."""

    def make(dtype, gen):
        width = 96 if kind == "swiglu" else 48
        h = randn(gen, 40, width, scale=2.0, dtype=dtype)
        h[0, :2] = 300.0
        b = randn(gen, width, dtype=dtype) if bias else None
        kwargs = {"amax_record": torch.zeros(1)}
        if not backward:
            return [h, b, kind, torch.float8_e4m3fn, torch.tensor(40.0)], kwargs
        dy = randn(gen, 40, 48, dtype=dtype)
        return [dy, h, b, kind, torch.float8_e5m2, torch.tensor(3000.0)], kwargs

    return make


def ce_rows_make(smoothing: bool = False, grad: bool = False):
    """Inputs of the in-place cross-entropy's two ops: 37 rows of one rank's 96-wide vocabulary
    slice (of 4 * 96), every fourth label outside it."""

    def make(dtype, gen):
        rows, width = 37, 96
        logits = randn(gen, rows, width, dtype=dtype, scale=3.0)
        local_labels = torch.randint(0, width, (rows,), generator=gen)
        outside = torch.arange(rows) % 4 == 1
        local_labels = local_labels.masked_fill(outside, 0)
        if not grad:
            return [logits, local_labels, outside, smoothing], {}
        # the global log-sum-exp: this slice's plus the other ranks' share
        log_z = torch.logsumexp(logits.float(), dim=-1) + torch.rand(rows, generator=gen) * 2
        dloss = torch.rand(rows, generator=gen) + 0.5
        return [logits, local_labels, outside, log_z, dloss, 0.1 if smoothing else 0.0, 4 * width], {}

    return make


def layer_norm_make(dtype, gen):
    """``x [3, 5, 64]``, weight and bias ``[64]``."""
    x = randn(gen, 3, 5, 64, dtype=dtype)
    return [x, randn(gen, 64, dtype=dtype), randn(gen, 64, dtype=dtype)], {"eps": 1e-5}


def rms_norm_make(dtype, gen):
    """``x [3, 5, 64]``, a weight near one ``[64]``."""
    x = randn(gen, 3, 5, 64, dtype=dtype)
    return [x, (1 + randn(gen, 64, scale=0.1)).to(dtype)], {"eps": 1e-6}


def norm_fp8_make(kind: str, fp8_dtype: torch.dtype, rowwise: bool):
    """``x [37, 64]`` (rows not a multiple of a kernel's row block) normalised into FP8 with a scale
    at which the largest outputs saturate (e4m3), the amax recorded into a slot already holding 1."""

    def make(dtype, gen):
        args, _ = (layer_norm_make if kind == "LayerNorm" else rms_norm_make)(dtype, gen)
        x, weight, bias = args[0].reshape(15, 64), args[1], (args[2] if kind == "LayerNorm" else None)
        x = torch.cat([x, randn(gen, 22, 64, dtype=dtype, scale=3.0)])
        scale = torch.tensor(96.0 if fp8_dtype == torch.float8_e4m3fn else 1000.0)
        kwargs = {"amax_record": torch.ones(1), "rowwise": rowwise, "columnwise": True}
        return [x, weight, bias, 1e-5, kind, fp8_dtype, scale], kwargs

    return make


def norm_backward_make(kind: str, residual: bool):
    """The norm's backward on ``[37, 64]`` rows from the statistics :func:`reference.norm_fp8_forward`
    saves, with the residual stream's gradient or without."""

    def make(dtype, gen):
        x, weight, bias, eps, kind_, fp8_dtype, scale = norm_fp8_make(kind, torch.float8_e4m3fn, True)(
            dtype, gen
        )[0]
        *_, mean, rstd = reference.norm_fp8_forward(x, weight, bias, eps, kind_, fp8_dtype, scale)
        dy = randn(
            gen,
            *x.shape,
            dtype=x.dtype if kind == "LayerNorm" else torch.promote_types(x.dtype, weight.dtype),
        )
        kwargs = {"residual_grad": randn(gen, *x.shape, dtype=dtype)} if residual else {}
        return [dy, x, weight, bias, eps, kind, mean, rstd], kwargs

    return make


# --- mixture of experts ---------------------------------------------------------------------------

MOE_TOKENS, MOE_EXPERTS, MOE_TOPK = 12, 4, 2
"""The MoE cases' routing: 12 tokens, 4 local experts, top-2 (24 rows); expert 2 receives none."""


def moe_routing_make(topk: int = 4, **kwargs):
    """Router logits ``[16, 8]`` (fp32, continuous random: no ties) and the routing options."""

    def make(dtype, gen):
        logits = randn(gen, 16, 8, scale=2.0)
        options = dict(kwargs)
        if options.pop("with_bias", False):
            options["expert_bias"] = randn(gen, 8, scale=0.3)
        return [logits, topk], options

    return make


# --- context-parallel attention (attention_with_lse, attention_with_lse_backward, attention_merge) -----


def attention_lse_make(n=4, g=4, sq=16, sk=16, d=32, causal=True):
    """One block of keys for ``attention_with_lse``: ``q [2, n, sq, d]``, ``k``/``v [2, g, sk, d]``
    (``causal`` with ``sq > sk`` leaves the first ``sq - sk`` rows without a key: out 0, lse -inf)."""

    def make(dtype, gen):
        q = randn(gen, 2, n, sq, d, dtype=dtype)
        k, v = randn(gen, 2, g, sk, d, dtype=dtype), randn(gen, 2, g, sk, d, dtype=dtype)
        return [q, k, v], {"causal": causal}

    return make


def moe_routing(gen: torch.Generator, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs [T, E] fp32, routing_map [T, E] bool)``: top-2 of random scores with expert 2 never
    chosen (a local expert that receives no token), or nothing routed at all (``empty``: a rank that
    receives no token under expert parallelism)."""
    scores = torch.rand(MOE_TOKENS, MOE_EXPERTS, generator=gen)
    scores[:, 2] = -1.0
    index = scores.topk(MOE_TOPK, dim=-1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, index, True)
    if empty:
        routing_map.zero_()
    probs = torch.rand(MOE_TOKENS, MOE_EXPERTS, generator=gen) * routing_map
    return probs, routing_map


def weighted_swiglu_make(rows: int = 24, width: int = 96):
    """``weighted_swiglu`` of ``x [rows, width]`` (gate first) with fp32 weights in ``[0, 1)`` (the
    router's probabilities; one row's 0, a padded row's); ``rows=0``: a rank with no routed token."""

    def make(dtype, gen):
        weights = torch.rand(rows, generator=gen)
        weights[: min(rows, 1)] = 0.0
        return [randn(gen, rows, width, dtype=dtype), weights], {}

    return make


def moe_permute_make(with_probs: bool = True, empty: bool = False):
    """``moe_permute`` of ``[12, 32]`` tokens (hidden a multiple of 16 bytes)."""

    def make(dtype, gen):
        probs, routing_map = moe_routing(gen, empty)
        tokens = randn(gen, MOE_TOKENS, 32, dtype=dtype)
        return [tokens, routing_map, probs if with_probs else None, int(routing_map.sum())], {}

    return make


def attention_lse_backward_make(causal: bool, n=4, g=2, s=16, d=32):
    """A ring block of a causal sequence cut into two chunks, for ``attention_with_lse_backward``: the
    second chunk's queries against the first chunk's keys (``causal=False``) or its own (``causal``),
    with the FINAL ``out``/``lse`` of those queries over both chunks (the reference's, from the
    rounded inputs; ``out`` rounded to ``dtype``) and a random ``dout``."""

    def make(dtype, gen):
        h = s // 2
        q = randn(gen, 2, n, h, d, dtype=dtype)
        k, v = randn(gen, 2, g, s, d, dtype=dtype), randn(gen, 2, g, s, d, dtype=dtype)
        early = reference.attention_with_lse(
            q.float(), k[:, :, :h].float(), v[:, :, :h].float(), causal=False
        )
        own = reference.attention_with_lse(q.float(), k[:, :, h:].float(), v[:, :, h:].float(), causal=True)
        out, lse = reference.attention_merge(*early, *own)
        block = slice(h, s) if causal else slice(0, h)
        dout = randn(gen, 2, n, h, d, dtype=dtype)
        kb, vb = k[:, :, block].contiguous(), v[:, :, block].contiguous()
        return [dout, q, kb, vb, out.to(dtype), lse], {"causal": causal}

    return make


def moe_unpermute_make(with_probs: bool = True, empty: bool = False):
    """``moe_unpermute`` of random expert outputs ``[N, 32]`` back to ``[12, 32]``."""

    def make(dtype, gen):
        probs, routing_map = moe_routing(gen, empty)
        *_, sorted_indices = reference.moe_permute(torch.zeros(MOE_TOKENS, 1), routing_map)
        rows = randn(gen, sorted_indices.numel(), 32, dtype=dtype)
        return [rows, sorted_indices, (MOE_TOKENS, 32), probs if with_probs else None, routing_map], {}

    return make


def grouped_gemm_make(counts: tuple[int, ...] = (5, 0, 9, 3), k: int = 32, m: int = 48):
    """``grouped_gemm`` of ``x [sum(counts), k]`` by ``weight [E, m, k]``: by default expert 1 has no
    token; ``k``/``m`` multiples of 8 fit the CUDA kernel's 16-byte alignment in bf16."""

    def make(dtype, gen):
        tokens_per_expert = torch.tensor(counts, dtype=torch.int64)
        x = randn(gen, sum(counts), k, dtype=dtype)
        weight = randn(gen, len(counts), m, k, dtype=dtype, scale=k**-0.5)
        return [x, weight, tokens_per_expert], {}

    return make

    return make


def scaled_grouped_gemm_make(
    which: str, counts: tuple[int, ...] = (5, 0, 9, 18), k: int = 32, m: int = 48, quantized=None
):
    """The experts' FP8 GEMMs (``which``: ``"forward"`` ``scaled_grouped_gemm`` of ``x_q [N, k]`` by
    ``W_q [E, m, k]``, ``"wgrad"`` ``scaled_grouped_gemm_wgrad`` of ``dy_qT [m, N]`` by ``x_qT [k, N]``)
    with per-row scale inverses; by default expert 1 has no token. ``quantized``: the operands' dtype
    (e4m3 by default; the wgrad's output-gradient operand e5m2, as the hybrid format's); ``dtype``
    the output's."""

    def make(dtype, gen):
        tokens_per_expert = torch.tensor(counts, dtype=torch.int64)
        n, e = sum(counts), len(counts)

        def operand(*shape, fp8_dtype=torch.float8_e4m3fn):
            q_dtype = quantized or fp8_dtype
            values = torch.randn(*shape, generator=gen) * (40 if q_dtype == torch.int8 else 64)
            return (
                values.clamp(-127, 127).round().to(q_dtype) if q_dtype == torch.int8 else values.to(q_dtype)
            )

        def scales(*shape):
            return torch.rand(*shape, generator=gen) * 0.02 + 1e-3

        if which == "forward":
            return [operand(n, k), operand(e, m, k), scales(n), scales(e, m), tokens_per_expert, dtype], {}
        a_qT, b_qT = operand(m, n, fp8_dtype=torch.float8_e5m2), operand(k, n)
        return [a_qT, b_qT, scales(e, m), scales(e, k), tokens_per_expert, dtype], {}

    return make


def attention_merge_make(dtype, gen):
    """Two partial results ``out [2, 4, 16, 32]`` (``dtype``) with fp32 log-sum-exps: rows 0-2 -inf in
    the first, rows 2-4 in the second (row 2 in both: out 0, lse -inf), others spread over +-8."""
    out_a, out_b = randn(gen, 2, 4, 16, 32, dtype=dtype), randn(gen, 2, 4, 16, 32, dtype=dtype)
    lse_a, lse_b = randn(gen, 2, 4, 16, scale=8.0), randn(gen, 2, 4, 16, scale=8.0)
    lse_a[:, :, 0:3] = float("-inf")
    lse_b[:, :, 2:5] = float("-inf")
    out_a[:, :, 0:3] = 0
    out_b[:, :, 2:5] = 0
    return [out_a, lse_a, out_b, lse_b], {}
