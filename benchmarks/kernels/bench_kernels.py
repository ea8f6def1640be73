"""Kernel micro-benchmarks of the CUDA backend: achieved bytes/s against the device's copy bandwidth.

For each memory-bound op at a training-sized shape (tokens 8192, hidden 2048, bf16; cross-entropy
over V = 50304) it times, forward and backward separately:

* ``cuda``: the cuda backend's op (Triton kernels; torch fused AdamW for the optimizer step);
* ``torch``: the pure-PyTorch reference op, eager;
* ``compile``: the reference op under ``torch.compile`` (Inductor's generated kernels).

Bytes are the fewest the op must move (each input read once, each output written once), so
``GB/s = bytes / time`` is comparable with a device-to-device copy, measured in the same run on a
1 GiB tensor (bytes read plus written). Times are medians of ``triton.testing.do_bench``, which
clears the L2 cache before every repetition.

    python benchmarks/kernels/bench_kernels.py [--sweep] [--skip-compile] [--json FILE]

``--sweep`` also times block-size variants of each Triton kernel (kernel time from the profiler, L2
flushed) and prints the best ones; ``--sweep-kernels NAME ...`` limits it to those kernels.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

TOKENS, HIDDEN, FFN, VOCAB = 8192, 2048, 5632, 50304
SEQ, BATCH, HEADS, HEAD_DIM = 2048, 4, 16, 128
DT = torch.bfloat16


def bench(fn: Callable, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` (CUDA events, L2 flushed before each repetition)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth(nbytes: int) -> float:
    """Device-to-device copy of ``nbytes``: bytes read plus written per second."""
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def kernel_us(fn: Callable, iters: int = 10) -> float | None:
    """Microseconds of device work per call of ``fn``: the sum of its kernels' durations (profiler).

    Unlike a wall-clock time, this leaves out the gaps while the host issues launches (autograd and
    Python overhead), so bytes over it is the bandwidth the kernels themselves achieve. The L2
    cache is flushed (a 256 MiB ``bitwise_not_``, left out of the sum) before every call.
    """
    from torch.profiler import ProfilerActivity, profile

    try:
        flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                flush.bitwise_not_()
                fn()
            torch.cuda.synchronize()
        total = 0.0
        for evt in prof.events():
            if evt.device_type != torch.autograd.DeviceType.CUDA or "bitwise_not" in evt.name:
                continue
            total += evt.time_range.elapsed_us()
        return total / iters if total > 0 else None
    except Exception as err:  # the profiler is a nicety: fall back to the wall-clock column
        print(f"  profiler failed: {type(err).__name__}: {err}", file=sys.stderr)
        return None


@dataclass
class Row:
    kernel: str
    shape: str
    direction: str
    bytes: int
    cuda_us: float  # device time of the kernels (profiler), else wall time
    cuda_wall_us: float  # do_bench wall time of one call (includes host launch gaps)
    torch_us: float | None  # reference, device time
    compile_us: float | None  # torch.compile(reference), device time
    copy_frac: float = 0.0  # cuda bytes/s over the large copy's bytes/s

    @property
    def gbs(self) -> float:
        return self.bytes / (self.cuda_us * 1e-6) / 1e9


HEADER = (
    f"{'kernel':<24}{'shape':<20}{'pass':<5}{'MB':>8}{'cuda us':>9}{'GB/s':>7}{'%copy':>7}{'wall us':>9}"
    f"{'torch us':>10}{'compile us':>11}{'x torch':>8}{'x comp':>8}"
)


def format_row(r: Row) -> str:
    def us(v, w=9):
        return f"{v:{w}.1f}" if v is not None else " " * (w - 1) + "-"

    xt = f"{r.torch_us / r.cuda_us:8.2f}" if r.torch_us else "       -"
    xc = f"{r.compile_us / r.cuda_us:8.2f}" if r.compile_us else "       -"
    return (
        f"{r.kernel:<24}{r.shape:<20}{r.direction:<5}{r.bytes / 1e6:8.1f}{us(r.cuda_us)}{r.gbs:7.0f}"
        f"{100 * r.copy_frac:6.0f}%{us(r.cuda_wall_us)}{us(r.torch_us, 10)}{us(r.compile_us, 11)}{xt}{xc}"
    )


def _fwd_bwd(fn: Callable, make: Callable, grad_idx: tuple[int, ...]):
    """Forward and backward closures of ``fn`` on fresh inputs from ``make()``."""
    args = list(make())
    for i in grad_idx:
        args[i] = args[i].detach().requires_grad_()
    fwd = lambda: fn(*args)
    out = fwd()
    outs = out if isinstance(out, tuple) else (out,)  # several outputs: a gradient for each
    dys = [torch.randn_like(o) for o in outs]
    inputs = [args[i] for i in grad_idx]
    bwd = lambda: torch.autograd.grad(outs, inputs, dys, retain_graph=True)
    return fwd, bwd


def _times(fn: Callable) -> tuple[float, float | None]:
    wall = bench(fn) * 1e3
    return wall, kernel_us(fn)


def run_op(name, shape, cuda_fn, ref_fn, make, grad_idx, fwd_bytes, bwd_bytes, compile_ok) -> list[Row]:
    rows = []
    results = {}
    for label, fn in (
        ("cuda", cuda_fn),
        ("torch", ref_fn),
        ("compile", torch.compile(ref_fn) if compile_ok else None),
    ):
        if fn is None:
            results[label] = [None, None]
            continue
        try:
            fwd, bwd = _fwd_bwd(fn, make, grad_idx)
            results[label] = [_times(fwd), _times(bwd) if bwd_bytes else None]
        except Exception as err:  # keep the table going; report the failure
            print(f"  {name} {label}: failed: {type(err).__name__}: {err}", file=sys.stderr)
            results[label] = [None, None]
        torch.cuda.empty_cache()

    def device_us(label, k):
        t = results[label][k]
        return None if t is None else (t[1] if t[1] is not None else t[0])

    for k, (direction, nbytes) in enumerate((("fwd", fwd_bytes), ("bwd", bwd_bytes))):
        if not nbytes or results["cuda"][k] is None:
            continue
        rows.append(
            Row(
                name,
                shape,
                direction,
                nbytes,
                device_us("cuda", k),
                results["cuda"][k][0],
                device_us("torch", k),
                device_us("compile", k),
            )  # fmt: skip
        )
    return rows


def _randn(*shape, dtype=DT, scale=1.0):
    return torch.randn(*shape, device="cuda", dtype=torch.float32).mul_(scale).to(dtype)


class _Rows(list):
    """Rows that print themselves as they are added (a run cut short still reports what it measured)."""

    def __init__(self, copy_bw: float):
        super().__init__()
        self.copy_bw = copy_bw

    def __iadd__(self, new):
        for r in new:
            r.copy_frac = r.bytes / (r.cuda_us * 1e-6) / self.copy_bw
            print(format_row(r), flush=True)
            self.append(r)
        return self


def op_rows(ops, reference, compile_ok: bool, only: set[str] | None, copy_bw: float) -> list[Row]:
    e = 2  # bytes per bf16 element
    rows = _Rows(copy_bw)
    m, h = TOKENS, HIDDEN

    def want(name):
        return only is None or name in only

    def norm_inputs(with_bias: bool) -> Callable:
        def make():
            x, w = _randn(m, h), _randn(h, scale=0.1).add_(1)
            return (x, w, _randn(h, scale=0.1), 1e-5) if with_bias else (x, w, 1e-5)

        return make

    # The *_with_residual forms return (norm(x), x): their backward also reads the residual stream's
    # gradient and adds it to dx as it writes it (one more [m, h] read, no separate add kernel).
    for name, with_bias, bwd_tensors in (
        ("rms_norm", False, 3),
        ("layer_norm", True, 3),
        ("layer_norm_with_residual", True, 4),
        ("rms_norm_with_residual", False, 4),
    ):
        if want(name):
            rows += run_op(
                name, f"{m}x{h}", getattr(ops, name), getattr(reference, name), norm_inputs(with_bias),
                (0, 1, 2) if with_bias else (0, 1), 2 * m * h * e, bwd_tensors * m * h * e, compile_ok,
            )  # fmt: skip
    if want("rotary_embedding"):
        s, b, n, d = SEQ, BATCH, HEADS, HEAD_DIM
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
        ang = torch.outer(torch.arange(s, device="cuda", dtype=torch.float32), inv)
        freqs = torch.cat([ang, ang], -1).view(s, 1, 1, d)
        numel = s * b * n * d
        rows += run_op(
            "rotary", f"{s}x{b}x{n}x{d}", ops.rotary_embedding, reference.rotary_embedding,
            lambda: (_randn(s, b, n, d), freqs), (0,), 2 * numel * e, 2 * numel * e, compile_ok,
        )  # fmt: skip
    if want("swiglu"):
        f = FFN
        rows += run_op(
            "swiglu", f"{m}x2*{f}", ops.swiglu, reference.swiglu, lambda: (_randn(m, 2 * f),), (0,),
            3 * m * f * e, 5 * m * f * e, compile_ok,
        )  # fmt: skip
    if want("bias_gelu"):
        n4 = 4 * h
        rows += run_op(
            "bias_gelu", f"{m}x{n4}", ops.bias_gelu, reference.bias_gelu,
            lambda: (_randn(m, n4), _randn(n4), "tanh"), (0, 1), 2 * m * n4 * e, 3 * m * n4 * e, compile_ok,
        )  # fmt: skip
    if want("bias_dropout_add"):
        rows += run_op(
            "bias_dropout_add(eval)", f"{m}x{h}", ops.bias_dropout_add, reference.bias_dropout_add,
            lambda: (_randn(m, h), _randn(h), _randn(m, h), 0.1, False), (0, 1, 2),
            3 * m * h * e, m * h * e, compile_ok,
        )  # fmt: skip
        rows += run_op(
            "bias_dropout_add(p=0.1)", f"{m}x{h}", ops.bias_dropout_add, reference.bias_dropout_add,
            lambda: (_randn(m, h), _randn(h), _randn(m, h), 0.1, True), (0, 1, 2),
            3 * m * h * e, 2 * m * h * e, compile_ok,
        )  # fmt: skip
    if want("cross_entropy"):
        labels = torch.randint(0, VOCAB, (m,), device="cuda")
        rows += run_op(
            "cross_entropy", f"{m}x{VOCAB}", ops.cross_entropy, reference.cross_entropy,
            lambda: (_randn(m, VOCAB, scale=2.0), labels), (0,), m * VOCAB * e, 2 * m * VOCAB * e, compile_ok,
        )  # fmt: skip
    if want("adam_step"):
        rows += adam_rows(ops, reference, compile_ok)
        torch.cuda.empty_cache()
    return rows


def adam_rows(ops, reference, compile_ok: bool) -> list[Row]:
    shapes = [(4096, 4096)] * 12  # 201M fp32 parameters
    numel = sum(math.prod(s) for s in shapes)
    state = [[torch.randn(*s, device="cuda") * 0.01 for s in shapes] for _ in range(4)]
    for v in state[3]:
        v.abs_()
    params, grads, m, v = state
    hp = dict(step=10, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    nbytes = numel * 4 * 7  # read p, g, m, v; write p, m, v
    times = {}
    fns = {
        "cuda": lambda: ops.adam_step(params, grads, m, v, **hp),
        "torch": lambda: reference.adam_step(params, grads, m, v, **hp),
    }
    if compile_ok:
        compiled = torch.compile(getattr(reference.adam_step, "__wrapped__", reference.adam_step))
        fns["compile"] = lambda: compiled(params, grads, m, v, **hp)
    for label, fn in fns.items():
        try:
            wall = bench(fn, warmup=5, rep=50) * 1e3
            gpu = kernel_us(fn, iters=3)
            times[label] = (gpu if gpu is not None else wall, wall)
        except Exception as err:
            print(f"  adam_step {label}: failed: {type(err).__name__}: {err}", file=sys.stderr)
    return [
        Row(
            "adamw_step",
            "12x4096x4096 fp32",
            "step",
            nbytes,
            times["cuda"][0],
            times["cuda"][1],
            times.get("torch", (None,))[0],
            times.get("compile", (None,))[0],
        )
    ]


# --- sweep ----------------------------------------------------------------------------------------


def sweep(kernels: set[str] | None = None) -> list[dict]:
    """Time block-size variants of each Triton kernel (or only of ``kernels``, names as printed) at
    the benchmark shapes; print the best."""
    import triton
    from mcore.backends.cuda.triton_kernels import activations, cross_entropy, norms, rotary
    from mcore.backends.cuda.triton_kernels import swiglu as swiglu_kernels

    m, h = TOKENS, HIDDEN
    out = []

    def device_us(fn: Callable) -> float:
        # Kernel time (profiler) where it works: a wall-clock time would also count the host's launch
        # gaps, which exceed the kernels of the small ops and would hide their differences.
        us = kernel_us(fn, iters=20)
        return us if us is not None else bench(fn, warmup=10, rep=50) * 1e3

    def run(kernel: str, nbytes: int, fn_of_cfg: Callable, configs: list[dict]):
        if kernels is not None and kernel not in kernels:
            return
        best = None
        for cfg in configs:
            try:
                fn_of_cfg(dict(cfg))  # compile
                us = device_us(lambda cfg=cfg: fn_of_cfg(dict(cfg)))
            except Exception as err:
                print(f"  sweep {kernel} {cfg}: {type(err).__name__}: {str(err)[:200]}", file=sys.stderr)
                continue
            rec = {"kernel": kernel, "config": cfg, "us": us, "gbs": nbytes / (us * 1e-6) / 1e9}
            out.append(rec)
            if best is None or us < best["us"]:
                best = rec
        default = None
        try:
            default = device_us(lambda: fn_of_cfg(None))
        except Exception:
            pass
        if best:
            print(
                f"sweep {kernel:<14} best {best['config']} {best['us']:.1f} us {best['gbs']:.0f} GB/s; default {default:.1f} us",
                flush=True,
            )

    x = _randn(m, h)
    w = _randn(h).add_(1)
    dy = _randn(m, h)
    y, rstd = norms.rms_norm_fwd(x, w, 1e-5, DT)
    fwd_cfgs = [
        {"BLOCK_M": bm, "num_warps": nw}
        for bm in (1, 2, 4, 8)
        for nw in (4, 8, 16)
        if bm * h // (32 * nw) >= 4
    ]
    run("rms_fwd", 2 * m * h * 2, lambda c: norms.rms_norm_fwd(x, w, 1e-5, DT, c), fwd_cfgs)
    # The backward's times include its partial-sum launch (dweight/dbias), as in the table above.
    bwd_cfgs = norms._bwd_configs(triton.next_power_of_2(h))
    run("rms_bwd", 3 * m * h * 2, lambda c: norms.rms_norm_bwd(dy, x, w, rstd, c), bwd_cfgs)
    b = _randn(h, scale=0.1)
    _, mean, lrstd = norms.layer_norm_fwd(x, w, b, 1e-5)
    run(
        "ln_bwd",
        3 * m * h * 2,
        lambda c: norms.layer_norm_bwd(dy, x, w, True, mean, lrstd, c, bias_dtype=DT),
        bwd_cfgs,
    )
    # With the residual stream's gradient added to dx (the pre-norm layer's fused form): one more read.
    dres = _randn(m, h)
    res_cfgs = norms._bwd_configs(triton.next_power_of_2(h), with_residual=True)
    run("rms_bwd_res", 4 * m * h * 2, lambda c: norms.rms_norm_bwd(dy, x, w, rstd, c, dres2=dres), res_cfgs)
    run(
        "ln_bwd_res",
        4 * m * h * 2,
        lambda c: norms.layer_norm_bwd(dy, x, w, True, mean, lrstd, c, bias_dtype=DT, dres2=dres),
        res_cfgs,
    )
    seed = torch.randint(0, 2**31 - 1, (1,), device="cuda", dtype=torch.int64)
    _, keep = activations.bda_fwd(x, b, dy, 0.1, seed)
    bda_cfgs = activations._BDA_BWD_CONFIGS
    run("bda_bwd", 2 * m * h * 2, lambda c: activations.bda_bwd(dy, keep, 0.1, DT, c), bda_cfgs)
    run("bda_bwd_eval", m * h * 2, lambda c: activations.bda_bwd(dy, None, 0.1, DT, c), bda_cfgs)

    s, b, n, d = SEQ, BATCH, HEADS, HEAD_DIM
    q = _randn(s, b, n, d)
    f2 = torch.rand(s, d, device="cuda")
    rot_cfgs = [{"BLOCK_I": bi, "num_warps": nw} for bi in (4, 8, 16, 32, 64) for nw in (2, 4, 8)]
    run("rotary_fwd", 2 * q.numel() * 2, lambda c: rotary.rotary_apply(q, f2, 1, False, c), rot_cfgs)

    xs = _randn(m, 2 * FFN)
    dys = _randn(m, FFN)
    tile_cfgs = [
        {"BLOCK_N": bn, "BLOCK_M": bm, "num_warps": nw}
        for bn in (512, 1024, 2048)
        for bm in (1, 2, 4, 8)
        for nw in (4, 8)
        if 2048 <= bn * bm <= 16384
    ]
    run("swiglu_fwd", 3 * m * FFN * 2, lambda c: swiglu_kernels.swiglu_fwd(xs, c), tile_cfgs)
    run("swiglu_bwd", 5 * m * FFN * 2, lambda c: swiglu_kernels.swiglu_bwd(dys, xs, c), tile_cfgs)

    lg = _randn(m, VOCAB, scale=2.0)
    labels = torch.randint(0, VOCAB, (m,), device="cuda")
    loss, lse = cross_entropy.cross_entropy_fwd(lg, labels, 0.0)
    dl = torch.ones(m, device="cuda")
    ce_cfgs = [
        {"BLOCK_V": bv, "num_warps": nw}
        for bv in (1024, 2048, 4096, 8192, 16384)
        for nw in (4, 8, 16)
        if bv // (32 * nw) >= 2
    ]
    run("ce_fwd", m * VOCAB * 2, lambda c: cross_entropy.cross_entropy_fwd(lg, labels, 0.0, c), ce_cfgs)
    run(
        "ce_bwd",
        2 * m * VOCAB * 2,
        lambda c: cross_entropy.cross_entropy_bwd(dl, lg, labels, lse, 0.0, c),
        ce_cfgs,
    )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", action="store_true", help="also time block-size variants")
    parser.add_argument("--sweep-kernels", nargs="*", help="sweep only these kernels (e.g. ln_bwd_res)")
    parser.add_argument("--skip-compile", action="store_true", help="no torch.compile column")
    parser.add_argument("--only", nargs="*", help="op names to run (default: all)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2

    from mcore.ops import reference
    from mcore.plugins.manager import select_backend

    backend = select_backend("cuda", activate=False)
    ops = backend.ops
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}", flush=True)
    import triton

    print(
        f"triton {triton.__version__}; providers: " + ", ".join(f"{k}={e.provider}" for k, e in ops),
        flush=True,
    )
    copy_bw = copy_bandwidth(1 << 30)
    print(f"copy bandwidth (1 GiB, read+write): {copy_bw / 1e12:.2f} TB/s", flush=True)

    t0 = time.time()
    header = HEADER
    print("\n" + header, flush=True)  # rows stream as they finish; the table is repeated at the end
    rows = op_rows(ops, reference, not args.skip_compile, set(args.only) if args.only else None, copy_bw)
    sweep_out = sweep(set(args.sweep_kernels) if args.sweep_kernels else None) if args.sweep else []
    print(
        f"\nkernel micro-benchmarks on {props.name}; copy {copy_bw / 1e12:.2f} TB/s ({time.time() - t0:.0f} s)"
    )
    print("cuda/torch/compile us: device time of the kernels per call (profiler, L2 flushed); GB/s and")
    print(
        "%copy from the cuda column; wall us: do_bench wall time of one cuda call (host launch gaps included)"
    )
    print(header)
    for r in rows:
        print(format_row(r))
    from mcore.backends.cuda.triton_kernels import _common

    for (kernel, tag), tuner in _common._TUNERS.items():
        best = getattr(tuner, "best_config", None)
        print(f"autotuned {getattr(kernel, '__name__', kernel)} {tag}: {best}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "device": props.name,
                    "copy_bytes_per_s": copy_bw,
                    "rows": [dict(asdict(r), gbs=r.gbs) for r in rows],
                    "sweep": sweep_out,
                },
                fh,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
