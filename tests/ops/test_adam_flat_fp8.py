"""The op ``adam_step_flat_fp8`` (reference): the flat AdamW step, then the FP8 copies of the FP8
weights' pieces from the parameters it wrote (``--fp8-param-gather`` with the delayed recipe).

Checked against its definition, ``adam_step_flat`` followed by ``fp8_quantize`` of each piece and the
amax ``Fp8ParamGather.quantize_shards`` computes (``_foreach_norm(inf)`` of the pieces in the parameter
dtype), bit for bit: fp32 masters beside bf16 parameters, int16 remainders with bf16 moments, fp32
parameters; a skipped step (the unchanged parameters' bytes and amax); pieces that start and end
inside 16-element blocks and inside a segment, non-FP8 parameters between FP8 ones, a weight without a
piece here. The Triton kernel's check under the interpreter is in ``test_triton_interpret.py``.
"""

from __future__ import annotations

import pytest
import torch

from mcore.ops import reference
from mcore.ops.flat import FlatFp8Weights, FlatSegments, split_at_fp8_pieces, split_master

N = 260
RUNS = [(0, 3, 120, 0), (128, 131, 125, 1)]  # (state start, buffer start, length, group); gap 123..131
RANGES = ((10, 50, 0), (57, 123, 2), (140, 201, 1))  # non-FP8 3..10, 50..57, 131..140, 201..256
SCALES = torch.tensor([96.0, 300.0, 40.0, 2.0])  # weight 3: no piece; 300 saturates the largest |p|


def _state(mode: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    masters = torch.randn(N, generator=gen) * 2
    grads = torch.randn(N, generator=gen)
    m0, v0 = torch.randn(N, generator=gen) * 0.1, torch.rand(N, generator=gen) * 0.01
    params = torch.randn(N, generator=gen).to(torch.bfloat16)
    rem = torch.zeros(N, dtype=torch.int16)
    for st, bu, length, _ in RUNS:  # each master (state space) rounds to its parameter (buffer space)
        hi, lo = split_master(masters[st : st + length])
        params[bu : bu + length], rem[st : st + length] = hi, lo
    if mode == "fp32":
        return [grads, masters.clone(), None, None, m0, v0]
    if mode == "masters":
        return [grads, params, masters, None, m0, v0]
    bf16 = torch.bfloat16
    return [grads.to(bf16), params, None, rem, m0.to(bf16), v0.to(bf16)]


def _fp8() -> FlatFp8Weights:
    data = torch.full((N,), 0x5A, dtype=torch.uint8).view(torch.float8_e4m3fn)  # a sentinel byte
    return FlatFp8Weights(data, RANGES, SCALES.clone(), torch.full((4,), 7.0))


def _hyper(skip: bool) -> dict:
    return dict(
        step=torch.tensor(3), lrs=[1e-2, 2e-2], weight_decays=[0.1, 0.0], beta1=0.9, beta2=0.95,
        eps=1e-8, grad_scale=torch.tensor(0.5), skip=torch.tensor(skip),
    )  # fmt: skip


def _clone(state):
    return [t.clone() if t is not None else None for t in state]


@pytest.mark.parametrize("skip", [False, True], ids=["step", "skipped"])
@pytest.mark.parametrize("mode", ["masters", "remainders", "fp32"])
def test_fused_step_is_the_flat_step_then_the_quantization(mode, skip):
    state = _state(mode)
    fused, plain = _clone(state), _clone(state)
    fp8 = _fp8()
    reference.adam_step_flat_fp8(*fused, FlatSegments.from_runs(RUNS), fp8, **_hyper(skip))
    reference.adam_step_flat(*plain, FlatSegments.from_runs(RUNS), **_hyper(skip))
    for got, want in zip(fused, plain):  # the step itself: adam_step_flat's, bit for bit
        assert (got is None and want is None) or torch.equal(got, want)
    if skip:  # a non-finite gradient norm: the parameters stay, their copies are still written
        assert torch.equal(fused[1], state[1])

    # what Fp8ParamGather.quantize_shards computes from the parameters after the step
    params = plain[1]
    pieces = [params[start:end] for start, end, _ in RANGES]
    norms = torch._foreach_norm(pieces, float("inf"))
    want_amax = torch.zeros(4)
    want_bytes = torch.full((N,), 0x5A, dtype=torch.uint8)
    for (start, end, i), piece, norm in zip(RANGES, pieces, norms):
        want_amax[i] = norm.float()
        q = reference.fp8_quantize(piece, SCALES[i], torch.float8_e4m3fn)
        want_bytes[start:end] = q.view(torch.uint8)
    assert torch.equal(fp8.amax, want_amax)  # weight 3 has no piece: 0
    assert torch.equal(fp8.data.view(torch.uint8), want_bytes)  # bytes outside the pieces untouched
    assert (fp8.data.float().abs() == 448.0).any()  # the saturating case is exercised


def test_pieces_split_the_segments_at_their_boundaries():
    split = split_at_fp8_pieces(FlatSegments.from_runs(RUNS), RANGES)
    got = [
        (seg.buffer_start, seg.buffer_start + seg.length, seg.state_start, seg.group, i) for seg, i in split
    ]
    assert got == [
        (3, 10, 0, 0, -1), (10, 50, 7, 0, 0), (50, 57, 47, 0, -1), (57, 123, 54, 0, 2),
        (131, 140, 128, 1, -1), (140, 201, 137, 1, 1), (201, 256, 198, 1, -1),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        (((10, 50, 0), (120, 135, 1)), "do not lie inside the optimizer's segments"),  # across the gap
        (((10, 50, 0), (40, 60, 1)), "FP8 pieces of weights 0 and 1 overlap at buffer index 40"),
    ],
)
def test_pieces_outside_the_segments_are_refused(ranges, message):
    state = _state("masters")
    fp8 = FlatFp8Weights(_fp8().data, ranges, SCALES.clone(), torch.zeros(4))
    before = _clone(state)
    with pytest.raises(ValueError, match=message):
        reference.adam_step_flat_fp8(*state, FlatSegments.from_runs(RUNS), fp8, **_hyper(False))
    assert all(t is None or torch.equal(t, b) for t, b in zip(state, before))  # refused before the step
