"""``--fp8-param-gather``: the distributed optimizer all-gathers the FP8 linears' weights in FP8.

Without it, the distributed optimizer all-gathers every updated bf16 parameter shard (2 bytes per
element) and each FP8 linear casts its bf16 weight to FP8 in every forward. With it, the weights of
the FP8 linears (tensorwise and delayed recipes) live in a DDP buffer of their own, and after each
optimizer step::

    each dp rank r:  W_r (its updated shard of W, in the parameter dtype)
    tensorwise:      amax  = max over dp x tp ranks of max |W_r|       (one all-reduce per buffer)
                     scale = fp8_max / amax / 2^margin                  (every rank: the same scale)
    delayed:         scale = the layer state's WEIGHT scale (replicated); the global amax goes into
                     the state's pending WEIGHT amax, for the next scale update
    q_r = saturate(W_r * scale) in e4m3                                 (this rank's shard, in FP8)
    all-gather q_r over dp, per bucket                                  (1 byte per element)
    W_q = the gathered [N, K] bytes, scale_inv = 1 / scale   -> the layer's forward GEMM operand;
                                                                 its backward transposes W_q

Where the scale is known before the step (every weight of the buffer on the delayed recipe), the
flat optimizer step writes ``q_r`` and ``max |W_r|`` itself (op ``adam_step_flat_fp8``, from the
parameters it has just written: ~1 byte per weight element instead of the separate quantization's
~7) and :meth:`Fp8ParamGather.finish_fused_quantization` does the rest (the amax all-reduce, the
recorded amaxes, ``scale_inv``); otherwise (tensorwise, whose scale needs the new weights' amax, or
the per-parameter optimizer) :meth:`Fp8ParamGather.quantize_shards` quantizes after the step: one
multi-tensor amax of this rank's pieces (``torch._foreach_norm``), the all-reduce, the scales, then
op ``fp8_quantize_flat`` writes every piece's bytes straight into the gathered buffer in one launch
(~5 bytes per weight element: the amax reads 2, the quantization reads 2 and writes 1). That is a
handful of launches per buffer whatever the number of weights, where a quantize and a copy per weight
(~200 launches a step for the 96 FP8 weights of a 24-layer model) kept the host busy and the GPU
idle. Both paths end in the same code (:meth:`Fp8ParamGather._settle_scales`). After each bucket's
gather (DP > 1), op ``fp8_dequantize_flat`` writes ``W_q * scale_inv`` over the parts of the bucket's
weights other ranks own, one launch per bucket instead of a multiply and a copy per weight and part.

The scale depends only on the whole weight, so every rank quantizes its shard exactly as one process
quantizes the whole weight, and ``W_q`` is bit for bit the cast the FP8 linear would have made of the
same parameter in its forward (which reads the parameter in its own dtype, as this quantization does).

The parameter in its own dtype (bf16) stays, unlike Megatron (whose compute parameter is FP8 only,
a Transformer Engine ``Float8Tensor``): it is the autograd leaf that receives the weight gradient
(gradient buckets, hooks and the optimizer are unchanged), and checkpoints, ``state_dict``, HF
export and the parameter norm read it. Cost: the 1-byte gather buffer beside the 2-byte parameter
(+50% of the FP8 weights' parameter memory, where Megatron saves 50%). Its value: on this rank's
shard, the optimizer's rounding of the fp32 master (what is quantized); elsewhere, after each
gather, ``W_q * scale_inv`` rounded to the parameter dtype (the weight the forward computes with).
A checkpoint save first all-gathers the parameters in their own dtype
(:meth:`Fp8ParamGather.gather_full_precision`), so checkpoints hold exactly the weights a run
without the flag holds; the optimizer state (fp32 masters, moments) is unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from mcore.backend import get_ops
from mcore.fp8.config import Recipe
from mcore.fp8.operand import Fp8Tensor
from mcore.fp8.scaling import WEIGHT, scale_from_amax
from mcore.ops.flat import FlatFp8Weights
from mcore.tensor_parallel.mappings import (
    _all_gather_single,
    all_reduce_in_tensor_model_parallel_group,
    group_size,
)

logger = logging.getLogger(__name__)

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
"""Weights are quantized in the forward format, e4m3 for both ``--fp8-format e4m3`` and ``hybrid``."""

SCALE_STRIDE = 4
"""fp32 words between two weights' ``scale_inv``: 16 bytes, the alignment cuBLASLt's FP8 GEMMs need of
a scale pointer (``torch._scaled_mm`` fails with CUBLAS_STATUS_NOT_SUPPORTED otherwise)."""


def fp8_gathered_layers(module: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """``{id(weight): layer}`` of the FP8 linears of ``module`` whose weight is gathered in FP8: an
    own trainable weight and the tensorwise or delayed recipe (the layers' ``_fp8_call``)."""
    out = {}
    for layer in module.modules():
        call = getattr(layer, "_fp8_call", None)
        weight = getattr(layer, "weight", None)
        if call is None or not isinstance(weight, torch.nn.Parameter) or not weight.requires_grad:
            continue
        if not call.config.recipe.per_tensor:
            raise ValueError(
                f"--fp8-param-gather: {type(layer).__name__} uses --fp8-recipe {call.config.fp8_recipe}; "
                "use tensorwise or delayed"
            )
        out[id(weight)] = layer
    return out


class Fp8ParamGather:
    """The FP8 copy of one DDP buffer whose parameters are all FP8 linears' weights.

    Args:
        buffer: the :class:`~mcore.distributed.grad_buffer.GradBuffer` (distributed optimizer: its
            ``param_data`` holds the parameters; its buckets are what :meth:`bucket_bytes` and
            :meth:`after_gather` get). The buffer holds this object (``buffer.fp8_gather``), so this
            module only reads it and imports nothing of :mod:`mcore.distributed`, which sits above.
        layers: the layer of each parameter of ``buffer``, in ``buffer.params`` order.
        tp_group: the tensor-parallel group (a TP-split weight's amax is reduced over it too).

    ``data [numel]`` (e4m3, laid out like ``param_data``) is what the buckets all-gather (as bytes);
    each layer gets ``layer.fp8_gathered_weight``, a view of its weight in it and its ``scale_inv``.
    ``scale_inv [W, 4]`` fp32 holds weight ``i``'s ``1 / scale`` at ``[i, 0]``: a 16-byte stride,
    because cuBLASLt refuses FP8 GEMM scale pointers that are not 16-byte aligned (a ``[W]`` tensor's
    views were misaligned for 3 weights of 4).
    """

    def __init__(self, buffer, layers: Sequence[torch.nn.Module], tp_group):
        if buffer.param_data is None:
            raise ValueError(
                "--fp8-param-gather needs the parameters in the DDP buffer (distributed optimizer)"
            )
        self.buffer = buffer
        self.layers = list(layers)
        self.tp_group = tp_group
        device = buffer.param_data.device
        self.data = torch.zeros(buffer.numel, dtype=FP8_WEIGHT_DTYPE, device=device)
        self.scale_inv = torch.ones(len(self.layers), SCALE_STRIDE, dtype=torch.float32, device=device)
        self._ranges = [buffer.buffer_range(p) for p in buffer.params]
        self._owned: list[tuple[int, int] | None] = []  # buffer indices of this rank's piece
        for param, (start, _) in zip(buffer.params, self._ranges):
            local = buffer.local_range(param)
            self._owned.append(None if local is None else (start + local[0], start + local[1]))
        for i, (param, layer, (start, end)) in enumerate(zip(buffer.params, self.layers, self._ranges)):
            view = self.data[start:end].view(param.shape)
            layer.fp8_gathered_weight = Fp8Tensor(view, self.scale_inv[i, 0])
        self._delayed = [
            i for i, layer in enumerate(self.layers) if layer._fp8_call.config.recipe is Recipe.DELAYED
        ]
        self.quantizes_in_step = len(self._delayed) == len(self.layers)
        """Every weight on the delayed recipe (scales known before the step): the flat optimizer step
        writes the FP8 copies (``adam_step_flat_fp8``, :meth:`fused_weights`)."""
        self._fp8_ranges = tuple((*owned, i) for i, owned in enumerate(self._owned) if owned is not None)
        self._step_amax = torch.zeros(len(self.layers), dtype=torch.float32, device=device)
        self._quantized = False  # the step's FP8 copies are written (start_param_sync skips quantize_shards)
        self.fused_steps = 0
        """Steps whose FP8 copies the optimizer step wrote (a count for tests and logs)."""
        runs: dict[int, list[tuple[int, int, int]]] = {b.index: [] for b in buffer.buckets}
        for i, (param, (start, end)) in enumerate(zip(buffer.params, self._ranges)):
            lo, hi = self._owned[i] or (start, start)
            runs[buffer.bucket_of(param).index] += [(a, b, i) for a, b in ((start, lo), (hi, end)) if b > a]
        self._gathered_runs = {index: tuple(r) for index, r in runs.items()}
        """Per bucket: the ``(start, end, i)`` runs of its weights outside this rank's pieces, which
        :meth:`after_gather` dequantizes (``fp8_dequantize_flat``) from the gathered bytes."""
        self._scale_inv_column = self.scale_inv[:, 0]  # [W], stride SCALE_STRIDE
        logger.debug(
            "--fp8-param-gather: %d weights, %d bytes all-gathered per step (%d in the parameter dtype)",
            len(self.layers),
            self.data.numel(),
            buffer.param_data.numel() * buffer.param_data.element_size(),
        )

    @torch.no_grad()
    def quantize_shards(self) -> None:
        """Quantize this rank's updated piece of every weight into :attr:`data` with the weight's scale
        (module docstring); one all-reduce (max) of the pieces' amaxes over dp (and one over tp)."""
        ops = get_ops()
        param_data = self.buffer.param_data
        pieces = [None if owned is None else param_data[owned[0] : owned[1]] for owned in self._owned]
        amax = torch.zeros(len(pieces), dtype=torch.float32, device=param_data.device)
        present = [i for i, piece in enumerate(pieces) if piece is not None]
        if present:
            norms = torch._foreach_norm([pieces[i] for i in present], float("inf"))
            amax[present] = torch.stack(norms).float()
        scale = self._settle_scales(amax)
        # every piece in one launch (a quantize and a copy per weight left the GPU idle, host-bound)
        ops.fp8_quantize_flat(param_data, FlatFp8Weights(self.data, self._fp8_ranges, scale, amax))

    def fused_weights(self) -> FlatFp8Weights:
        """What ``adam_step_flat_fp8`` writes for this buffer (:attr:`quantizes_in_step` only): this
        rank's pieces of :attr:`data`, with the weights' delayed scales and an amax it fills."""
        return FlatFp8Weights(self.data, self._fp8_ranges, self._delayed_scales(), self._step_amax)

    @torch.no_grad()
    def finish_fused_quantization(self, fp8: FlatFp8Weights) -> None:
        """After ``adam_step_flat_fp8`` wrote ``fp8`` (:meth:`fused_weights`: this rank's pieces and
        their amaxes): what :meth:`quantize_shards` does after its quantization; :meth:`take_quantized`
        then tells the parameter sync that this step's copies are written."""
        self._settle_scales(fp8.amax, fp8.scales)
        self._quantized = True
        self.fused_steps += 1

    def take_quantized(self) -> bool:
        """Whether the optimizer step wrote the FP8 copies since the last call (then they are not
        quantized again before the gather); resets it."""
        quantized, self._quantized = self._quantized, False
        return quantized

    def _delayed_scales(self) -> torch.Tensor:
        """``[W]`` fp32: every (delayed) weight's WEIGHT scale."""
        return torch.stack([layer.fp8_state.scale[WEIGHT] for layer in self.layers])

    def _settle_scales(self, amax: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """From this rank's pieces' ``amax [W]`` (0 for weights without a piece): max-reduce it over dp
        and tp in place, record it in the delayed layers' pending WEIGHT amax, set :attr:`scale_inv`
        from ``scale`` (the delayed scales the pieces were quantized with) or, when None, from the
        scales this forms; returns the scales ``[W]``."""
        comm = self.buffer.comm
        if comm.active:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=comm.group)
        if group_size(self.tp_group) > 1:
            all_reduce_in_tensor_model_parallel_group(amax, self.tp_group, op="max")
        if self._delayed:
            # this step's W amax, as the forward's cast would have recorded it (the cast of W is
            # skipped there); update_fp8_scales pushes it into the history at the end of the step
            records = [self.layers[i].fp8_state.amax_record(WEIGHT) for i in self._delayed]
            torch._foreach_copy_(records, [amax[i : i + 1] for i in self._delayed])
        if scale is None:
            scale = self._delayed_scales() if self.quantizes_in_step else self._current_scales(amax)
        torch.reciprocal(scale, out=self.scale_inv[:, 0])
        return scale

    def _current_scales(self, amax: torch.Tensor) -> torch.Tensor:
        """``[W]`` fp32: the tensorwise weights' scales from the reduced ``amax``, the delayed ones'
        WEIGHT scales."""
        current: dict[int, torch.Tensor] = {}  # tensorwise scales of all weights, by margin
        scales = []
        for i, layer in enumerate(self.layers):
            fp8 = layer._fp8_call.config
            if fp8.recipe is Recipe.DELAYED:
                scales.append(layer.fp8_state.scale[WEIGHT])
            else:
                if fp8.fp8_margin not in current:
                    current[fp8.fp8_margin] = scale_from_amax(amax, FP8_WEIGHT_DTYPE, fp8.fp8_margin)
                scales.append(current[fp8.fp8_margin][i])
        return torch.stack(scales)

    def bucket_bytes(self, bucket) -> torch.Tensor:
        """What ``bucket`` all-gathers: its range of :attr:`data`, as bytes (collectives move uint8)."""
        return self.data[bucket.start : bucket.end].view(torch.uint8)

    @torch.no_grad()
    def after_gather(self, bucket) -> None:
        """Set the parameters of ``bucket`` outside this rank's pieces to ``W_q * scale_inv`` (rounded
        to the parameter dtype): the weight the forward computes with."""
        runs = self._gathered_runs[bucket.index]
        if runs:
            get_ops().fp8_dequantize_flat(self.buffer.param_data, self.data, self._scale_inv_column, runs)

    @torch.no_grad()
    def gather_full_precision(self) -> None:
        """All-gather the parameters in their own dtype (every rank then holds each one exactly as the
        optimizer rounded it on its owner): before a checkpoint save. Every dp rank calls it."""
        comm = self.buffer.comm
        if not comm.active:
            return
        for bucket in self.buffer.buckets:
            data = bucket.param_data
            size = data.numel() // comm.size
            _all_gather_single(data, data[comm.rank * size : (comm.rank + 1) * size], group=comm.group)
