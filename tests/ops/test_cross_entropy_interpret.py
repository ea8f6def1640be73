"""The CUDA backend's cross-entropy kernels under Triton's CPU interpreter.

A CPU-only check of ``backends/cuda/triton_kernels/cross_entropy.py``: the table op ``cross_entropy``
(forward and backward, ignore index, label smoothing) and the in-place cross-entropy's two ops
(``cross_entropy_local_stats``, ``cross_entropy_grad_inplace_``: strided rows, labels outside the
slice, int32 labels, several ``BLOCK_V`` chunks with a ragged last one, a stride-0 upstream
gradient), and ``vocab_parallel_cross_entropy(..., overwrite_logits=True)`` served by the CUDA
dispatchers, against :mod:`mcore.ops.reference` and ``F.cross_entropy`` in float64. The kernels run on
CPU tensors with ``TRITON_INTERPRET=1``, which must be on before Triton defines them, so the checks
run in a child process. It needs Triton installed (the ``test`` extra installs it, so CI runs it);
the GPU tests of ``test_cross_entropy_ops.py`` stay the kernels' real check.

By hand: ``OMP_NUM_THREADS=1 TRITON_INTERPRET=1 python tests/ops/test_cross_entropy_interpret.py``.
"""

from __future__ import annotations

import os
import sys

from mcore.testing.interpreter import interpreter_child, needs_triton, run_under_interpreter


@needs_triton
@interpreter_child()
def test_cross_entropy_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _main() -> int:
    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F
    from mcore.backends.cuda import ops as cuda_ops
    from mcore.backends.cuda.triton_kernels import cross_entropy as kernels

    from mcore.ops import reference
    from mcore.tensor_parallel import cross_entropy as ce

    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.manual_seed(0)
    # bf16: the interpreter rounds fp32 -> bf16 by truncation (two roundings' worth)
    bound = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}
    failures = []

    def expect(name, errors, tol):
        print(name, " ".join(f"{e:.1e}" for e in errors))
        if not all(e <= tol for e in errors):
            failures.append(f"{name}: {errors} > {tol}")

    small_blocks = {"BLOCK_V": 64, "num_warps": 1}  # 300 columns: 5 chunks, the last one ragged
    for (m, v), dt, cfg, smoothing in [
        ((13, 300), torch.float32, small_blocks, 0.0),
        ((13, 300), torch.bfloat16, small_blocks, 0.1),
        ((6, 1000), torch.bfloat16, None, 0.0),
    ]:
        tag = f"{m}x{v} {dt} smoothing={smoothing} {cfg}"
        padded = (torch.randn(m, v + 24) * 4).to(dt)
        logits = padded[:, :v]  # rows of stride v + 24
        labels = torch.randint(0, v, (m,))
        outside = torch.arange(m) % 3 == 0
        local = labels.masked_fill(outside, 0)

        # the table op cross_entropy, forward and backward (the row walk it shares with the others)
        with_ignore = labels.clone()
        with_ignore[1] = -100
        loss, lse = kernels.cross_entropy_fwd(logits, with_ignore, smoothing, cfg)
        x = logits.double().requires_grad_()
        gold = F.cross_entropy(x, with_ignore, reduction="none", label_smoothing=smoothing)
        dloss = torch.rand(m)
        (gold_grad,) = torch.autograd.grad(gold, x, dloss.double())
        dlogits = kernels.cross_entropy_bwd(dloss, logits, with_ignore, lse, smoothing, cfg)
        expect(f"cross_entropy {tag}", [_rel(loss, gold), _rel(dlogits, gold_grad)], bound[dt])

        # local statistics, int64 and int32 labels
        want = reference.cross_entropy_local_stats(logits, local, outside, smoothing > 0)
        for labels_dtype in (torch.int64, torch.int32):
            got = kernels.cross_entropy_local_stats(
                logits, local.to(labels_dtype), outside, smoothing > 0, cfg
            )
            if (got[2] is None) != (want[2] is None):
                failures.append(f"local stats {tag}: sum {got[2]} vs {want[2]}")
            errors = [_rel(g, w) for g, w in zip(got, want) if w is not None]
            expect(f"cross_entropy_local_stats {labels_dtype} {tag}", errors, 2e-6)
            if not torch.equal(got[1][outside], torch.zeros(int(outside.sum()))):
                failures.append(f"local stats {tag}: predicted logit not 0 outside the slice")

        # the in-place gradient: a global logZ above the local one, as with other ranks
        log_z = want[0] + torch.rand(m)
        upstream = torch.rand(m) + 0.5
        expected = reference.cross_entropy_grad_inplace_(
            logits.clone(), local, outside, log_z, upstream, smoothing, 3 * v
        )
        keep = padded[:, v:].clone()
        ptr = logits.data_ptr()
        got = kernels.cross_entropy_grad_inplace_(
            logits, local, outside, log_z, upstream, smoothing, 3 * v, cfg
        )
        if not (got is logits and got.data_ptr() == ptr and torch.equal(padded[:, v:], keep)):
            failures.append(f"grad in place {tag}: not written in place, or past the slice")
        expect(f"cross_entropy_grad_inplace_ {tag}", [_rel(got, expected)], bound[dt])

    # the fused loss through the CUDA dispatchers (Triton on CPU tensors under the interpreter)
    table = SimpleNamespace(**cuda_ops.ALL_OPS)
    ce.get_ops = lambda: table
    calls = {}

    def counted(fn):
        def wrapper(*args, **kwargs):
            calls[fn.__name__] = calls.get(fn.__name__, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    kernels.cross_entropy_local_stats = counted(kernels.cross_entropy_local_stats)
    kernels.cross_entropy_grad_inplace_ = counted(kernels.cross_entropy_grad_inplace_)
    for dt, smoothing in [(torch.float32, 0.0), (torch.float32, 0.1), (torch.bfloat16, 0.1)]:
        logits = (torch.randn(4, 5, 700) * 3).to(dt)
        labels = torch.randint(0, 700, (4, 5))
        leaf = logits.clone().requires_grad_()
        z = leaf * 1
        seen = {}
        z.register_hook(lambda g, z=z, seen=seen: seen.update(in_place=g.data_ptr() == z.data_ptr()))
        loss = ce.vocab_parallel_cross_entropy(z, labels, None, smoothing, overwrite_logits=True)
        loss.sum().backward()  # a stride-0 upstream gradient
        x = logits.double().requires_grad_()
        gold = F.cross_entropy(x.view(-1, 700), labels.view(-1), reduction="none", label_smoothing=smoothing)
        gold.sum().backward()
        tag = f"fused loss {dt} smoothing={smoothing}"
        expect(tag, [_rel(loss.view(-1), gold), _rel(leaf.grad, x.grad)], bound[dt])
        if not seen.get("in_place"):
            failures.append(f"{tag}: the gradient is not the logits' storage")

    if calls != {"cross_entropy_local_stats": 3, "cross_entropy_grad_inplace_": 3}:
        failures.append(f"the dispatchers did not run the kernels: {calls}")

    if failures:
        print("FAILED:\n" + "\n".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(_main())
