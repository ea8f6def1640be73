"""SIMULATED torch_npu MoE training ops: the grouped matmul and the routing-map token permute/unpermute
with their gradient ops, computed on the CPU.

Signatures as torch_npu documents them and MindSpeed calls them (``mindspeed/te/pytorch/permutation.py``,
``mindspeed/core/transformer/moe/grouped_matmul_util.py``); semantics as the CANN op documentation
(ops-transformer ``moe/moe_token_permute_with_routing_map``, ``moe_token_unpermute_with_routing_map``)
gives them. Two conventions differ from Megatron's and the simulation keeps them, so the adapters
must convert:

* ``sorted_indices`` (int32) is the ARGSORT of Megatron's: for the ``i``-th routed pair in TOKEN-major
  order (token ``i // topK``, its experts in increasing order) it holds that pair's row in the
  expert-major permuted output (``permuted[sorted_indices[i]] = tokens[i // topK]``);
* without ``drop_and_pad`` every routing-map row must route the same number ``topK < 512`` of experts
  (``topK = num_out_tokens // tokens``), which the kernels assume.

The forward ops return tensors WITHOUT autograd history (the real ones have no backward: callers wrap
them in an autograd.Function with the ``_grad`` ops), so an adapter that forgets its Function fails here.
Only the training forms are simulated: ``drop_and_pad=False``; grouped matmul with one ``x`` and one
``weight`` tensor, ``split_item`` 2/3, ``group_type`` 0 (groups along M) or 2 (along K), no bias;
quantisation in the documented per-token form only (int8 ``x`` and ``weight``, ``scale`` and
``per_token_scale``, ``output_dtype``; groups along M). ``out_index``/``permuted_token_id`` of the unpermute are returned as ``sorted_indices``
(MindSpeed passes ``sorted_indices`` for both when ``drop_and_pad`` is off). UNVERIFIED on hardware:
whether mixed dtypes (fp32 probs with bf16 tokens) are accepted, and the kernels' summation order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TOPK = 512
MAX_LAST_DIM = 65536


def _check_dtype(op: str, name: str, t: torch.Tensor, allowed=FLOAT_DTYPES) -> None:
    if t.dtype not in allowed:
        raise TypeError(
            f"{op}: {name} has dtype {t.dtype}; the NPU kernel takes {', '.join(map(str, allowed))}"
        )


def _topk(op: str, routing_map: torch.Tensor, drop_and_pad: bool) -> int:
    """The fixed number of experts per row the kernels assume (validated)."""
    _check_dtype(op, "routing_map", routing_map, (torch.bool, torch.int8))
    if drop_and_pad:
        raise NotImplementedError(f"{op}: the simulation implements drop_and_pad=False only")
    per_row = routing_map.bool().sum(dim=1)
    k = int(per_row[0]) if per_row.numel() else 0
    if per_row.numel() and not bool((per_row == k).all()) or not 0 < k < MAX_TOPK:
        raise RuntimeError(
            f"{op}: without drop_and_pad every routing_map row must route the same number (< {MAX_TOPK}) "
            f"of experts, got counts {sorted(set(per_row.tolist()))}"
        )
    return k


def _token_major_rows(routing_map: torch.Tensor) -> torch.Tensor:
    """``sorted_indices`` in the NPU's convention: the expert-major row of each token-major pair."""
    rmap = routing_map.bool()
    n = int(rmap.sum())
    row_of = torch.full(rmap.shape[::-1], -1, dtype=torch.int64)  # [E, T]
    row_of[rmap.t()] = torch.arange(n)
    return row_of.t()[rmap].to(torch.int32)  # token-major walk of the [T, E] map


@torch.no_grad()
def npu_moe_token_permute_with_routing_map(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    *,
    probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    drop_and_pad: bool = False,
):
    """``(permuted_tokens [N, H], permuted_probs [N] or None, sorted_indices [N] int32)``."""
    op = "npu_moe_token_permute_with_routing_map"
    _check_dtype(op, "tokens", tokens)
    if tokens.dim() != 2 or routing_map.shape[0] != tokens.shape[0]:
        raise RuntimeError(f"{op}: tokens {tuple(tokens.shape)} and routing_map {tuple(routing_map.shape)}")
    k = _topk(op, routing_map, drop_and_pad)
    n = k * tokens.shape[0]
    if num_out_tokens is not None and num_out_tokens != n:
        raise RuntimeError(f"{op}: num_out_tokens={num_out_tokens}, the routing map routes {n}")
    sorted_indices = _token_major_rows(routing_map)
    permuted = tokens.new_empty(n, tokens.shape[1])
    permuted[sorted_indices.long()] = tokens.repeat_interleave(k, dim=0)
    permuted_probs = None
    if probs is not None:
        _check_dtype(op, "probs", probs)
        permuted_probs = probs.t().masked_select(routing_map.bool().t())
    return permuted, permuted_probs, sorted_indices


@torch.no_grad()
def npu_moe_token_permute_with_routing_map_grad(
    permuted_token_out_grad: torch.Tensor,
    probs_grad: torch.Tensor | None,
    sorted_indices: torch.Tensor,
    routing_map: torch.Tensor,
    experts_num: int,
    tokens_num: int,
    drop_and_pad: bool,
):
    """``(tokens_grad [T, H], probs_grad [T, E] or None)``: each token sums its rows' gradients; each
    routed pair's probability gradient lands at ``[t, e]`` (zeros elsewhere)."""
    op = "npu_moe_token_permute_with_routing_map_grad"
    _check_dtype(op, "sorted_indices", sorted_indices, (torch.int32,))
    k = _topk(op, routing_map, drop_and_pad)
    if routing_map.shape != (tokens_num, experts_num):
        raise RuntimeError(f"{op}: routing_map {tuple(routing_map.shape)}, not ({tokens_num}, {experts_num})")
    rows = permuted_token_out_grad.float()[sorted_indices.long()]  # token-major
    tokens_grad = rows.view(tokens_num, k, -1).sum(1).to(permuted_token_out_grad.dtype)
    out_probs_grad = None
    if probs_grad is not None:
        out_probs_grad = probs_grad.new_zeros(experts_num, tokens_num)
        out_probs_grad[routing_map.bool().t()] = probs_grad
        out_probs_grad = out_probs_grad.t().contiguous()
    return tokens_grad, out_probs_grad


def _unpermute_args(op, permuted_tokens, sorted_indices, routing_map, drop_and_pad) -> int:
    _check_dtype(op, "permuted_tokens", permuted_tokens)
    _check_dtype(op, "sorted_indices", sorted_indices, (torch.int32,))
    if routing_map is None:
        raise RuntimeError(f"{op}: routing_map gives topK_num without drop_and_pad; it is required")
    k = _topk(op, routing_map, drop_and_pad)
    if (
        permuted_tokens.shape[0] != k * routing_map.shape[0]
        or sorted_indices.shape != permuted_tokens.shape[:1]
    ):
        raise RuntimeError(
            f"{op}: {permuted_tokens.shape[0]} permuted rows and {sorted_indices.numel()} indices for "
            f"{routing_map.shape[0]} tokens x topK {k}"
        )
    return k


@torch.no_grad()
def _npu_moe_token_unpermute_with_routing_map(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: Sequence[int],
    *,
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
    drop_and_pad: bool = False,
):
    """``(unpermuted_tokens, out_index, permuted_token_id, permute_probs)``:
    ``out[i // topK] += permuted_tokens[sorted_indices[i]] * permuted_probs[sorted_indices[i]]``
    (summed in fp32 here; the kernel's order is unverified), ``permute_probs = probs.T[routing_map.T]``."""
    op = "_npu_moe_token_unpermute_with_routing_map"
    k = _unpermute_args(op, permuted_tokens, sorted_indices, routing_map, drop_and_pad)
    rows = permuted_tokens.float()
    permute_probs = permuted_tokens.new_empty(0)
    if probs is not None:
        _check_dtype(op, "probs", probs)
        permute_probs = probs.t().masked_select(routing_map.bool().t())
        rows = rows * permute_probs.float()[:, None]
    out = rows[sorted_indices.long()].view(routing_map.shape[0], k, -1).sum(1)
    return (
        out.to(permuted_tokens.dtype).view(tuple(restore_shape)),
        sorted_indices,
        sorted_indices,
        permute_probs,
    )


@torch.no_grad()
def npu_moe_token_unpermute_with_routing_map_grad(
    unpermuted_tokens_grad: torch.Tensor,
    out_index: torch.Tensor,
    permuted_token_id: torch.Tensor,
    routing_map: torch.Tensor | None = None,
    permuted_tokens: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    drop_and_pad: bool = False,
    restore_shape: Sequence[int] | None = None,
):
    """``(permuted_tokens_grad [N, H], probs_grad [T, E] or None)``: each row gets its token's gradient
    times its probability; ``probs_grad[t, e] = <grad[t], permuted_tokens[row of (t, e)]>``."""
    op = "npu_moe_token_unpermute_with_routing_map_grad"
    _check_dtype(op, "unpermuted_tokens_grad", unpermuted_tokens_grad)
    if (probs is None) != (permuted_tokens is None):
        raise RuntimeError(
            f"{op}: probs and permuted_tokens are given together (the probs' gradient needs both)"
        )
    n = out_index.numel()
    rows_like = unpermuted_tokens_grad.new_empty(n, unpermuted_tokens_grad.shape[-1])
    k = _unpermute_args(
        op, rows_like if permuted_tokens is None else permuted_tokens, out_index, routing_map, False
    )
    if drop_and_pad:
        raise NotImplementedError(f"{op}: the simulation implements drop_and_pad=False only")
    grad = unpermuted_tokens_grad.reshape(routing_map.shape[0], -1).float()
    index = out_index.long()
    row_grad = torch.empty(n, grad.shape[1])
    row_grad[index] = grad.repeat_interleave(k, dim=0)  # token-major pair i -> its row
    probs_grad = None
    if probs is not None:
        row_probs = probs.t().masked_select(routing_map.bool().t()).float()
        per_row = (row_grad * permuted_tokens.float()).sum(-1)
        probs_grad = probs.new_zeros(probs.shape[1], probs.shape[0])
        probs_grad[routing_map.bool().t()] = per_row.to(probs.dtype)
        probs_grad = probs_grad.t().contiguous()
        row_grad = row_grad * row_probs[:, None]
    return row_grad.to(unpermuted_tokens_grad.dtype), probs_grad


def _group_counts(op: str, group_list, group_list_type: int, groups: int, total: int) -> list[int]:
    if not isinstance(group_list, torch.Tensor) or group_list.dtype != torch.int64 or group_list.dim() != 1:
        raise TypeError(f"{op}: group_list must be a 1-D int64 tensor, got {group_list!r}")
    if group_list.numel() != groups:
        raise RuntimeError(f"{op}: group_list has {group_list.numel()} groups, weight {groups}")
    values = group_list.tolist()
    if group_list_type == 1:
        counts = values
    elif group_list_type == 0:
        counts = [b - a for a, b in zip([0, *values[:-1]], values)]
    else:
        raise RuntimeError(f"{op}: group_list_type={group_list_type} is not 0 (cumsum) or 1 (counts)")
    if min(counts, default=0) < 0 or sum(counts) != total:
        raise RuntimeError(f"{op}: group sizes {counts} must be >= 0 and sum to the grouped axis {total}")
    return counts


PER_TOKEN_SCALE_OUTPUT = {torch.bfloat16: torch.bfloat16, torch.float32: torch.float16}
"""The documented per-token quantized form's (``scale`` dtype -> ``output_dtype``) pairs (torch_npu's
table, "group_list输入类型为torch.Tensor时", per-token量化: scale bf16 -> y bf16, scale fp32 -> y fp16)."""


def _per_token_quantized(
    x, weight, scale, per_token_scale, group_list, split_item, group_type, group_list_type, output_dtype
):
    """torch_npu's per-token quantized grouped matmul (its formula 3): ``x [M, K]`` int8 rows in groups,
    ``weight [E, K, N]`` int8, ``scale [E, N]`` (one per output channel of each group's weight),
    ``per_token_scale [M]`` fp32 (one per row of ``x``): ``y[m, n] = (x[m] @ weight[g][:, n]) *
    scale[g, n] * per_token_scale[m]`` in ``output_dtype``. The products are exact in int32 (here fp64);
    the scales multiply in fp32. ``group_type`` 0 only (the docs: quantization with groups along M)."""
    op = "npu_grouped_matmul"
    if not all(isinstance(v, list | tuple) and len(v) == 1 for v in (x, weight, scale, per_token_scale)):
        raise TypeError(f"{op}: x, weight, scale and per_token_scale are lists of one tensor each")
    (a,), (b,), (s,), (t,) = x, weight, scale, per_token_scale
    if group_type != 0 or split_item not in (2, 3):
        raise NotImplementedError(
            f"{op}: quantization takes group_type 0 (got {group_type}) and split_item 2/3"
        )
    _check_dtype(op, "x", a, (torch.int8,))
    _check_dtype(op, "weight", b, (torch.int8,))
    _check_dtype(op, "per_token_scale", t, (torch.float32,))
    if PER_TOKEN_SCALE_OUTPUT.get(s.dtype) != output_dtype:
        raise TypeError(
            f"{op}: per-token quantization takes scale bf16 with output_dtype bf16, or scale fp32 with "
            f"output_dtype fp16; got scale {s.dtype}, output_dtype {output_dtype}"
        )
    if a.dim() != 2 or b.dim() != 3 or b.shape[1] != a.shape[1]:
        raise RuntimeError(
            f"{op}: group_type=0 takes x [M, K] and weight [E, K, N], got {a.shape}, {b.shape}"
        )
    if s.shape != (b.shape[0], b.shape[2]) or t.shape != (a.shape[0],):
        raise RuntimeError(
            f"{op}: scale {tuple(s.shape)} must be [E, N] = {(b.shape[0], b.shape[2])} and per_token_scale "
            f"{tuple(t.shape)} [M] = {(a.shape[0],)}"
        )
    for name, v in (("x", a), ("weight", b)):
        if v.shape[-1] >= MAX_LAST_DIM:
            raise RuntimeError(f"{op}: {name}'s last dim {v.shape[-1]} must be < {MAX_LAST_DIM}")
    counts = _group_counts(op, group_list, group_list_type, b.shape[0], a.shape[0])
    pieces = torch.split(a.double(), counts)
    out = torch.cat(
        [(p @ b[g].double()).float() * s[g].float() for g, p in enumerate(pieces)]
    ) if counts else torch.zeros(0, b.shape[2])  # fmt: skip
    return [(out * t[:, None]).to(output_dtype)]


@torch.no_grad()
def npu_grouped_matmul(
    x: Sequence[torch.Tensor],
    weight: Sequence[torch.Tensor],
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item: int = 0,
    group_type: int = -1,
    group_list_type: int = 0,
    act_type: int = 0,
    output_dtype=None,
    tuning_config=None,
) -> list[torch.Tensor]:
    """The training forms: ``group_type=0``: ``x [M, K]`` rows in groups, ``weight [E, K, N]``,
    ``y[rows of g] = x[rows of g] @ weight[g]`` -> ``[y [M, N]]``; ``group_type=2``: ``x [K, M]`` and
    ``weight [M, N]`` grouped along ``M`` -> ``[y [E, K, N]]``, ``y[g] = x[:, cols of g] @ weight[rows of g]``
    (an empty group gives zeros). With ``scale`` and ``per_token_scale``: the documented per-token
    quantized form (:func:`_per_token_quantized`)."""
    op = "npu_grouped_matmul"
    if scale is not None or per_token_scale is not None:
        others = dict(
            bias=bias, offset=offset, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
            activation_input=activation_input, activation_quant_scale=activation_quant_scale,
            activation_quant_offset=activation_quant_offset,
        )  # fmt: skip
        given = [name for name, value in others.items() if value is not None]
        if given or act_type != 0:
            raise NotImplementedError(f"{op}: the simulated quantized form takes no {given or 'act_type'}")
        return _per_token_quantized(
            x,
            weight,
            scale,
            per_token_scale,
            group_list,
            split_item,
            group_type,
            group_list_type,
            output_dtype,
        )
    unsupported = dict(
        bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
        per_token_scale=per_token_scale, activation_input=activation_input,
        activation_quant_scale=activation_quant_scale, activation_quant_offset=activation_quant_offset,
        output_dtype=output_dtype,
    )  # fmt: skip
    given = [name for name, value in unsupported.items() if value is not None]
    if given or act_type != 0:
        raise NotImplementedError(
            f"{op}: the simulation implements no bias/quantisation/activation, got {given}"
        )
    if not isinstance(x, list | tuple) or not isinstance(weight, list | tuple):
        raise TypeError(f"{op}: x and weight are lists of tensors")
    if len(x) != 1 or len(weight) != 1 or split_item not in (2, 3):
        raise NotImplementedError(f"{op}: the simulation implements one x, one weight, split_item 2 or 3")
    (a,), (b,) = x, weight
    for name, t in (("x", a), ("weight", b)):
        _check_dtype(op, name, t)
        if t.shape[-1] >= MAX_LAST_DIM:
            raise RuntimeError(f"{op}: {name}'s last dim {t.shape[-1]} must be < {MAX_LAST_DIM}")
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: x {a.dtype} and weight {b.dtype} must share a dtype")
    if group_type == 0:
        if a.dim() != 2 or b.dim() != 3 or b.shape[1] != a.shape[1]:
            raise RuntimeError(
                f"{op}: group_type=0 takes x [M, K] and weight [E, K, N], got {a.shape}, {b.shape}"
            )
        counts = _group_counts(op, group_list, group_list_type, b.shape[0], a.shape[0])
        pieces = torch.split(a.float(), counts)
        out = (
            torch.cat([p @ b[g].float() for g, p in enumerate(pieces)])
            if counts
            else a.new_empty(0, b.shape[2])
        )
        return [out.to(a.dtype)]
    if group_type == 2:
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
            raise RuntimeError(
                f"{op}: group_type=2 takes x [K, M] and weight [M, N], got {a.shape}, {b.shape}"
            )
        counts = _group_counts(op, group_list, group_list_type, group_list.numel(), a.shape[1])
        xs, ws = torch.split(a.float(), counts, dim=1), torch.split(b.float(), counts)
        return [torch.stack([p @ q for p, q in zip(xs, ws)]).to(a.dtype)]
    raise NotImplementedError(f"{op}: group_type={group_type}: the simulation implements 0 and 2")


__all__ = [
    "_npu_moe_token_unpermute_with_routing_map",
    "npu_grouped_matmul",
    "npu_moe_token_permute_with_routing_map",
    "npu_moe_token_permute_with_routing_map_grad",
    "npu_moe_token_unpermute_with_routing_map_grad",
]
