"""The ops ``fp8_quantize_flat`` and ``fp8_dequantize_flat`` (reference) in ``Fp8ParamGather``.

``--fp8-param-gather`` used to quantize this rank's piece of each FP8 weight with one ``fp8_quantize``
and one ``copy_`` per weight (tensorwise recipe), and to dequantize the gathered parts of a bucket's
weights with one multiply and one ``copy_`` per weight and run. :meth:`Fp8ParamGather.quantize_shards`
and :meth:`Fp8ParamGather.after_gather` now make one op call each; the bytes and parameters they write
must be bit for bit those of the per-weight code (kept below as ``_old_*``), for bf16 and fp32
parameters, on every rank of a DP=4 layout (simulated in one process: the ``CommSpec`` of rank ``r``
without a process group, so no collective runs), where pieces start and end anywhere inside 16-element
blocks, a weight has no piece on most ranks, and a rank of a one-weight buffer has no piece at all.
The Triton kernels' check against the same per-weight code is ``test_fp8_flat_interpret.py``.
"""

from __future__ import annotations

import pytest
import torch

from mcore.distributed.grad_buffer import CommSpec, GradBuffer
from mcore.fp8.param_gather import FP8_WEIGHT_DTYPE, Fp8ParamGather
from mcore.ops import reference
from mcore.ops.flat import FlatFp8Weights

DP = 4
SHAPES = [(16, 23), (8, 21), (40, 33), (4, 5), (24, 51)]
"""368 + 168 + 1320 + 20 + 1224 elements: with buckets of >= 1500 elements padded to 128 and cut
into 4 shards, the pieces start and end inside 16-element blocks; (4, 5) lies in one shard."""


def _gather(dtype: torch.dtype, rank: int, shapes=SHAPES, bucket_size: int | None = 1500):
    """An ``Fp8ParamGather`` over FP8 tensorwise linears of ``shapes`` as DP rank ``rank`` of ``DP``."""
    from mcore.fp8.config import Fp8Config
    from mcore.tensor_parallel.layers import ColumnParallelLinear

    torch.manual_seed(0)
    fp8 = Fp8Config(fp8_format="hybrid", fp8_recipe="tensorwise")
    layers = [ColumnParallelLinear(k, n, bias=False, fp8=fp8, params_dtype=dtype) for n, k in shapes]
    with torch.no_grad():
        for i, layer in enumerate(layers):  # different magnitudes per weight: different scales
            layer.weight.copy_(torch.randn(layer.weight.shape) * (0.02 * 4**i))
        layers[0].weight[0, :3] = 0.0  # exact zeros quantize to zero bytes
    comm = CommSpec(None, DP, rank, average_in_collective=False, use_distributed_optimizer=True)
    buffer = GradBuffer([layer.weight for layer in layers], dtype, torch.float32, bucket_size, comm)
    return Fp8ParamGather(buffer, layers, tp_group=None)


def _old_quantize_shards(gather: Fp8ParamGather) -> None:
    """``quantize_shards`` before the op: one quantize and one copy per weight."""
    param_data = gather.buffer.param_data
    pieces = [None if owned is None else param_data[owned[0] : owned[1]] for owned in gather._owned]
    amax = torch.zeros(len(pieces), dtype=torch.float32)
    present = [i for i, piece in enumerate(pieces) if piece is not None]
    if present:
        norms = torch._foreach_norm([pieces[i] for i in present], float("inf"))
        amax[present] = torch.stack(norms).float()
    scale = gather._settle_scales(amax)
    for i in present:
        lo, hi = gather._owned[i]
        gather.data[lo:hi].copy_(reference.fp8_quantize(pieces[i], scale[i], FP8_WEIGHT_DTYPE))


def _old_after_gather(gather: Fp8ParamGather, bucket) -> None:
    """``after_gather`` before the op: one multiply and one copy per weight and run."""
    param_data = gather.buffer.param_data
    for i, param in enumerate(gather.buffer.params):
        if gather.buffer.bucket_of(param) is not bucket:
            continue
        start, end = gather._ranges[i]
        lo, hi = gather._owned[i] or (start, start)
        for a, b in ((start, lo), (hi, end)):
            if b > a:
                param_data[a:b].copy_(gather.data[a:b].float() * gather.scale_inv[i, 0])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    )


def test_the_layout_has_the_cases():
    """Two buckets; on every rank a weight without a piece; pieces and gathered runs that start or
    end inside 16-element blocks (the kernels' tiles are aligned to them)."""
    starts_inside = ends_inside = 0
    for rank in range(DP):
        gather = _gather(torch.bfloat16, rank)
        assert len(gather.buffer.buckets) == 2
        assert any(owned is None for owned in gather._owned)
        runs = [*gather._fp8_ranges, *(r for b in gather._gathered_runs.values() for r in b)]
        starts_inside += sum(start % 16 != 0 for start, _, _ in runs)
        ends_inside += sum(end % 16 != 0 for _, end, _ in runs)
    assert starts_inside > 2 and ends_inside > 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rank", range(DP))
def test_quantize_shards_writes_the_per_weight_bytes(dtype, rank):
    gather = _gather(dtype, rank)
    sentinel = torch.full_like(gather.data.view(torch.uint8), 0x5A)
    gather.data.view(torch.uint8).copy_(sentinel)
    gather.quantize_shards()
    got, got_scale_inv = gather.data.clone(), gather.scale_inv.clone()
    gather.data.view(torch.uint8).copy_(sentinel)
    _old_quantize_shards(gather)
    assert torch.equal(_bytes(got), _bytes(gather.data))
    assert torch.equal(got_scale_inv, gather.scale_inv)
    assert (got.view(torch.uint8) != 0x5A).sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rank", range(DP))
def test_after_gather_writes_the_per_weight_parameters(dtype, rank):
    gather = _gather(dtype, rank)
    gather.quantize_shards()  # the scales
    gen = torch.Generator().manual_seed(rank)
    gathered = torch.randint(0, 256, gather.data.shape, generator=gen, dtype=torch.uint8)
    gathered[(gathered & 0x7F) == 0x7F] = 0x11  # no NaN bytes (the interpreter test covers them)
    gather.data.view(torch.uint8).copy_(gathered)  # as if the other ranks' bytes arrived
    before = gather.buffer.param_data.clone()
    for bucket in gather.buffer.buckets:
        gather.buffer.param_data.copy_(before)
        gather.after_gather(bucket)
        got = gather.buffer.param_data.clone()
        gather.buffer.param_data.copy_(before)
        _old_after_gather(gather, bucket)
        assert torch.equal(_bytes(got), _bytes(gather.buffer.param_data)), f"bucket {bucket.index}"
        assert not torch.equal(got, before)  # every bucket holds parts of other ranks


@pytest.mark.parametrize("rank", range(DP))
def test_a_rank_without_pieces(rank):
    """One 16-element weight in a bucket of 128 elements: ranks 1..3 own none of it (nothing to
    quantize, all of it to dequantize), rank 0 all of it (nothing to dequantize)."""
    gather = _gather(torch.bfloat16, rank, shapes=[(4, 4)], bucket_size=None)
    assert (gather._fp8_ranges == ()) == (rank > 0)
    gather.data.view(torch.uint8).fill_(0x5A)
    gather.quantize_shards()
    got = gather.data.clone()
    gather.data.view(torch.uint8).fill_(0x5A)
    _old_quantize_shards(gather)
    assert torch.equal(_bytes(got), _bytes(gather.data))
    (bucket,) = gather.buffer.buckets
    before = gather.buffer.param_data.clone()
    gather.after_gather(bucket)
    got = gather.buffer.param_data.clone()
    gather.buffer.param_data.copy_(before)
    _old_after_gather(gather, bucket)
    assert torch.equal(_bytes(got), _bytes(gather.buffer.param_data))
    assert torch.equal(got, before) == (rank == 0)


def test_reference_ops_skip_empty_runs_and_leave_the_rest():
    """Empty runs and a weight without a run: nothing written there; every byte outside the runs kept."""
    params = torch.randn(100).to(torch.bfloat16)
    data = torch.full((100,), 0x5A, dtype=torch.uint8).view(torch.float8_e4m3fn)
    ranges = ((3, 40, 1), (40, 40, 0), (50, 97, 2))
    scales = torch.tensor([1.0, 64.0, 500.0])  # 500 saturates
    reference.fp8_quantize_flat(params, FlatFp8Weights(data, ranges, scales, torch.zeros(3)))
    want = torch.full((100,), 0x5A, dtype=torch.uint8)
    for start, end, i in ranges:
        want[start:end] = reference.fp8_quantize(params[start:end], scales[i], torch.float8_e4m3fn).view(
            torch.uint8
        )
    assert torch.equal(data.view(torch.uint8), want)
    scale_inv = torch.ones(3, 4)
    scale_inv[:, 0] = scales.reciprocal()
    out = torch.zeros(100, dtype=torch.bfloat16)
    reference.fp8_dequantize_flat(out, data, scale_inv[:, 0], ranges)
    assert out[:3].eq(0).all() and out[40:50].eq(0).all() and out[97:].eq(0).all()
    close = (out[3:40].float() - params[3:40].float()).abs() <= params[3:40].float().abs() / 8 + 1e-3
    assert close.all()
