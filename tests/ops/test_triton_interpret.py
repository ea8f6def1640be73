"""The CUDA backend's norm, bias-dropout-add, weighted SwiGLU and flat AdamW kernels under Triton's CPU
interpreter.

A quick CPU-only check of the persistent backward kernels (row shares that do not divide evenly,
row blocks of 1 and 2, with and without prefetching, weight/bias gradients through the partial-sum
kernel, the packed dropout mask): the kernels run on CPU tensors with ``TRITON_INTERPRET=1`` and are
compared with :mod:`mcore.ops.reference` in float64. It needs Triton installed (the ``test`` extra
installs it, so CI runs it); the GPU tests of ``test_backend_ops.py`` stay the kernels' real check. The interpreter
must be switched on before Triton's kernels are defined, so the checks run in a child process.

By hand: ``OMP_NUM_THREADS=1 TRITON_INTERPRET=1 python tests/ops/test_triton_interpret.py``.
"""

from __future__ import annotations

import os
import sys

from mcore.testing.interpreter import interpreter_child, needs_triton, run_under_interpreter


@needs_triton
@interpreter_child()
def test_norm_and_dropout_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _flat_adam_case(n: int, runs, mode: str, skip: bool, master_std: float):
    """A flat AdamW state of ``n`` elements over ``runs`` (segments as ``FlatSegments.from_runs``
    takes them) and the step's hyperparameters. The state is consistent: each segment's master
    (state space) rounds to its parameter (buffer space). ``mode`` picks the storage, as the op's
    positional buffers ``[grads, params, masters, remainders, exp_avgs, exp_avg_sqs]``:
    ``fp32`` (the parameters are the masters), ``masters`` (fp32 masters beside bf16 parameters,
    and the optimizer's device step counter), ``remainders`` (bf16 parameters with int16
    remainders, bf16 gradients and moments)."""
    import torch

    from mcore.ops.flat import split_master

    masters, grads = torch.randn(n) * master_std, torch.randn(n)
    m0, v0 = torch.randn(n) * 0.1, torch.rand(n) * 0.01
    params, rem = torch.randn(n).to(torch.bfloat16), torch.zeros(n, dtype=torch.int16)
    for st, bu, length, _ in runs:
        hi, lo = split_master(masters[st : st + length])
        params[bu : bu + length], rem[st : st + length] = hi, lo
    if mode == "fp32":
        state = [grads, masters, None, None, m0, v0]
    elif mode == "masters":
        state = [grads, params, masters, None, m0, v0]
    else:
        bf16 = torch.bfloat16
        state = [grads.to(bf16), params, None, rem, m0.to(bf16), v0.to(bf16)]
    hyper = dict(
        # the optimizer's device step counter (bias corrections read by the kernel) or an int
        step=torch.tensor(3) if mode == "masters" else 3, lrs=[1e-2, 2e-2],
        weight_decays=[0.1, 0.0], beta1=0.9, beta2=0.95, eps=1e-8,
        grad_scale=torch.tensor(0.5), skip=torch.tensor(skip),
    )  # fmt: skip
    return state, hyper


def _main() -> int:
    import torch
    from mcore.backends.cuda.triton_kernels import activations, norms
    from mcore.backends.cuda.triton_kernels import swiglu as swiglu_kernels

    from mcore.ops import reference

    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.manual_seed(0)
    bound = {torch.float32: 2e-5, torch.bfloat16: 2.4e-2}  # bf16: the interpreter rounds by truncation
    failures = []

    def expect(name, errors, tol):
        print(name, " ".join(f"{e:.1e}" for e in errors))
        if not all(e <= tol for e in errors):
            failures.append(f"{name}: {errors} > {tol}")

    def grads(out_fn, args, dy):
        args = [a.detach().requires_grad_() if a is not None else None for a in args]
        out = out_fn(*args)
        return out, torch.autograd.grad(out, [a for a in args if a is not None], dy)

    # On CPU tensors the grid is sized for 4 "SMs": 37 rows over 8 (PER_SM=2) or 4 (PER_SM=1)
    # programs, 5 rows over fewer programs than SMs, and row blocks of 2 leave a ragged last block.
    configs = [
        None,
        {"BLOCK_M": 1, "num_warps": 4, "PER_SM": 2, "PREFETCH": False},
        {"BLOCK_M": 2, "num_warps": 4, "PER_SM": 1, "PREFETCH": True, "STRIDED": True, "DRES_EARLY": True},
    ]
    for (m, n), dt, cfg in [
        ((37, 96), torch.float32, configs[0]),
        ((37, 1000), torch.bfloat16, configs[0]),
        ((37, 96), torch.bfloat16, configs[1]),
        ((5, 1000), torch.float32, configs[2]),
    ]:
        x = (torch.randn(m, n) * 2 + 0.5).to(dt)
        w = (torch.randn(n) * 0.3 + 1).to(dt)
        b = (torch.randn(n) * 0.3).to(torch.float32)  # a bias of another dtype than the weight
        dy = torch.randn(m, n).to(dt)
        tag = f"{m}x{n} {dt} {cfg}"
        _, gold = grads(lambda x, w: reference.rms_norm(x, w, 1e-6), [x.double(), w.double()], dy.double())
        _, rstd = norms.rms_norm_fwd(x, w, 1e-6, dt)
        dx, dw = norms.rms_norm_bwd(dy, x, w, rstd, cfg and dict(cfg))
        assert dx.dtype == dt and dw.dtype == w.dtype
        expect(f"rms_norm bwd {tag}", [_rel(dx, gold[0]), _rel(dw, gold[1])], bound[dt])
        dres = torch.randn(m, n).to(dt)  # the residual's gradient, added to dx in the same pass
        dx, _ = norms.rms_norm_bwd(dy, x, w, rstd, cfg and dict(cfg), dres2=dres)
        expect(f"rms_norm bwd + residual grad {tag}", [_rel(dx, gold[0] + dres.double())], bound[dt])
        for bias in (b, None):
            args = [x.double(), w.double(), None if bias is None else bias.double()]
            _, gold = grads(
                lambda *a: reference.layer_norm(a[0], a[1], a[2] if len(a) > 2 else None, 1e-5),
                args,
                dy.double(),
            )
            _, mean, rstd = norms.layer_norm_fwd(x, w, bias, 1e-5)
            dx, dw, db = norms.layer_norm_bwd(
                dy, x, w, bias is not None, mean, rstd, cfg and dict(cfg), bias_dtype=torch.float32
            )
            got = [dx, dw] + ([db] if bias is not None else [])
            assert (db is None) == (bias is None) and dw.dtype == w.dtype
            expect(
                f"layer_norm bwd bias={bias is not None} {tag}",
                [_rel(g, r) for g, r in zip(got, gold)],
                bound[dt],
            )
            dx, _, _ = norms.layer_norm_bwd(
                dy,
                x,
                w,
                bias is not None,
                mean,
                rstd,
                cfg and dict(cfg),
                bias_dtype=torch.float32,
                dres2=dres,
            )
            expect(f"layer_norm bwd + residual grad {tag}", [_rel(dx, gold[0] + dres.double())], bound[dt])

    # Through autograd (the op table's entry points): RMSNorm and LayerNorm, fp32 weight on bf16 x.
    x = torch.randn(3, 7, 200).to(torch.bfloat16)
    w = torch.randn(200) * 0.3 + 1
    dy = torch.randn(3, 7, 200).to(torch.bfloat16)
    out, got = grads(lambda x, w: norms.rms_norm(x, w, 1e-5), [x, w], dy.float())
    _, gold = grads(lambda x, w: reference.rms_norm(x, w, 1e-5), [x.double(), w.double()], dy.double())
    expect("rms_norm autograd bf16 x, fp32 w", [_rel(g, r) for g, r in zip(got, gold)], bound[torch.bfloat16])
    out, got = grads(lambda x, w, b: norms.layer_norm(x, w, b, 1e-5), [x, w, w * 0.1], dy)
    _, gold = grads(
        lambda x, w, b: reference.layer_norm(x, w, b, 1e-5),
        [x.double(), w.double(), w.double() * 0.1],
        dy.double(),
    )
    expect(
        "layer_norm autograd bf16 x, fp32 w/b", [_rel(g, r) for g, r in zip(got, gold)], bound[torch.bfloat16]
    )

    # (norm(x), x) with the residual's gradient added in the norm's backward pass: a strided x (the
    # kernels read rows with their stride), a residual gradient with its own row stride.
    base = (torch.randn(37, 2 * 200) * 2 + 0.5).to(torch.bfloat16)
    x = base[:, :200]
    w = torch.randn(200).to(torch.bfloat16) * 0.3 + 1
    dy = torch.randn(37, 200).to(torch.bfloat16)
    dres = torch.randn(37, 300).to(torch.bfloat16)[:, 50:250]
    for name, fused, plain in [
        ("rms_norm", lambda x, w: norms.rms_norm_with_residual(x, w, 1e-5), reference.rms_norm_with_residual),
        (
            "layer_norm",
            lambda x, w: norms.layer_norm_with_residual(x, w, w * 0.1, 1e-5),
            lambda x, w, eps: reference.layer_norm_with_residual(x, w, w * 0.1, eps),
        ),
    ]:
        xa, wa = x.detach().requires_grad_(), w.detach().requires_grad_()
        out, res = fused(xa, wa)
        assert res.data_ptr() == xa.data_ptr() and res.shape == xa.shape
        got = torch.autograd.grad((out, res), [xa, wa], (dy, dres))
        xg, wg = x.double().requires_grad_(), w.double().requires_grad_()
        gold = torch.autograd.grad(plain(xg, wg, 1e-5), [xg, wg], (dy.double(), dres.double()))
        expect(
            f"{name}_with_residual autograd bf16",
            [_rel(g, r) for g, r in zip(got, gold)],
            bound[torch.bfloat16],
        )
        # only the residual used: its gradient passes through unchanged
        xa = x.detach().requires_grad_()
        (only,) = torch.autograd.grad(fused(xa, wa)[1], [xa], dres)
        assert torch.equal(only, dres), name

    # bias-dropout-add: eval (the bias gradient's column sum) against the reference ...
    for (m, n), dt in [((37, 200), torch.float32), ((9, 13), torch.bfloat16)]:
        x, r, dy = torch.randn(m, n).to(dt), torch.randn(m, n).to(dt), torch.randn(m, n).to(dt)
        b = torch.randn(n).to(dt)
        out, got = grads(lambda x, b, r: activations.bias_dropout_add(x, b, r, 0.1, False), [x, b, r], dy)
        ref, gold = grads(
            lambda x, b, r: reference.bias_dropout_add(x, b, r, 0.1, False),
            [x.double(), b.double(), r.double()],
            dy.double(),
        )
        expect(
            f"bias_dropout_add eval {m}x{n} {dt}",
            [_rel(out, ref)] + [_rel(g, h) for g, h in zip(got, gold)],
            bound[dt],
        )
    # ... and with dropout: the packed mask agrees with the forward's output, the backward uses it.
    p = 0.3
    scale = torch.tensor(1 / (1 - p), dtype=torch.float32)
    for (m, n), dt, cfg in [
        ((37, 200), torch.float32, None),
        (
            (9, 13),
            torch.bfloat16,
            {"BLOCK_N": 16, "BLOCK_M": 4, "num_warps": 1, "PER_SM": 1, "PREFETCH": False, "STRIDED": True},
        ),
    ]:
        x, r, dy = torch.randn(m, n).to(dt), torch.randn(m, n).to(dt), torch.randn(m, n).to(dt)
        b = torch.randn(n).to(dt)
        y, mask = activations.bda_fwd(x, b, r, p, torch.tensor([20 + m], dtype=torch.int64))
        keep = ((mask[:, :, None].int() >> torch.arange(8)) & 1).reshape(m, -1)[:, :n].bool()
        frac = keep.float().mean().item()
        if not abs(frac - (1 - p)) < 0.1:
            failures.append(f"bda keep fraction {frac}")
        t = (x.float() + b.float()).to(dt).float()
        want_y = (r.float() + torch.where(keep, (t * scale).to(dt).float(), 0.0)).to(dt)
        dx, db = activations.bda_bwd(dy, mask, p, dt, cfg)
        want_dx = torch.where(keep, dy.float() * scale, 0.0)
        assert db.dtype == dt and dx.dtype == dt
        errors = [_rel(y, want_y), _rel(dx, want_dx), _rel(db, want_dx.sum(0))]
        expect(f"bias_dropout_add p={p} {m}x{n} {dt} {cfg}", errors, bound[dt])
        if not torch.equal(dx == 0, want_dx == 0):
            failures.append(f"bda dx zeros differ from the mask ({m}x{n})")

    # The MoE experts' weighted SwiGLU through its autograd.Function: a row block that is ragged, the
    # backward's loop over several column blocks (BLOCK_N 16 < F), a zero weight; no rows falls back.
    from mcore.backends.cuda import ops as cuda_ops

    for (m, f), dt in [((7, 37), torch.float32), ((5, 20), torch.bfloat16)]:
        x, w, dy = (torch.randn(m, 2 * f) * 2).to(dt), torch.rand(m), torch.randn(m, f).to(dt)
        w[0] = 0.0
        fwd, bwd = swiglu_kernels.weighted_swiglu_fwd, swiglu_kernels.weighted_swiglu_bwd
        small = {"BLOCK_M": 4, "BLOCK_N": 16, "num_warps": 1}
        y = fwd(x, w, small)
        dx, dw = bwd(dy, x, w, small)
        out, got = grads(swiglu_kernels.weighted_swiglu, [x, w], dy)
        ref, gold = grads(reference.weighted_swiglu, [x.double(), w.double()], dy.double())
        assert dx.dtype == dt and dw.dtype == torch.float32 and got[1].dtype == torch.float32
        errors = [_rel(y, ref), _rel(dx, gold[0]), _rel(dw, gold[1]), _rel(out, ref)]
        errors += [_rel(g, h) for g, h in zip(got, gold)]
        expect(f"weighted_swiglu {m}x{2 * f} {dt}", errors, bound[dt])
    empty = cuda_ops.weighted_swiglu(torch.zeros(0, 8), torch.zeros(0))
    assert empty.shape == (0, 4) and empty.grad_fn is None

    # One-pass AdamW over flat buffers: tiles aligned to 16 elements (full tiles unmasked, ragged first
    # and last tiles) and unaligned tables (tiles start at the segment), three storages, and the skip flag.
    from mcore.backends.cuda.triton_kernels import adam

    from mcore.ops.flat import FlatSegments, join_master

    n = 3 * adam.BLOCK + 500
    for runs, want_aligned in [
        (
            [(5, 5, 2 * adam.BLOCK + 7, 0), (2 * adam.BLOCK + 12, 2 * adam.BLOCK + 28, adam.BLOCK + 300, 1)],
            True,
        ),
        ([(0, 3, adam.BLOCK + 9, 0), (adam.BLOCK + 9, adam.BLOCK + 20, 2 * adam.BLOCK, 1)], False),
    ]:
        for mode in ("fp32", "masters", "remainders"):
            for skip in (False, True):
                state, hyper = _flat_adam_case(n, runs, mode, skip, master_std=1.0)
                ours = [t.clone() if t is not None else None for t in state]
                gold = [t.clone() if t is not None else None for t in state]
                segments = FlatSegments.from_runs(runs)
                adam.adam_step_flat(*ours, segments, **hyper)
                reference.adam_step_flat(*gold, FlatSegments.from_runs(runs), **hyper)
                if adam._tiles(segments, state[0].device)[-1] != want_aligned:
                    failures.append(f"adam tiles aligned != {want_aligned} for {runs}")
                if mode == "remainders":  # the exact fp32 masters, then the bf16 moments
                    pairs = [(join_master(ours[1], ours[3]), join_master(gold[1], gold[3]), 1e-6)]
                    pairs += [(ours[i], gold[i], bound[torch.bfloat16]) for i in (4, 5)]
                else:
                    pairs = [(x, y, 1e-6 if x.dtype == torch.float32 else bound[torch.bfloat16])
                             for x, y in zip(ours, gold) if x is not None]  # fmt: skip
                errors = [_rel(x, y) for x, y, _ in pairs]
                print(f"adam_step_flat {mode} aligned={want_aligned} skip={skip}", errors)
                if not all(e <= tol for e, (_, _, tol) in zip(errors, pairs)):
                    failures.append(f"adam_step_flat {mode} aligned={want_aligned} skip={skip}: {errors}")
                if skip and not all(torch.equal(x, y) for x, y in zip(ours, state) if x is not None):
                    failures.append(f"adam skip changed a buffer ({mode})")

    if failures:
        print("FAILED:\n" + "\n".join(failures))
    return 1 if failures else 0


@needs_triton
@interpreter_child("adam_fp8")
def test_adam_step_flat_fp8_kernel_under_the_interpreter():
    """``adam_step_flat_fp8``'s kernel (tiles of 64 elements) against the reference op: FP8 pieces that
    start and end inside tiles and aligned blocks, non-FP8 parameters between them, a weight without
    a piece, aligned and unaligned tables, three storages, skip false and true."""
    out = run_under_interpreter(__file__, "adam_fp8")
    assert "adam_step_flat_fp8 checks: 12" in out, out


def _adam_fp8_main() -> int:
    """The FP8 bytes and amaxes bit for bit: with skip false, the bytes equal the reference op's
    wherever the kernel's parameters equal the reference's (which they must within the flat step's
    bounds: its arithmetic differs from torch's by an fp32 rounding, and the interpreter's bf16
    conversion truncates), and always ``fp8_quantize`` of the parameters the kernel wrote; with skip
    true every buffer equals the reference's bit for bit."""
    import torch
    from mcore.backends.cuda.triton_kernels import adam

    from mcore.ops import reference
    from mcore.ops.flat import FlatFp8Weights, FlatSegments

    assert os.environ.get("TRITON_INTERPRET") == "1"
    adam.BLOCK = 64  # tiny tiles: full tiles, ragged ones and pieces inside them on a few hundred elements
    torch.manual_seed(0)
    failures, checks = [], 0
    n = 330
    cases = [  # (segments as runs, pieces (start, end, weight), whether the table is aligned)
        ([(5, 5, 140, 0), (145, 161, 150, 1)], ((20, 100, 0), (110, 145, 2), (170, 261, 1)), True),
        ([(0, 3, 150, 0), (150, 170, 130, 1)], ((3, 67, 0), (80, 153, 2), (200, 300, 1)), False),
    ]
    for runs, ranges, want_aligned in cases:
        for mode in ("fp32", "masters", "remainders"):
            for skip in (False, True):
                state, hyper = _flat_adam_case(n, runs, mode, skip, master_std=2.0)
                data = torch.full((n,), 0x5A, dtype=torch.uint8).view(torch.float8_e4m3fn)
                scales = torch.tensor([96.0, 200.0, 40.0, 0.5])  # weight 3: no piece; 200 saturates

                def fp8(data=data, scales=scales, ranges=ranges):
                    return FlatFp8Weights(data.clone(), ranges, scales.clone(), torch.full((4,), 7.0))

                ours, gold = [[t.clone() if t is not None else None for t in state] for _ in range(2)]
                ours_fp8, gold_fp8 = fp8(), fp8()
                segments = FlatSegments.from_runs(runs)
                adam.adam_step_flat_fp8(*ours, segments, ours_fp8, **hyper)
                reference.adam_step_flat_fp8(*gold, FlatSegments.from_runs(runs), gold_fp8, **hyper)
                tag = f"adam_step_flat_fp8 {mode} aligned={want_aligned} skip={skip}"
                checks += 1
                if adam._tiles(segments, state[0].device, ranges)[-1] != want_aligned:
                    failures.append(f"{tag}: tiles aligned != {want_aligned}")
                got_bytes, gold_bytes = ours_fp8.data.view(torch.uint8), gold_fp8.data.view(torch.uint8)
                # the kernel's own parameters, quantized and maxed by the reference: bit for bit
                want = fp8()
                want.amax.zero_()
                for start, end, i in ranges:
                    piece = ours[1][start:end]
                    want.data[start:end] = reference.fp8_quantize(piece, scales[i], torch.float8_e4m3fn)
                    want.amax[i] = torch.maximum(want.amax[i], reference.fp8_amax(piece))
                if not torch.equal(got_bytes, want.data.view(torch.uint8)):
                    failures.append(f"{tag}: bytes are not fp8_quantize of the kernel's parameters")
                if not torch.equal(ours_fp8.amax, want.amax):
                    failures.append(f"{tag}: amax {ours_fp8.amax.tolist()} != {want.amax.tolist()}")
                same = ours[1] == gold[1]
                if not torch.equal(got_bytes[same], gold_bytes[same]):
                    failures.append(f"{tag}: bytes differ from the reference op's where the parameters agree")
                err = _rel(ours[1].float(), gold[1].float())
                if err > (1e-6 if mode == "fp32" else 2.4e-2):
                    failures.append(f"{tag}: parameters {err:.1e} from the reference")
                if skip:
                    pairs = [(x, y) for x, y in zip(ours, gold) if x is not None]
                    pairs += [(got_bytes, gold_bytes), (ours_fp8.amax, gold_fp8.amax), (ours[1], state[1])]
                    if not all(torch.equal(x, y) for x, y in pairs):
                        failures.append(f"{tag}: a skipped step is not the reference's bit for bit")
                print(tag, f"params {err:.1e}", f"agree on {int(same.sum())}/{n}")
    print("adam_step_flat_fp8 checks:", checks)
    if failures:
        print("FAILED:\n" + "\n".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(_adam_fp8_main() if sys.argv[1:] == ["adam_fp8"] else _main())
