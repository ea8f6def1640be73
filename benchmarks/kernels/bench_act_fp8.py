"""The MLP activation fused with its FP8 cast (``act_fp8_forward``/``act_fp8_backward``) on one GPU.

Against the unfused CUDA path it replaces (the delayed recipe: a given scale, the amax recorded):

* forward: the activation kernel (``bias_gelu`` / ``swiglu``) writing ``y`` in bf16, then the
  ``fp8_cast`` kernel reading it back and writing ``q`` and ``qT``;
* backward: the activation's backward kernel writing ``dh`` (and the GeLU bias gradient), then
  ``fp8_cast`` of ``dh`` to ``q`` and ``qT``.

Shapes: GeLU (exact and tanh) ``h [8192, 8192]`` with a bias (the 24L h2048 GPT's fc1 output, 4 x
2048 tokens), SwiGLU ``h [8192, 8192]`` and ``h [4096, 28672]`` without one (a Llama-style fc1 output,
``F = 14336``); bf16, e4m3 forward and e5m2 backward (the hybrid format). Also timed: the unfused
path's two kernels apart (``act``: the activation kernel; ``cast``: ``fp8_cast``), and with
``--split`` the fused kernels with the activation replaced by the identity (``y = t``, ``dy/dt = 1``;
the same loads, quantization, amax and stores), which splits a fused kernel's time into its memory
and FP8 work and the activation's arithmetic. Bytes are the fewest the work must move (each input read
once, each FP8 output written once; the unfused path also writes and reads the bf16 tensor), so
``GB/s`` of the fused kernel compares with the copy bandwidth measured in the same run. Times:
medians of ``triton.testing.do_bench`` (L2 flushed). The fused and unfused FP8 bytes and amaxes are
checked identical before timing.

    python benchmarks/kernels/bench_act_fp8.py [--sweep] [--split] [--json FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

SHAPES = [
    ("gelu", 8192, 8192, True),
    ("gelu_tanh", 8192, 8192, True),
    ("swiglu", 8192, 8192, False),
    ("swiglu", 4096, 28672, False),
]
"""(kind, M, width of h, bias)."""


def _identity_act_fp8():
    """A copy of :mod:`act_fp8` whose GeLU is the identity (``--split``): its source with the import
    of ``_gelu_and_grad`` replaced, loaded from a temporary file (Triton reads a kernel's source)."""
    import importlib.util
    import inspect
    import tempfile

    from mcore.backends.cuda.triton_kernels import act_fp8

    src = inspect.getsource(act_fp8)
    old = "from .activations import _gelu_and_grad\n"
    assert old in src, "act_fp8 no longer imports _gelu_and_grad as the benchmark expects"
    src = src.replace(
        old,
        "\n\n@triton.jit\ndef _gelu_and_grad(t, TANH: tl.constexpr, NEED_GRAD: tl.constexpr):\n"
        "    return t, t * 0.0 + 1.0\n\n\n",
    )
    path = tempfile.mkdtemp() + "/_act_fp8_identity.py"
    with open(path, "w") as fh:
        fh.write(src)
    spec = importlib.util.spec_from_file_location(
        "mcore.backends.cuda.triton_kernels._act_fp8_identity", path
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _same(a, b) -> bool:
    return (a is None and b is None) or torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


def _bench_kind(kind, m, width, has_bias, sweep, record, identity=None) -> None:
    from mcore.backends.cuda.triton_kernels import act_fp8, activations
    from mcore.backends.cuda.triton_kernels import fp8_cast as cast_kernels
    from mcore.backends.cuda.triton_kernels import swiglu as swiglu_kernels

    dev = torch.device("cuda")
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    swiglu = kind == "swiglu"
    f = width // 2 if swiglu else width
    gen = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(m, width, device=dev, generator=gen).to(torch.bfloat16)
    bias = torch.randn(width, device=dev, generator=gen).to(torch.bfloat16) if has_bias else None
    dy = torch.randn(m, f, device=dev, generator=gen).to(torch.bfloat16)
    s_fwd, s_bwd = torch.tensor(40.0, device=dev), torch.tensor(3000.0, device=dev)
    amax_f, amax_u = torch.zeros(1, device=dev), torch.zeros(1, device=dev)

    def fused_fwd(cfg=None):
        return act_fp8.act_fp8_forward(h, bias, kind, e4m3, s_fwd, amax_f, config=cfg)

    tanh = kind == "gelu_tanh"

    def act_fwd():
        if swiglu:
            return swiglu_kernels.swiglu_fwd(h if bias is None else h + bias)
        return activations.bias_gelu_fwd(h, bias, tanh)

    def unfused_fwd():
        return cast_kernels.cast(act_fwd(), e4m3, scale=s_fwd, columnwise=True, amax_record=amax_u)

    def fused_bwd(cfg=None):
        return act_fp8.act_fp8_backward(dy, h, bias, kind, e5m2, s_bwd, amax_f, config=cfg)

    def act_bwd():
        if swiglu:
            return swiglu_kernels.swiglu_bwd(dy, h), None
        return activations.bias_gelu_bwd(dy, h, bias, tanh)

    def unfused_bwd():
        dh, db = act_bwd()
        return (*cast_kernels.cast(dh, e5m2, scale=s_bwd, columnwise=True, amax_record=amax_u), db)

    y_act, dh_act = act_fwd(), act_bwd()[0]

    def cast_fwd():
        return cast_kernels.cast(y_act, e4m3, scale=s_fwd, columnwise=True, amax_record=amax_u)

    def cast_bwd():
        return cast_kernels.cast(dh_act, e5m2, scale=s_bwd, columnwise=True, amax_record=amax_u)

    def ident_fwd():
        return identity.act_fp8_forward(h, bias, kind, e4m3, s_fwd, amax_f)

    def ident_bwd():
        return identity.act_fp8_backward(dy, h, bias, kind, e5m2, s_bwd, amax_f)

    for what, fused, unfused, act, cast, ident in (
        ("forward", fused_fwd, unfused_fwd, act_fwd, cast_fwd, ident_fwd),
        ("backward", fused_bwd, unfused_bwd, act_bwd, cast_bwd, ident_bwd),
    ):
        amax_f.zero_(), amax_u.zero_()
        got, want = fused(), unfused()
        torch.cuda.synchronize()
        same = all(_same(g, w) for g, w in zip(got[:3], want[:3])) and torch.equal(amax_f, amax_u)
        db_note = ""
        if what == "backward" and got[3] is not None:
            err = (got[3].float() - want[3].float()).abs().max().item()
            db_note = f", dbias {'identical' if torch.equal(got[3], want[3]) else f'max diff {err:.3g}'}"
        print(f"{kind} {what}: q/qT/scale_inv/amax {'identical' if same else 'DIFFER'}{db_note}")
        assert same, f"{kind} {what}: the fused kernel's bytes differ from the unfused path's"
        nbytes_in = h.numel() * 2 + (dy.numel() * 2 if what == "backward" else 0)
        n_out = (m * f) if what == "forward" else h.numel()  # FP8 elements, written twice (q, qT)
        fused_moved = nbytes_in + 2 * n_out
        unfused_moved = fused_moved + 2 * (n_out * 2)  # + the bf16 tensor written and read back
        name = f"{kind} {what} [{m}, {width}]"
        t_fused = bench(fused)
        t_unfused = bench(unfused)
        record(name, "fused", t_fused, fused_moved)
        record(name, "unfused (act + fp8_cast)", t_unfused, unfused_moved)
        bf16_out = 2 * n_out
        record(name, "unfused: act", bench(act), nbytes_in + bf16_out)
        record(name, "unfused: cast", bench(cast), bf16_out + 2 * n_out)
        if identity is not None and not swiglu:
            record(name, "fused, identity activation", bench(ident), fused_moved)
        print(f"{name:34s} speed-up {t_unfused / t_fused:.2f}x")
        if sweep:
            if what == "forward":
                # the autotuned tiles, then ones that lost on an H100 (see act_fp8._FWD_CONFIGS)
                cfgs = act_fp8._FWD_CONFIGS + [
                    {"BLOCK_M": bm, "BLOCK_F": bf, "num_warps": 8, "PER_SM": per_sm}
                    for bm, bf in ((128, 128), (32, 256), (64, 256))
                    for per_sm in (0, act_fp8.PROGRAMS_PER_SM)
                ]
            else:
                cfgs = act_fp8._BWD_CONFIGS + [{"BLOCK_M": 32, "BLOCK_F": 256, "num_warps": 8, "PER_SM": 8}]
            for cfg in cfgs:
                ms = bench(lambda cfg=cfg, fused=fused: fused(cfg))
                record(name, "sweep " + " ".join(f"{k}={v}" for k, v in cfg.items()), ms, fused_moved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--sweep", action="store_true", help="also time tile shapes of the fused kernels")
    parser.add_argument(
        "--split", action="store_true", help="also time the fused GeLU kernels with an identity activation"
    )
    parser.add_argument("--kinds", default=None, help="comma-separated kinds to run (default: all)")
    args = parser.parse_args()

    dev = torch.device("cuda")
    copy_src = torch.empty(1 << 29, dtype=torch.uint8, device=dev)
    copy_dst = torch.empty_like(copy_src)
    copy_gbs = 2 * copy_src.numel() / bench(lambda: copy_dst.copy_(copy_src)) / 1e6
    print(f"copy bandwidth (read + write) {copy_gbs:.0f} GB/s  ({torch.cuda.get_device_name()})")
    rows = []

    def record(name, path, ms, moved):
        row = {"case": name, "path": path, "ms": ms, "GB/s": moved / ms / 1e6, "copy_GB/s": copy_gbs}
        rows.append(row)
        print(
            f"{name:34s} {path:28s} {ms * 1e3:8.1f} us {row['GB/s']:6.0f} GB/s ({row['GB/s'] / copy_gbs:.0%} of copy)"
        )

    identity = _identity_act_fp8() if args.split else None
    for kind, m, width, has_bias in SHAPES:
        if args.kinds is None or kind in args.kinds.split(","):
            _bench_kind(kind, m, width, has_bias, args.sweep, record, identity)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
