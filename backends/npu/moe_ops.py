"""The NPU backend's MoE ops: torch_npu's TRAINING kernels behind the op table, each in an
autograd.Function whose backward calls the kernel's documented gradient op.

========================  ===========================================================================
op                        conversion
========================  ===========================================================================
``grouped_gemm``          ``npu_grouped_matmul([x], [W^T], group_list=counts, split_item=3,
                          group_type=0, group_list_type=1)`` (the op's weight is ``[E, K, N]``, in x
                          out: mcore's ``[E, M, K]`` transposed, a view, as MindSpeed's GMM passes
                          its weights); input gradient the same with
                          ``[W]``; weight gradient ``npu_grouped_matmul([dy^T], [x], group_type=2)``
                          (groups along the reduced axis) -> ``[E, M, K]``, an empty expert's block
                          zeroed explicitly. bf16/fp16 only (fp32 and ``N = 0`` run the reference).
``scaled_grouped_gemm``   ``npu_grouped_matmul([a_q], [b_q^T], scale=[b_scale_inv], per_token_scale=
                          [a_scale_inv], group_list=counts, split_item=3, group_type=0,
                          group_list_type=1, output_dtype=bf16|fp16)``: the documented per-token
                          quantized form, int8 operands (scale bf16 for a bf16 output, fp32 for
                          fp16). torch_npu documents no FP8 operands for this op (Atlas A2/A3:
                          fp16, bf16, fp32, int8), so FP8 operands run the reference, and the weight
                          gradient (``scaled_grouped_gemm_wgrad``: groups along K, which the
                          quantized form does not take) too. The NPU backend claims neither ``fp8``
                          nor ``fp8_grouped_gemm``: FP8 training is refused there.
``moe_permute``           ``npu_moe_token_permute_with_routing_map`` (+ ``_grad``). Its
                          ``sorted_indices`` (int32) is the ARGSORT of mcore's: token-major pair
                          ``i`` -> its permuted row; mcore's (row -> token) is scattered from it.
``moe_unpermute``         ``_npu_moe_token_unpermute_with_routing_map`` (+
                          ``npu_moe_token_unpermute_with_routing_map_grad``), the NPU's indices
                          rebuilt from mcore's by a stable argsort (rows of one token are in expert
                          order, so token-major order is a stable sort by token).
========================  ===========================================================================

The permute kernels (without ``drop_and_pad``) assume every routing-map row routes the same number
``topK < 512`` of experts: the router's map does (the all-to-all dispatcher's permute), a map cut to
this rank's experts (the all-gather dispatcher) generally does not, and then, like a rank with no
token, the reference serves the call. Checking it costs one host sync, as the reference's
``masked_select`` does.

The router (``moe_topk_routing``) stays the reference on NPU: torch_npu's routing kernels
(``npu_moe_gating_top_k_softmax``, ``npu_moe_gating_top_k``, ``npu_moe_init_routing*``,
``npu_moe_finalize_routing``) are documented for inference only (no backward, fixed expert counts).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from mcore.ops import reference

GEMM_DTYPES = (torch.bfloat16, torch.float16)
PERMUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TOPK = 512
MAX_LAST_DIM = 65536
PER_TOKEN_SCALE_DTYPE = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}
"""``npu_grouped_matmul``'s per-token quantized form: the weight scales' dtype for each output dtype
(torch_npu's table: scale bf16 -> y bf16, scale fp32 -> y fp16)."""


def _uniform_topk(routing_map: torch.Tensor) -> int | None:
    """The experts per row when every row routes the same number ``0 < k < 512``, else None."""
    if (
        routing_map.dim() != 2
        or routing_map.shape[0] == 0
        or routing_map.dtype not in (torch.bool, torch.int8)
    ):
        return None
    per_row = routing_map.bool().sum(dim=1)
    k = int(per_row[0])
    return k if 0 < k < MAX_TOPK and bool((per_row == k).all()) else None


def _grouped_gemm_ops(torch_npu: ModuleType) -> dict[str, Callable]:
    def gmm(a: torch.Tensor, b: torch.Tensor, group_list: torch.Tensor, group_type: int) -> torch.Tensor:
        return torch_npu.npu_grouped_matmul(
            [a], [b], group_list=group_list, split_item=3, group_type=group_type, group_list_type=1
        )[0]

    class GroupedMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, tokens_per_expert):
            group_list = tokens_per_expert.to(x.device, torch.int64)
            ctx.save_for_backward(x, weight, group_list)
            return gmm(x, weight.transpose(1, 2), group_list, 0)

        @staticmethod
        def backward(ctx, dy):
            x, weight, group_list = ctx.saved_tensors
            dy = dy.contiguous()
            dx = gmm(dy, weight, group_list, 0) if ctx.needs_input_grad[0] else None
            dw = None
            if ctx.needs_input_grad[1]:
                dw = gmm(dy.t(), x, group_list, 2).masked_fill((group_list == 0)[:, None, None], 0)
            return dx, dw, None

    def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Reference ``grouped_gemm`` through ``npu_grouped_matmul`` (bf16/fp16, at least one row)."""
        if (
            x.dtype not in GEMM_DTYPES
            or weight.dtype != x.dtype
            or x.dim() != 2
            or weight.dim() != 3
            or x.shape[0] == 0
            or x.shape[1] != weight.shape[2]
            or max(x.shape[1], weight.shape[1]) >= MAX_LAST_DIM
            or tokens_per_expert.shape != (weight.shape[0],)
        ):
            return reference.grouped_gemm(x, weight, tokens_per_expert)
        return GroupedMatmul.apply(x.contiguous(), weight, tokens_per_expert)

    def scaled_grouped_gemm(a_q, b_q, a_scale_inv, b_scale_inv, tokens_per_expert, out_dtype):
        """Reference ``scaled_grouped_gemm`` through ``npu_grouped_matmul``'s per-token quantized form
        (int8 operands, bf16/fp16 output, at least one row); FP8 operands run the reference."""
        if (
            a_q.dtype != torch.int8
            or b_q.dtype != torch.int8
            or out_dtype not in PER_TOKEN_SCALE_DTYPE
            or a_q.dim() != 2
            or b_q.dim() != 3
            or a_q.shape[0] == 0
            or a_q.shape[1] != b_q.shape[2]
            or max(a_q.shape[1], b_q.shape[1]) >= MAX_LAST_DIM
            or tokens_per_expert.shape != (b_q.shape[0],)
        ):
            return reference.scaled_grouped_gemm(
                a_q, b_q, a_scale_inv, b_scale_inv, tokens_per_expert, out_dtype
            )
        return torch_npu.npu_grouped_matmul(
            [a_q.contiguous()],
            [b_q.transpose(1, 2)],
            scale=[b_scale_inv.to(PER_TOKEN_SCALE_DTYPE[out_dtype])],
            per_token_scale=[a_scale_inv.float()],
            group_list=tokens_per_expert.to(a_q.device, torch.int64),
            split_item=3,
            group_type=0,
            group_list_type=1,
            output_dtype=out_dtype,
        )[0]

    return {"grouped_gemm": grouped_gemm, "scaled_grouped_gemm": scaled_grouped_gemm}


def _permute_ops(torch_npu: ModuleType) -> dict[str, Callable]:
    class Permute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tokens, probs, routing_map, k):
            permuted, permuted_probs, npu_indices = torch_npu.npu_moe_token_permute_with_routing_map(
                tokens, routing_map, probs=probs, num_out_tokens=k * tokens.shape[0], drop_and_pad=False
            )
            n = npu_indices.numel()
            token_of_pair = torch.arange(n, device=tokens.device) // k
            sorted_indices = torch.empty_like(token_of_pair).scatter_(0, npu_indices.long(), token_of_pair)
            ctx.save_for_backward(npu_indices, routing_map)
            ctx.has_probs = probs is not None
            ctx.mark_non_differentiable(sorted_indices)
            return permuted, permuted_probs, sorted_indices

        @staticmethod
        def backward(ctx, d_permuted, d_permuted_probs, _):
            npu_indices, routing_map = ctx.saved_tensors
            d_tokens, d_probs = torch_npu.npu_moe_token_permute_with_routing_map_grad(
                d_permuted.contiguous(),
                d_permuted_probs if ctx.has_probs else None,
                npu_indices,
                routing_map,
                routing_map.shape[1],
                routing_map.shape[0],
                False,
            )
            return d_tokens, (d_probs if ctx.has_probs else None), None, None

    def moe_permute(tokens, routing_map, probs=None, num_out_tokens=None):
        """Reference ``moe_permute`` through ``npu_moe_token_permute_with_routing_map`` (a routing map
        with the same experts per row)."""
        k = _uniform_topk(routing_map) if tokens.dim() == 2 and tokens.dtype in PERMUTE_DTYPES else None
        if k is None or routing_map.shape[0] != tokens.shape[0]:
            return reference.moe_permute(tokens, routing_map, probs, num_out_tokens)
        if num_out_tokens is not None and num_out_tokens != k * tokens.shape[0]:
            raise ValueError(
                f"moe_permute: num_out_tokens={num_out_tokens} but the routing map routes {k * tokens.shape[0]}"
            )
        permuted, permuted_probs, sorted_indices = Permute.apply(tokens.contiguous(), probs, routing_map, k)
        return permuted, (permuted_probs if probs is not None else None), sorted_indices

    return {"moe_permute": moe_permute}


def _unpermute_ops(torch_npu: ModuleType) -> dict[str, Callable]:
    class Unpermute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, permuted, probs, npu_indices, restore_shape, routing_map):
            out = torch_npu._npu_moe_token_unpermute_with_routing_map(
                permuted,
                npu_indices,
                list(restore_shape),
                probs=probs,
                routing_map=routing_map,
                drop_and_pad=False,
            )[0]
            ctx.save_for_backward(permuted if probs is not None else None, probs, npu_indices, routing_map)
            ctx.restore_shape = list(restore_shape)
            return out

        @staticmethod
        def backward(ctx, d_out):
            permuted, probs, npu_indices, routing_map = ctx.saved_tensors
            d_permuted, d_probs = torch_npu.npu_moe_token_unpermute_with_routing_map_grad(
                d_out.contiguous(),
                npu_indices,
                npu_indices,
                routing_map=routing_map,
                permuted_tokens=permuted,
                probs=probs,
                drop_and_pad=False,
                restore_shape=ctx.restore_shape,
            )
            return d_permuted, (d_probs if probs is not None else None), None, None, None

    def moe_unpermute(permuted, sorted_indices, restore_shape, probs=None, routing_map=None):
        """Reference ``moe_unpermute`` through ``_npu_moe_token_unpermute_with_routing_map`` (needs the
        routing map, with the same experts per row)."""
        k = (
            None
            if routing_map is None or permuted.dtype not in PERMUTE_DTYPES
            else _uniform_topk(routing_map)
        )
        if k is None or permuted.dim() != 2 or permuted.shape[0] != k * routing_map.shape[0]:
            return reference.moe_unpermute(permuted, sorted_indices, restore_shape, probs, routing_map)
        npu_indices = torch.sort(sorted_indices, stable=True).indices.to(torch.int32)
        return Unpermute.apply(permuted.contiguous(), probs, npu_indices, tuple(restore_shape), routing_map)

    return {"moe_unpermute": moe_unpermute}


MOE_BUILDERS: tuple[tuple[str, Callable[[ModuleType], dict[str, Callable]]], ...] = (
    ("npu_grouped_matmul", _grouped_gemm_ops),
    ("npu_moe_token_permute_with_routing_map", _permute_ops),
    ("_npu_moe_token_unpermute_with_routing_map", _unpermute_ops),
)
"""The torch_npu kernel each MoE adapter needs (its ``_grad`` op comes with it), and its builder."""
