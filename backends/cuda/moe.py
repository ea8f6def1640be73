"""The CUDA backend's MoE ops: the grouped GEMM on ``torch._grouped_mm``, permute/unpermute by index
ops that avoid host syncs and fp32 copies where they can.

* ``grouped_gemm``: :class:`GroupedMM`, an autograd.Function over ``torch._grouped_mm`` (CUTLASS
  grouped GEMM, sm90+): forward ``y = grouped_mm(x, W^T, offs)`` (``x [N, K]`` 2-D by ``W^T`` 3-D
  ``[E, K, M]``, groups along the rows), input gradient ``dx = grouped_mm(dy, W, offs)``, weight
  gradient ``dW = grouped_mm(dy^T, x, offs)`` (2-D by 2-D, groups along the reduced dim N: one
  ``[M, K]`` block per expert). ``offs = cumsum(tokens_per_expert)`` as int32 on the device (no host
  sync). The kernel serves bf16 CUDA tensors whose row strides are multiples of 16 bytes (``K`` and
  ``M`` multiples of 8) and 16-byte aligned storage; anything else (fp32/fp16, unaligned shapes, CPU
  tensors) runs the reference loop of per-expert matmuls. An expert with no token gets a zero weight
  gradient (the kernel writes zeros for a group with no rows; a GPU test holds it to that).
  ``torch._grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None)`` has this signature in torch
  2.8 through 2.13.
* ``moe_permute``: with ``num_out_tokens`` given, the rows come from a stable sort of the flattened
  ``[E, T]`` routing map (routed pairs first, expert-major, token order kept), so no host sync
  (``masked_select`` needs one to size its output); without it, the reference's ``masked_select``.
  On the GPU its backward (:class:`Permute`) sums each token's row gradients with the unpermute
  kernel (fp32, deterministic) instead of a bf16 ``index_add``.
* ``moe_unpermute``: :class:`Unpermute`, which saves the rows in their own dtype (the reference's
  autograd keeps an fp32 copy of the weighted rows) and sums in fp32: on the GPU with one Triton
  kernel each way (a per-token gather-sum in a fixed order: deterministic, no fp32 copy of the rows),
  elsewhere with ``index_add``; each row's weight is gathered by the same sort, without a host sync.
  Without probs (the MoE layer's combine: the experts weighted their rows) it keeps only the indices:
  the rows' gradient is a gather of the output's.
* ``moe_topk_routing``: one Triton kernel each way (score function, top-k, weights, the ``[T, E]``
  probs and map) where the reference ran about twenty small ones; group-limited routing stays the
  reference.
"""

from __future__ import annotations

import torch

from mcore.ops import reference
from mcore.ops.reference.moe import check_routing_args

from .device import on_kernel_device, tracing

GROUPED_MM_ON_CPU = False
"""Let :func:`grouped_gemm` call ``torch._grouped_mm`` on CPU tensors (tests only: torch's CPU
implementation runs the same autograd.Function without a GPU)."""

_ALIGN = 16  # bytes: the kernel's stride and base-address alignment


def _aligned(t: torch.Tensor) -> bool:
    """16-byte row strides and (outside a torch.compile trace, where fake tensors have no address,
    and Inductor's buffers are aligned) a 16-byte aligned base address."""
    size = t.element_size()
    return (torch.compiler.is_compiling() or t.data_ptr() % _ALIGN == 0) and all(
        (s * size) % _ALIGN == 0 for s, n in zip(t.stride(), t.shape) if n > 1 and s != 1
    )


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The call fits ``torch._grouped_mm``: bf16 on one CUDA device (or CPU under the test flag),
    ``x [N, K]`` and ``weight [E, M, K]`` contiguous with 16-byte aligned rows."""
    on_device = (x.is_cuda and weight.device == x.device) or (
        GROUPED_MM_ON_CPU and x.device.type == weight.device.type == "cpu"
    )
    return (
        on_device
        and hasattr(torch, "_grouped_mm")
        and x.dtype == weight.dtype == torch.bfloat16
        and x.dim() == 2
        and weight.dim() == 3
        and x.shape[1] == weight.shape[2]
        and x.is_contiguous()
        and weight.is_contiguous()
        and (x.shape[1] * 2) % _ALIGN == 0
        and (weight.shape[1] * 2) % _ALIGN == 0
        and _aligned(x)
        and _aligned(weight)
    )


def _contiguous_aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if torch.compiler.is_compiling() or t.data_ptr() % _ALIGN == 0 else t.clone()


class GroupedMM(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ weight[e]^T`` through ``torch._grouped_mm`` (see the module)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = tokens_per_expert.to(x.device)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        ctx.save_for_backward(x, weight, offs)
        if x.shape[0] == 0:  # a rank that received no token
            return x.new_empty(0, weight.shape[1])
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, offs = ctx.saved_tensors
        dx = dw = None
        if x.shape[0] == 0:
            dx = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
            dw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
            return dx, dw, None
        dy = _contiguous_aligned(dy.to(x.dtype))
        if ctx.needs_input_grad[0]:
            dx = torch._grouped_mm(dy, weight, offs=offs)
        if ctx.needs_input_grad[1]:
            # [E, M, K]: dy_e^T x_e per group of rows. An expert without rows gets zeros from the kernel
            # itself (a sum over nothing; torch's own _grouped_mm backward relies on it too), so no
            # masking pass over the [E, M, K] gradient here: test_empty_experts_get_zero_weight_grads
            # checks it on the GPU with the allocator poisoned.
            dw = torch._grouped_mm(dy.t(), x, offs=offs)
        return dx, dw, None


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The reference ``grouped_gemm`` through ``torch._grouped_mm`` where it fits (bf16, aligned, CUDA),
    else the reference loop."""
    if grouped_mm_fits(x, weight) and tokens_per_expert.shape == (weight.shape[0],):
        return GroupedMM.apply(x, weight, tokens_per_expert)
    return reference.grouped_gemm(x, weight, tokens_per_expert)


def _routed_pairs(routing_map: torch.Tensor, n: int) -> torch.Tensor:
    """The flat ``[E * T]`` positions (``e * T + t``) of the ``n`` routed pairs, expert-major, token
    order kept: the set positions of the transposed map in ascending order, by ``nonzero_static``
    (one selection pass; ``n`` must be the map's count: it is trusted, not checked, as checking
    would sync with the host)."""
    return torch.nonzero_static(routing_map.t().reshape(-1), size=n).flatten()


def moe_permute(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
):
    """The reference ``moe_permute``; with ``num_out_tokens`` the row order comes from a stable sort
    of the routing map (no host sync)."""
    if num_out_tokens is None or tokens.dim() != 2 or routing_map.shape[:1] != tokens.shape[:1]:
        return reference.moe_permute(tokens, routing_map, probs, num_out_tokens)
    order = _routed_pairs(routing_map, num_out_tokens)
    sorted_indices = order % tokens.shape[0]
    permuted_probs = None if probs is None else probs.t().reshape(-1).index_select(0, order)
    if _triton_fits(tokens, sorted_indices, None):
        return Permute.apply(tokens, sorted_indices), permuted_probs, sorted_indices
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


class Permute(torch.autograd.Function):
    """``rows = tokens[sorted_indices]``; backward ``d tokens[t] = sum of d rows[i] over t's rows``
    as the unpermute kernel's deterministic per-token gather-sum in fp32 (autograd's ``index_select``
    backward is an ``index_add`` in the tokens' dtype, atomics in bf16)."""

    @staticmethod
    def forward(ctx, tokens, sorted_indices):
        from .triton_kernels import moe_unpermute as kernels

        ctx.save_for_backward(sorted_indices)
        ctx.num_tokens = tokens.shape[0]
        return kernels.gather_rows(tokens, sorted_indices)

    @staticmethod
    def backward(ctx, d_rows):
        from .triton_kernels import moe_unpermute as kernels

        (sorted_indices,) = ctx.saved_tensors
        order, offsets = kernels.token_order(sorted_indices, ctx.num_tokens)
        return kernels.unpermute_forward(d_rows.contiguous(), None, order, offsets, ctx.num_tokens), None


class Unpermute(torch.autograd.Function):
    """``out[t_i] += rows[i] * p_i`` summed in fp32, returned in ``rows.dtype``; saves ``rows`` as
    they are when weighted (for ``d p``), else only the indices. Backward: ``d rows[i] = dout[t_i] *
    p_i``, ``d p_i = <dout[t_i], rows[i]>``.

    On the Triton device (:func:`_triton_fits`) both directions are one kernel each
    (:mod:`~mcore.backends.cuda.triton_kernels.moe_unpermute`: a deterministic per-token gather-sum,
    no fp32 copy of the rows); elsewhere an fp32 ``index_add``."""

    @staticmethod
    def forward(ctx, rows, sorted_indices, restore_shape, row_probs):
        ctx.save_for_backward(None if row_probs is None else rows, sorted_indices, row_probs)
        ctx.rows_dtype = rows.dtype
        ctx.triton = _triton_fits(rows, sorted_indices, row_probs)
        if ctx.triton:
            from .triton_kernels import moe_unpermute as kernels

            order, offsets = kernels.token_order(sorted_indices, restore_shape[0])
            return kernels.unpermute_forward(rows, row_probs, order, offsets, restore_shape[0])
        compute = torch.promote_types(rows.dtype, torch.float32)
        wide = rows.to(compute) if row_probs is None else rows.to(compute) * row_probs.to(compute)[:, None]
        out = wide.new_zeros(tuple(restore_shape)).index_add_(0, sorted_indices, wide)
        return out.to(rows.dtype)

    @staticmethod
    def backward(ctx, dout):
        rows, sorted_indices, row_probs = ctx.saved_tensors
        if row_probs is None:  # a plain sum: each row's gradient is its token's
            if ctx.triton:
                from .triton_kernels import moe_unpermute as kernels

                return (
                    kernels.gather_rows(dout.contiguous(), sorted_indices).to(ctx.rows_dtype),
                    None,
                    None,
                    None,
                )
            return dout.index_select(0, sorted_indices).to(ctx.rows_dtype), None, None, None
        if ctx.triton:
            from .triton_kernels import moe_unpermute as kernels

            d_rows, d_probs = kernels.unpermute_backward(dout.contiguous(), rows, row_probs, sorted_indices)
            d_probs = None if d_probs is None else d_probs.to(row_probs.dtype)
            return d_rows, None, None, d_probs
        gathered = dout.index_select(0, sorted_indices)
        d_rows = d_probs = None
        if ctx.needs_input_grad[0]:
            compute = torch.promote_types(rows.dtype, torch.float32)
            d_rows = gathered if row_probs is None else gathered.to(compute) * row_probs.to(compute)[:, None]
            d_rows = d_rows.to(rows.dtype)
        if row_probs is not None and ctx.needs_input_grad[3]:
            compute = torch.promote_types(rows.dtype, row_probs.dtype)
            d_probs = (gathered.to(compute) * rows.to(compute)).sum(-1).to(row_probs.dtype)
        return d_rows, None, None, d_probs


def _triton_fits(rows: torch.Tensor, sorted_indices: torch.Tensor, row_probs: torch.Tensor | None) -> bool:
    """The Triton kernels serve 2-D contiguous bf16/fp16/fp32 rows with fp32 (or no) weights on the
    kernel device, outside a ``torch.compile`` trace (which traces the eager version)."""
    return (
        not tracing()
        and on_kernel_device(rows, sorted_indices, row_probs)
        and rows.dim() == 2
        and rows.is_contiguous()
        and rows.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and (row_probs is None or (row_probs.dtype == torch.float32 and row_probs.is_contiguous()))
    )


def moe_unpermute(
    permuted: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape,
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference ``moe_unpermute`` without the fp32 copy of the rows in autograd (:class:`Unpermute`)."""
    if probs is not None and routing_map is None:
        return reference.moe_unpermute(permuted, sorted_indices, restore_shape, probs, routing_map)
    row_probs = None
    if probs is not None:  # each row's weight, gathered without a host sync
        row_probs = probs.t().reshape(-1).index_select(0, _routed_pairs(routing_map, permuted.shape[0]))
    return Unpermute.apply(permuted, sorted_indices, restore_shape, row_probs)


def moe_topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
):
    """The reference ``moe_topk_routing`` as one Triton kernel each way
    (:mod:`~mcore.backends.cuda.triton_kernels.moe_router`) for fp32 logits on the kernel device with
    at most 512 experts and no group-limited routing; the reference otherwise."""
    kwargs = dict(
        score_function=score_function, pre_softmax=pre_softmax, num_groups=num_groups,
        group_topk=group_topk, scaling_factor=scaling_factor, expert_bias=expert_bias,
    )  # fmt: skip
    fits = (
        not tracing()
        and on_kernel_device(logits, expert_bias)
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.is_contiguous()
        and num_groups is None
    )
    if fits:  # Triton is there (on_kernel_device): the kernel module imports
        from .triton_kernels import moe_router

        fits = logits.shape[1] <= moe_router.MAX_EXPERTS
    if not fits:
        return reference.moe_topk_routing(logits, topk, **kwargs)
    check_routing_args(logits, topk, score_function, num_groups, group_topk, expert_bias)
    return moe_router.topk_routing(logits, topk, score_function, pre_softmax, scaling_factor, expert_bias)


MOE_OPS = {
    "grouped_gemm": grouped_gemm,
    "moe_permute": moe_permute,
    "moe_unpermute": moe_unpermute,
    "moe_topk_routing": moe_topk_routing,
}
MOE_PROVIDERS = {
    "moe_topk_routing": "triton",
    "grouped_gemm": "torch-grouped-mm",
    "moe_permute": "torch-sort",
    "moe_unpermute": "torch-index",
}
