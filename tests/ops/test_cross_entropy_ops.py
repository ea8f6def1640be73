"""The in-place cross-entropy's two ops: ``cross_entropy_local_stats`` and ``cross_entropy_grad_inplace_``.

``--cross-entropy-loss-fusion`` (``vocab_parallel_cross_entropy(..., overwrite_logits=True)``) reduces
each rank's logits to per-row statistics with the first op, all-reduces them, and writes the gradient
into the logits with the second. Here the reference ops, composed as mcore composes them (at TP=1 and
over a vocabulary split in three slices in one process), give ``torch.nn.functional.cross_entropy``'s
loss and gradient (float64 gold) in fp32 and bf16, with and without label smoothing, on strided rows
and over several row chunks, and the gradient is the logits' own storage. An ignore index (-100) keeps
the behaviour the fused loss always had: outside every slice, loss ``logZ``, gradient the softmax.

The tests marked ``needs a CUDA device`` check the CUDA backend's Triton kernels against the
reference at training-sized shapes, the fused loss through them, and its memory; the Triton
interpreter covers the same kernels on CPU in ``test_cross_entropy_interpret.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from mcore.ops import reference
from mcore.ops.reference import loss as reference_loss
from mcore.tensor_parallel import cross_entropy as ce

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
BACKEND = os.environ.get("MCORE_TEST_BACKEND", "cpu")
BOUND = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
"""Max error of the gradient over its max magnitude (half precisions: one rounding of it)."""


def _inputs(rows, vocab, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    upstream = torch.rand(rows, generator=gen) + 0.25
    return logits.to(device), labels.to(device), upstream.to(device)


def _gold(logits, labels, upstream, smoothing):
    x = logits.double().requires_grad_()
    loss = F.cross_entropy(x, labels, reduction="none", label_smoothing=smoothing)
    (loss * upstream.double()).sum().backward()
    return loss.detach(), x.grad


def _split_loss_and_grad(ops, logits, labels, upstream, smoothing, parts=1):
    """The fused loss as ``_TableCrossEntropy`` composes the two ops, with the all-reduces of
    ``parts`` ranks done by hand; returns the loss, the gradient slices and whether each was written
    into its logits' storage."""
    vocab = logits.shape[-1]
    slices = [s.clone() for s in logits.chunk(parts, dim=-1)]
    local = []
    start = 0
    for z in slices:
        outside = (labels < start) | (labels >= start + z.shape[1])
        local_labels = (labels - start).masked_fill(outside, 0)
        local.append(
            (local_labels, outside, *ops.cross_entropy_local_stats(z, local_labels, outside, smoothing > 0))
        )
        start += z.shape[1]
    global_max = torch.stack([s[2] for s in local]).max(0).values
    total = sum((s[2] - global_max).exp() for s in local)
    log_z = global_max + total.log()
    loss = log_z - sum(s[3] for s in local)
    if smoothing > 0:
        loss = (1 - smoothing) * loss + smoothing * (log_z - sum(s[4] for s in local) / vocab)
    grads, in_place = [], []
    for z, (local_labels, outside, *_) in zip(slices, local):
        ptr = z.data_ptr()
        g = ops.cross_entropy_grad_inplace_(z, local_labels, outside, log_z, upstream, smoothing, vocab)
        grads.append(g)
        in_place.append(g.data_ptr() == ptr and g is z)
    return loss, torch.cat(grads, dim=-1), in_place


def _check(loss, grad, gold_loss, gold_grad, dtype):
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss.double(), gold_loss, rtol=2e-6, atol=2e-6)
    error = (grad.double() - gold_grad).abs().max().item() / gold_grad.abs().max().item()
    assert error <= BOUND[dtype], error


# --- the reference ops on the CPU -----------------------------------------------------------------


@pytest.mark.parametrize("parts", [1, 3], ids=["tp1", "vocab_in_3"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_ops_give_torch_loss_and_gradient_in_place(dtype, smoothing, parts):
    logits, labels, upstream = _inputs(23, 96, dtype)
    gold_loss, gold_grad = _gold(logits, labels, upstream, smoothing)
    loss, grad, in_place = _split_loss_and_grad(reference, logits, labels, upstream, smoothing, parts)
    _check(loss, grad, gold_loss, gold_grad, dtype)
    assert all(in_place), "the gradient was not written into the logits' storage"


def test_reference_ops_over_row_chunks_and_strided_rows(monkeypatch):
    monkeypatch.setattr(reference_loss, "_CE_CHUNK_ELEMENTS", 4 * 50)  # 4 rows a chunk
    padded, labels, upstream = _inputs(19, 64, torch.bfloat16)
    logits = padded[:, :50]  # rows of stride 64, last dim contiguous
    keep = padded[:, 50:].clone()
    labels = labels % 50
    outside = labels == 7  # a few labels "on another rank"
    local_labels = labels.masked_fill(outside, 0)
    log_z, predicted, sum_z = reference.cross_entropy_local_stats(logits, local_labels, outside, True)
    wide = logits.float()
    torch.testing.assert_close(log_z, torch.logsumexp(wide, -1))
    want = wide.gather(-1, local_labels[:, None]).squeeze(-1).masked_fill(outside, 0.0)
    assert torch.equal(predicted, want)
    torch.testing.assert_close(sum_z, wide.sum(-1))
    assert log_z.dtype == predicted.dtype == sum_z.dtype == torch.float32
    assert reference.cross_entropy_local_stats(logits, local_labels, outside)[2] is None

    global_log_z = log_z + 0.5  # as if the other ranks held half of the mass again
    got = reference.cross_entropy_grad_inplace_(
        logits, local_labels, outside, global_log_z, upstream, 0.1, 100
    )
    assert got is logits
    want = torch.softmax(wide, -1) * torch.exp(log_z - global_log_z)[:, None]
    want[torch.arange(19), local_labels] -= 0.9 * (~outside).float()
    want = (want - 0.1 / 100) * upstream[:, None]
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(padded[:, 50:], keep), "the columns past the slice were written"


def test_reference_local_stats_in_float64():
    logits, labels, _ = _inputs(5, 33, torch.float64)
    outside = torch.zeros(5, dtype=torch.bool)
    log_z, predicted, _ = reference.cross_entropy_local_stats(logits, labels, outside)
    assert log_z.dtype == torch.float64
    torch.testing.assert_close(log_z, torch.logsumexp(logits, -1), rtol=1e-12, atol=1e-12)
    assert torch.equal(predicted, logits.gather(-1, labels[:, None]).squeeze(-1))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_ignore_index_keeps_the_fused_loss_behaviour(smoothing):
    """-100 is outside every slice: loss ``logZ`` (smoothing: ``logZ - e mean z``), gradient the softmax
    (minus ``e/V``), times dloss; the model's loss mask zeroes those rows' upstream gradient."""
    logits, labels, upstream = _inputs(12, 40, torch.float32)
    labels[::3] = -100
    leaf = logits.clone().requires_grad_()
    loss = ce.vocab_parallel_cross_entropy(leaf * 1, labels, None, smoothing, overwrite_logits=True)
    (loss * upstream).sum().backward()
    ignored = labels == -100
    lse = torch.logsumexp(logits, -1)
    want = lse - smoothing * logits.mean(-1)
    torch.testing.assert_close(loss[ignored], want[ignored])
    want_grad = (torch.softmax(logits, -1) - smoothing / 40) * upstream[:, None]
    torch.testing.assert_close(leaf.grad[ignored], want_grad[ignored])
    gold_loss, gold_grad = _gold(logits[~ignored], labels[~ignored], upstream[~ignored], smoothing)
    torch.testing.assert_close(loss[~ignored].double(), gold_loss, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(leaf.grad[~ignored].double(), gold_grad, rtol=1e-5, atol=1e-6)


def test_cuda_dispatchers_fall_back_to_the_reference_on_cpu_tensors(monkeypatch):
    from mcore.backends.cuda import device as cuda_device
    from mcore.backends.cuda import ops as cuda_ops

    # under TRITON_INTERPRET the dispatchers would run the Triton kernels on CPU tensors: not this test
    monkeypatch.setattr(cuda_device, "INTERPRET", False)
    logits, labels, upstream = _inputs(9, 50, torch.float32)
    outside = labels > 40
    local = labels.masked_fill(outside, 0)
    got = cuda_ops.cross_entropy_local_stats(logits, local, outside, True)
    want = reference.cross_entropy_local_stats(logits, local, outside, True)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    a, b = logits.clone(), logits.clone()
    cuda_ops.cross_entropy_grad_inplace_(a, local, outside, want[0] + 0.1, upstream, 0.1, 100)
    reference.cross_entropy_grad_inplace_(b, local, outside, want[0] + 0.1, upstream, 0.1, 100)
    assert torch.equal(a, b)


@pytest.fixture(scope="module")
def backend():
    from mcore.plugins.manager import select_backend

    return select_backend(BACKEND, activate=False)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_ops_give_torch_loss_and_gradient(backend, dtype, smoothing):
    logits, labels, upstream = _inputs(31, 1000, dtype, backend.device())
    gold_loss, gold_grad = _gold(logits, labels, upstream, smoothing)
    loss, grad, in_place = _split_loss_and_grad(backend.ops, logits, labels, upstream, smoothing, parts=2)
    _check(loss, grad, gold_loss, gold_grad, dtype)
    assert all(in_place)


# --- the CUDA backend's kernels on a GPU ---------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_backend():
    from mcore.plugins.manager import select_backend

    return select_backend("cuda", activate=False)


@needs_cuda
def test_cuda_providers(cuda_backend):
    from mcore.backends.cuda import extensions

    expected = "cuda:triton" if extensions.triton_available() else "reference"
    for op in ("cross_entropy_local_stats", "cross_entropy_grad_inplace_"):
        assert cuda_backend.ops.provider(op) == expected, op


@needs_cuda
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_cuda_kernels_match_the_reference(cuda_backend, dtype, smoothing):
    pytest.importorskip("triton")
    from mcore.backends.cuda.triton_kernels import cross_entropy as kernels

    gen = torch.Generator().manual_seed(0)
    rows, width = 2048, 25152  # one rank's half of a 50304 vocabulary
    padded = (torch.randn(rows, width + 64, generator=gen) * 4).to(dtype).cuda()
    logits = padded[:, :width]  # strided rows
    labels = torch.randint(0, width, (rows,), generator=gen).cuda()
    outside = torch.rand(rows, generator=gen).cuda() < 0.5
    local = labels.masked_fill(outside, 0)
    got = kernels.cross_entropy_local_stats(logits, local, outside, smoothing > 0)
    want = reference.cross_entropy_local_stats(logits, local, outside, smoothing > 0)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-3)
    log_z = want[0] + torch.rand(rows, device="cuda")
    dloss = torch.rand(rows, device="cuda")
    ref = logits.clone()
    ptr = padded.data_ptr()
    kernels.cross_entropy_grad_inplace_(logits, local, outside, log_z, dloss, smoothing, 2 * width)
    reference.cross_entropy_grad_inplace_(ref, local, outside, log_z, dloss, smoothing, 2 * width)
    assert padded.data_ptr() == ptr
    rel = (logits.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert rel <= {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype], rel.item()


def _use_backend(backend):
    from mcore.backend import set_current_backend

    return set_current_backend(backend)


@needs_cuda
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cuda_fused_loss_matches_torch_and_keeps_only_the_logits(cuda_backend, smoothing):
    pytest.importorskip("triton")
    rows, vocab = 4096, 50304
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(torch.bfloat16).cuda()
    labels = torch.randint(0, vocab, (rows,), generator=gen).cuda()
    upstream = torch.rand(rows, generator=gen).cuda()
    gold_loss, gold_grad = _gold(logits, labels, upstream, smoothing)
    previous = _use_backend(cuda_backend)
    try:
        leaf = logits.clone().requires_grad_()
        z = leaf * 1
        seen = {}
        ptr = z.data_ptr()
        z.register_hook(lambda g: seen.update(in_place=g.data_ptr() == ptr))
        logits_bytes = z.numel() * z.element_size()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = ce.vocab_parallel_cross_entropy(z, labels, None, smoothing, overwrite_logits=True)
        fwd_peak = torch.cuda.max_memory_allocated() - base
        (loss * upstream).sum().backward()
    finally:
        _use_backend(previous)
    assert seen["in_place"]
    assert fwd_peak < 0.01 * logits_bytes, fwd_peak  # per-row statistics only
    torch.testing.assert_close(loss.double(), gold_loss, rtol=1e-5, atol=1e-5)
    error = (leaf.grad.double() - gold_grad).abs().max().item() / gold_grad.abs().max().item()
    assert error <= BOUND[torch.bfloat16], error
