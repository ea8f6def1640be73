"""The CUDA backend's fused activation + FP8 cast kernels (``act_fp8_forward``/``act_fp8_backward``).

Under Triton's CPU interpreter (CI) and, with ``MCORE_TEST_BACKEND=cuda``, on the GPU: through the
CUDA dispatchers, for exact GeLU, tanh GeLU and SwiGLU, with and without a bias, fp32/fp16/bf16
inputs, e4m3 and e5m2, ``M`` and ``F`` not multiples of the tile, ``q``/``qT`` alone or together, a
row stride wider than the row and the amax recorded into a slot of a larger buffer (grid-strided
forward tiles, several row programs in the backward):

* against the unfused CUDA path (the existing activation kernel, then the ``fp8_cast`` kernel):
  the FP8 bytes, ``scale_inv`` and the recorded amax identical; under the interpreter the bias
  gradient identical to ``_bias_gelu_bwd_kernel``'s with the same tiling (on the GPU, whose final
  sums of the partials may run in another order, and for SwiGLU against the sum of the SwiGLU
  kernel's gradient: within fp32 rounding);
* against :mod:`mcore.ops.reference`: every FP8 value within the activation's tolerance plus one
  step of the FP8 grid (the reference computes GeLU with torch's math), the bias gradient within
  rounding; and the conformance suite's
  cases of both ops;
* every forward tile that autotuning may pick (``_FWD_CONFIGS``), with and without an amax record,
  ragged and exact tilings: the unfused path's bytes and amax; the launch that Triton's autotuner
  builds (each config run twice into the same outputs, then the chosen one) likewise; the launch
  cache keyed on the shape and the amax record, and each config's grid.

Two interpreter artefacts, not kernel behaviour: its fp32 -> bf16 conversion truncates (the GPU's
rounds to nearest even): with bf16 the unfused path's SwiGLU bias add (torch's) is emulated with a
truncation there, the GeLU bias gradient's final rounding is compared within one bf16 step, and the
conformance case of the SwiGLU backward (whose bias gradient sums truncated terms) runs in fp32 only;
on the GPU everything is compared bit for bit. The interpreter checks run in a child process (the
interpreter must be on before Triton defines the kernels).

By hand: ``OMP_NUM_THREADS=1 TRITON_INTERPRET=1 python tests/ops/test_act_fp8_interpret.py``.
"""

from __future__ import annotations

import os
import sys
import types

import pytest

from mcore.testing.interpreter import HAS_TRITON, interpreter_child, needs_triton, run_under_interpreter


@needs_triton
@interpreter_child()
def test_act_fp8_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


def test_act_fp8_kernels_on_the_gpu():
    import torch

    if os.environ.get("MCORE_TEST_BACKEND") != "cuda" or not torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("the GPU run: MCORE_TEST_BACKEND=cuda on a machine with a CUDA device and Triton")
    assert _main(torch.device("cuda")) == 0


def _main(device) -> int:
    """The checks below, with the kernel module's entry points restored afterwards."""
    from mcore.backends.cuda.triton_kernels import act_fp8 as kernels

    saved = {name: getattr(kernels, name) for name in ("act_fp8_forward", "act_fp8_backward")}
    try:
        return _checks(device)
    finally:
        for name, value in saved.items():
            setattr(kernels, name, value)


def _checks(device) -> int:
    import torch
    from mcore.backends.cuda.fp8 import act as dispatch
    from mcore.backends.cuda.triton_kernels import act_fp8 as kernels
    from mcore.backends.cuda.triton_kernels import activations
    from mcore.backends.cuda.triton_kernels import fp8_cast as cast_kernels
    from mcore.backends.cuda.triton_kernels import swiglu as swiglu_kernels

    from mcore.ops import reference
    from mcore.testing import conformance

    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    failures = []
    calls = {"act_fp8_forward": 0, "act_fp8_backward": 0}
    # small tiles: several ragged tiles a dim; the backward's explicit tiling is the unfused one's
    fwd_cfg = {"BLOCK_M": 16, "BLOCK_F": 8, "num_warps": 4}
    bwd_cfg = {"BLOCK_M": 16, "BLOCK_F": 8, "num_warps": 4, "PER_SM": 1}
    unfused_bwd_cfg = {"BLOCK_M": 16, "BLOCK_N": 8, "num_warps": 4, "PER_SM": 1}
    originals = {name: getattr(kernels, name) for name in calls}
    for name, cfg in (("act_fp8_forward", fwd_cfg), ("act_fp8_backward", bwd_cfg)):
        original = originals[name]

        def counted(*args, _original=original, _name=name, _cfg=cfg, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs, config=_cfg)

        setattr(kernels, name, counted)

    u8 = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731

    def same(what, got, want):
        if (got is None) != (want is None):
            failures.append(f"{what}: {got!r} vs {want!r}")
            return
        if got is None:
            return
        ok = got.dtype == want.dtype and got.shape == want.shape and torch.equal(u8(got), u8(want))
        if not ok:
            failures.append(f"{what} differs")

    def within(what, got, want, bound):
        err = (got.float() - want.float()).abs() - bound
        if not (err <= 0).all():
            failures.append(f"{what}: off by {err.max().item():.3g} beyond {bound!r}")

    def near_reference(what, got, want, dtype):
        """FP8 values within the activation's tolerance plus one FP8 step of the reference's."""
        rtol, atol = conformance.TOLERANCES["elementwise"][dtype]
        for part, g, w in zip(("q", "qT"), got[:2], want[:2]):
            if (g is None) != (w is None):
                failures.append(f"{what} {part}: {g!r} vs reference {w!r}")
            elif g is not None and conformance.fp8_values_off(g, w, want[2], rtol, atol).any():
                failures.append(f"{what} {part}: off the reference")

    def ulp(x, dtype):
        return torch.finfo(dtype).eps * x.float().abs().clamp_min(torch.finfo(dtype).tiny)

    gen = torch.Generator().manual_seed(0)
    m, f = 37, 20
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    subsets = ((True, True), (True, False), (False, True))
    index = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for kind in ("gelu", "gelu_tanh", "swiglu"):
            for has_bias in (True, False):
                index += 1
                rowwise, columnwise = subsets[index % 3]
                fp8 = (e4m3, e5m2)[index % 2]
                width = 2 * f if kind == "swiglu" else f
                tag = f"{str(dtype)[6:]} {kind} bias={has_bias} {str(fp8)[6:]} {rowwise}/{columnwise}"
                # h a view with a row stride wider than its row; values past the FP8 range after scaling
                wide = (torch.randn(m, width + 3, generator=gen) * 2).to(dtype)
                wide[5, :3] = 200.0
                h = wide.to(device)[:, :width]
                b = torch.randn(width, generator=gen).to(dtype).to(device) if has_bias else None
                dy = torch.randn(m, f, generator=gen).to(dtype).to(device)
                scale = torch.tensor(20.0 if fp8 == e4m3 else 900.0, device=device)
                tanh = kind == "gelu_tanh"
                # the unfused CUDA path adds a SwiGLU bias with torch (the GeLU kernel adds its own)
                x_unfused = (h + b) if kind == "swiglu" and has_bias else h
                truncating = interpreting and dtype == torch.bfloat16
                if truncating and x_unfused is not h:  # as the interpreter's bf16 conversion rounds
                    x_unfused = _truncate_to_bf16(h.float() + b.float())
                h_cpu, b_cpu, dy_cpu = h.cpu(), None if b is None else b.cpu(), dy.cpu()

                # forward; the amax slot is the middle of three, first below the result, then above it
                for start in (0.5, 1e6):
                    slot, slot_unfused = (torch.full((3,), start, device=device) for _ in range(2))
                    got = dispatch.act_fp8_forward(h, b, kind, fp8, scale, slot[1:2], rowwise, columnwise)
                    if kind == "swiglu":
                        y = swiglu_kernels.swiglu_fwd(x_unfused)
                    else:
                        y = activations.bias_gelu_fwd(h, b, tanh)
                    want = cast_kernels.cast(
                        y,
                        fp8,
                        scale=scale,
                        rowwise=rowwise,
                        columnwise=columnwise,
                        amax_record=slot_unfused[1:2],
                    )
                    for part, g, w in zip(("q", "qT", "scale_inv"), got, want):
                        same(f"forward {tag} {part} (slot {start})", g, w)
                    same(f"forward {tag} amax record (slot {start})", slot, slot_unfused)
                ref_slot = torch.zeros(1)
                ref = reference.act_fp8_forward(
                    h_cpu, b_cpu, kind, fp8, scale.cpu(), ref_slot, rowwise=rowwise, columnwise=columnwise
                )
                near_reference(f"forward {tag}", got, ref, dtype)
                same(f"forward {tag} scale_inv vs reference", got[2].cpu(), ref[2])
                slot = torch.zeros(1, device=device)
                dispatch.act_fp8_forward(h, b, kind, fp8, scale, slot, rowwise, columnwise)
                within(f"forward {tag} amax vs reference", slot.cpu(), ref_slot, 2 * ulp(ref_slot, dtype))

                # backward
                slot, slot_unfused = torch.zeros(1, device=device), torch.zeros(1, device=device)
                got = dispatch.act_fp8_backward(dy, h, b, kind, fp8, scale, slot, rowwise, columnwise)
                if kind == "swiglu":
                    dh = swiglu_kernels.swiglu_bwd(dy, x_unfused)
                    db_unfused = dh.float().sum(0).to(dtype) if has_bias else None
                else:
                    dh, db_unfused = activations.bias_gelu_bwd(dy, h, b, tanh, config=unfused_bwd_cfg)
                want = cast_kernels.cast(
                    dh, fp8, scale=scale, rowwise=rowwise, columnwise=columnwise, amax_record=slot_unfused
                )
                for part, g, w in zip(("q", "qT", "scale_inv"), got, want):
                    same(f"backward {tag} {part}", g, w)
                same(f"backward {tag} amax record", slot, slot_unfused)
                if (got[3] is None) != (db_unfused is None):
                    failures.append(f"backward {tag} dbias: {got[3]!r} vs {db_unfused!r}")
                elif has_bias:
                    if kind != "swiglu" and interpreting and not truncating:
                        same(f"backward {tag} dbias (the GeLU kernel's)", got[3], db_unfused)
                    else:  # a final sum in another order (GPU, SwiGLU), or the interpreter's truncation
                        if kind != "swiglu" and not interpreting:
                            print(
                                tag,
                                "dbias bit-identical to the GeLU kernel's:",
                                torch.equal(got[3], db_unfused),
                            )
                        reordering = 1e-6 * dh.float().abs().sum(0)  # fp32 sums of m terms, reordered
                        within(
                            f"backward {tag} dbias", got[3], db_unfused, ulp(db_unfused, dtype) + reordering
                        )
                ref = reference.act_fp8_backward(
                    dy_cpu, h_cpu, b_cpu, kind, fp8, scale.cpu(), None, rowwise=rowwise, columnwise=columnwise
                )
                near_reference(f"backward {tag}", got, ref, dtype)
                if has_bias:
                    rtol, atol = conformance.TOLERANCES["reduction"][dtype]
                    bound = atol + rtol * ref[3].float().abs()
                    if truncating and kind == "swiglu":  # each summed term truncated: biased toward 0
                        bound = bound + ulp(dh, dtype).sum(0).cpu()
                    within(f"backward {tag} dbias vs reference", got[3].cpu(), ref[3], bound)
                print(tag, "checked")

    # rows past M must not reach the amax: there h is 0 and gelu(0 + bias) exceeds every real value
    h = -(torch.rand(m, f, generator=gen) + 0.5).to(device)
    b = torch.full((f,), 3.0, device=device)
    slot, slot_unfused = torch.zeros(1, device=device), torch.zeros(1, device=device)
    dispatch.act_fp8_forward(h, b, "gelu", e4m3, torch.tensor(1.0, device=device), slot)
    y = activations.bias_gelu_fwd(h, b, False)
    cast_kernels.cast(y, e4m3, scale=torch.tensor(1.0, device=device), amax_record=slot_unfused)
    same("forward amax of ragged row tiles", slot, slot_unfused)

    # every forward tile autotuning may pick, and the autotuned launch, against the unfused path
    def unfused_forward(h, kind, fp8, scale, slot):
        y = swiglu_kernels.swiglu_fwd(h) if kind == "swiglu" else activations.bias_gelu_fwd(h, None, False)
        return cast_kernels.cast(y, fp8, scale=scale, columnwise=True, amax_record=slot)

    _check_forward_tiles(device, originals["act_fp8_forward"], unfused_forward, same, failures, gen)

    # the conformance suite's cases, with the CUDA dispatchers as the backend's ops
    table = {**dispatch.ACT_FP8_OPS}

    class Ops(dict):
        def provider(self, name):
            return "cuda:triton"

    backend = types.SimpleNamespace(ops=Ops(table), device=lambda index=0: device)
    for case in conformance.OP_CASES:
        if case.op in table:
            for dtype in case.dtypes:
                if interpreting and dtype == torch.bfloat16 and case.name == "act_fp8_backward_swiglu":
                    continue  # its bias gradient sums 40 truncated bf16 terms (see the docstring)
                try:
                    conformance.check_op(backend, case, dtype)
                except conformance.ConformanceError as err:
                    failures.append(str(err))

    print("kernel launches", calls)
    if not all(calls.values()):
        failures.append(f"the dispatchers fell back to the reference: {calls}")
    if failures:
        print("FAILED:", *failures[:30], sep="\n  ")
        return 1
    return 0


def _check_forward_tiles(device, forward, unfused_forward, same, failures, gen) -> None:
    """Each of the forward's tiles (``_FWD_CONFIGS``), and the launch autotuning builds, give the
    unfused path's bytes and amax; the launch cache keys on the shape, the amax record and the config.

    Autotuning runs every config several times into the same outputs and amax record before the
    chosen one runs: here Triton's autotuner does so for real, with its timing (which needs a GPU
    driver) replaced by one that runs the kernel twice and makes the last config the fastest
    (not the default, so the test sees the tuned launch switch tiles).
    """
    import torch
    from mcore.backends.cuda.triton_kernels import _common
    from mcore.backends.cuda.triton_kernels import act_fp8 as kernels
    from triton.runtime import autotuner

    e4m3 = torch.float8_e4m3fn
    scale = torch.tensor(20.0, device=device)
    # (m, width): ragged for every tile; a multiple of every tile's (no bounds masks: EVEN)
    cases = [("gelu", 37, 20), ("swiglu", 37, 40), ("gelu", 128, 128), ("swiglu", 128, 256)]
    inputs = {case: (torch.randn(case[1:], generator=gen) * 2).to(device) for case in cases}

    wants = {}

    def check(what, case, config=None, start=0.5, record=True):
        h = inputs[case]
        if (case, start) not in wants:  # the unfused path, once an input and amax slot
            slot_unfused = torch.full((3,), start, device=device)
            wants[case, start] = (unfused_forward(h, case[0], e4m3, scale, slot_unfused[1:2]), slot_unfused)
        want, slot_unfused = wants[case, start]
        slot = torch.full((3,), start, device=device)
        got = forward(h, None, case[0], e4m3, scale, slot[1:2] if record else None, config=config)
        for part, g, w in zip(("q", "qT", "scale_inv"), got, want):
            same(f"{what} {part}", g, w)
        if record:
            same(f"{what} amax record", slot, slot_unfused)

    for cfg in kernels._FWD_CONFIGS:
        # grid-strided configs on one program an SM (the interpreter counts 4): several tiles a program
        cfg = {**cfg, "PER_SM": min(cfg["PER_SM"], 1)}
        for case in cases:
            for record in (True, False):
                check(f"forward tile {cfg} {case} amax recorded {record}", case, cfg, record=record)

    # the launch cache: one launch a shape and amax record; an explicit config is never cached
    tag = ("gelu", False, torch.float32, e4m3, True, True)
    launch = kernels._fwd_launch(tag, 37, 20, True, device, None)
    if kernels._fwd_launch(tag, 37, 20, True, device, None) is not launch:
        failures.append("forward launch: not cached per shape")
    if launch.configs != [kernels.FWD_DEFAULT]:
        failures.append(f"forward launch without autotuning: {launch.configs}, not the default")
    if kernels._fwd_launch(tag, 37, 21, True, device, None) is launch:
        failures.append("forward launch: the width not in the cache key")
    # the grid of every config: one tile a program (PER_SM 0) or at most PER_SM programs an SM
    big = [kernels._fwd_launch(tag, 1000, 1000, record, device, None) for record in (True, False)]
    if big[0] is big[1]:
        failures.append("forward launch: the amax record not in the cache key")
    if {cfg["PER_SM"] for cfg in kernels._FWD_CONFIGS} != {0, kernels.PROGRAMS_PER_SM}:
        failures.append("forward configs: not both grids tuned over")
    for cfg in kernels._FWD_CONFIGS:
        tiles = -(-1000 // cfg["BLOCK_M"]) * -(-1000 // cfg["BLOCK_F"])
        programs = min(tiles, cfg["PER_SM"] * _common.sm_count(device)) if cfg["PER_SM"] else tiles
        grids = [launch.grid_of(cfg) for launch in big]
        if grids != [(programs,), (programs,)]:
            failures.append(f"forward grids of {cfg} on [1000, 1000], amax recorded or not: {grids}")
    for cfg in kernels._FWD_CONFIGS[1:]:
        explicit = kernels._fwd_launch(tag, 37, 20, True, device, cfg)
        if explicit.configs != [{**kernels.FWD_DEFAULT, **cfg}]:
            failures.append(f"forward launch with config {cfg}: runs {explicit.configs}")

    # the autotuned launch (interpreter, few rows: turned on by hand)
    # (with empty tuner and launch caches, put back afterwards: on the GPU this runs inside pytest,
    # where an earlier test may have tuned this kernel for real)
    saved = (_common.use_autotune, kernels.use_autotune, autotuner.Autotuner.do_bench)
    tuners, launches = dict(_common._TUNERS), dict(_common._LAUNCHES)
    _common._TUNERS.clear(), _common._LAUNCHES.clear()
    benched = []

    def bench(kernel_call, quantiles):
        for _ in range(2):
            kernel_call()
        benched.append(1)
        fastest = len(benched) % len(kernels._FWD_CONFIGS) == 0
        return [1.0 if fastest else 2.0] * len(quantiles)

    _common.use_autotune = kernels.use_autotune = lambda rows: True
    autotuner.Autotuner.do_bench = staticmethod(bench)
    try:
        case = kind, m, width = cases[1]
        for call in ("tuning", "tuned"):  # the first call tunes, the second reuses the choice
            check(f"forward autotuned ({call}) {case}", case, start=1e6 if call == "tuned" else 0.5)
        tag = (kind, False, inputs[case].dtype, e4m3, True, True)
        # the inputs' device (cuda:0 on the GPU: the launch cache keys on it, not on the bare "cuda")
        f = width // 2 if kind == "swiglu" else width
        launch = kernels._fwd_launch(tag, m, f, True, inputs[case].device, None)
        want = {**kernels._FWD_CONFIGS[-1], "num_stages": 3}
        if launch.tuner is not None or launch.configs != [want]:
            failures.append(f"forward autotuned {case}: launch runs {launch.configs}, not {want}")
        if len(benched) != len(kernels._FWD_CONFIGS):
            failures.append(
                f"forward autotuning: {len(benched)} configs timed, not {len(kernels._FWD_CONFIGS)}"
            )
    finally:
        _common.use_autotune, kernels.use_autotune, autotuner.Autotuner.do_bench = saved
        _common._TUNERS.clear(), _common._LAUNCHES.clear()
        _common._TUNERS.update(tuners), _common._LAUNCHES.update(launches)


def _truncate_to_bf16(x):
    """fp32 -> bf16 dropping the low 16 bits: the Triton interpreter's conversion."""
    import torch

    return (x.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


if __name__ == "__main__":
    import torch

    sys.exit(_main(torch.device("cpu")))
