"""Gradient-accumulation fusion (``--no-gradient-accumulation-fusion`` turns it off).

With fusion the linear layers add their weight gradient into ``main_grad`` inside the backward GEMM
and the DDP hook drops the placeholder gradient. On CPU with fp32 parameters the gradient buffer has
the weights' dtype, so fusion is active here. Every check compares the gradient buffers after
several micro-batches (``no_sync`` for all but the last) with the same model trained without fusion
and with plain autograd (no DDP wrapper): untied and tied embeddings, TP=2 with and without sequence
parallelism, DP=2 with overlapped bucket reduction, and a compiled transformer layer. Fusion must
step aside (ordinary gradients) when ``main_grad`` has another dtype or does not exist.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mcore.config.cli import build_parser, parse_config
from mcore.config.parallel import ParallelConfig
from mcore.distributed.ddp import DDPConfig, DistributedDataParallel
from mcore.distributed.finalize import finalize_model_grads
from mcore.distributed.groups import ProcessGroups, initialize_parallel
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.build_context import default_device
from mcore.models.transformer.model_config import ModelConfig
from mcore.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    linear_with_grad_accumulation_fusion,
)
from mcore.testing.distributed import run_distributed
from mcore.testing.distributed import test_backend_name as selected_backend_name

SEQ, MBS, VOCAB, NUM_MICRO = 8, 2, 64, 4
MODEL = dict(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=4,
    seq_length=SEQ,
    max_position_embeddings=SEQ,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
TIGHT = dict(rtol=1e-6, atol=1e-7)  # fp32, the same math up to the order of two additions


def _micro_batches(dp_rank: int = 0, dp_size: int = 1):
    """This data-parallel rank's share of ``NUM_MICRO`` micro-batches ``(tokens, labels)`` [MBS, SEQ]."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (NUM_MICRO, MBS, SEQ + 1), generator=gen)
    per_rank = NUM_MICRO // dp_size
    mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank].to(default_device())
    return [(t[:, :-1], t[:, 1:]) for t in mine]


def _gpt_grads(
    groups,
    *,
    fusion=True,
    wrap=True,
    sp=False,
    untie=False,
    overlap=False,
    bucket=None,
    recompute=False,
    compile_backend=None,
):
    """Logical gradients (TP shards merged) after accumulating this rank's micro-batches, the
    placeholder flags by parameter name, and which buckets started reducing during backward."""
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = ModelConfig(
        **MODEL,
        gradient_accumulation_fusion=fusion,
        untie_embeddings_and_output_weights=untie,
        **(extra if recompute else {}),
    )
    module = GPTModel(config, groups, VOCAB, sequence_parallel=sp)
    if compile_backend is not None:
        for layer in module.decoder.layers:
            layer.compile(fullgraph=True, dynamic=False, backend=compile_backend)
    model = module
    if wrap:
        model = DistributedDataParallel(
            module, DDPConfig(overlap_grad_reduce=overlap, ddp_bucket_size=bucket), groups
        )
    batches = _micro_batches(groups.dp_rank, groups.dp_size)
    for i, (tokens, labels) in enumerate(batches):
        sync = contextlib.nullcontext() if not wrap or i == len(batches) - 1 else model.no_sync()
        with sync:
            loss = model(tokens, labels=labels).float().mean() / len(batches)
            loss.backward()
    started = None
    if wrap:
        started = [b.grad_started for b in model.buckets]
        finalize_model_grads([model], groups)
    params = dict(module.named_parameters())
    grads, flags = {}, {}
    for name, spec in module.sharded_parameters().items():
        param = params[name]
        grad = (param.main_grad if wrap else param.grad).detach().clone()
        if groups.tp_size > 1:
            parts = [torch.empty_like(grad) for _ in range(groups.tp_size)]
            dist.all_gather(parts, grad.contiguous(), group=groups.tp)
            grad = spec.merge(parts)
        grads[spec.name] = grad.cpu()
        flags[name] = getattr(param, "grad_added_to_main_grad", None)
        if wrap:
            assert param.grad is None, name
    return grads, flags, started


def _assert_grads_close(actual, expected, **tolerance):
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, **tolerance, msg=lambda m, n=name: f"{n}: {m}")


def _is_linear_weight(name: str) -> bool:
    return name.endswith("weight") and any(
        part in name for part in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")
    )


# -- one process -------------------------------------------------------------------------------------


@pytest.mark.parametrize("untie", [True, False], ids=["untied", "tied"])
def test_fused_main_grads_equal_unfused_and_autograd(untie):
    single = ProcessGroups.single()
    reference, _, _ = _gpt_grads(single, wrap=False, untie=untie)
    unfused, unfused_flags, _ = _gpt_grads(single, fusion=False, untie=untie)
    fused, fused_flags, _ = _gpt_grads(single, fusion=True, untie=untie)

    _assert_grads_close(unfused, reference, rtol=0, atol=0)  # the same additions in the same order
    _assert_grads_close(fused, reference, **TIGHT)
    _assert_grads_close(fused, unfused, **TIGHT)
    for name, value in reference.items():
        assert value.abs().sum() > 0, name  # every parameter got a gradient

    assert not any(unfused_flags.values())
    fused_weights = {n for n, flag in fused_flags.items() if flag}
    assert fused_weights == {n for n in fused_flags if _is_linear_weight(n)}
    assert len(fused_weights) == 4 * MODEL["num_layers"] + untie
    if not untie:
        # the tied word embedding: the output layer fused its part, the embedding's arrived as a grad
        assert fused_flags["embedding.word_embeddings.weight"] is False
        assert "output_layer.weight" not in fused_flags


def test_fusion_under_full_recompute():
    single = ProcessGroups.single()
    reference, _, _ = _gpt_grads(single, wrap=False, recompute=True)
    fused, flags, _ = _gpt_grads(single, recompute=True)
    _assert_grads_close(fused, reference, **TIGHT)
    assert flags["decoder.layers.0.mlp.linear_fc1.weight"] is True


def test_fusion_in_compiled_layers():
    """--compile-layers: dynamo traces the autograd Function (fullgraph: no break) and the forward's
    flag write; the compiled backward accumulates into main_grad."""
    single = ProcessGroups.single()
    reference, _, _ = _gpt_grads(single, wrap=False)
    compiled, flags, _ = _gpt_grads(single, compile_backend="aot_eager")
    _assert_grads_close(compiled, reference, rtol=1e-5, atol=1e-6)
    assert all(flags[n] for n in flags if _is_linear_weight(n))


# -- fusion steps aside ------------------------------------------------------------------------------


class _ColumnRow(torch.nn.Module):
    """A column-parallel and a row-parallel linear on a [s, b, h] input."""

    def __init__(self, fusion: bool, dtype: torch.dtype):
        super().__init__()
        self.fc1 = ColumnParallelLinear(
            6, 8, gradient_accumulation_fusion=fusion, params_dtype=dtype, device=torch.device("cpu")
        )
        self.fc2 = RowParallelLinear(
            8, 6, gradient_accumulation_fusion=fusion, params_dtype=dtype, device=torch.device("cpu")
        )
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, x):
        y, _ = self.fc1(x)
        return self.fc2(torch.tanh(y))[0]


def _column_row_grads(model, wrap_config=None, steps=3):
    if wrap_config is not None:
        model = DistributedDataParallel(model, wrap_config, ProcessGroups.single())
    gen = torch.Generator().manual_seed(4)
    dtype = next(model.parameters()).dtype
    for i in range(steps):
        x = torch.randn(4, 2, 6, generator=gen).to(dtype)
        sync = model.no_sync() if wrap_config is not None and i < steps - 1 else contextlib.nullcontext()
        with sync:
            model(x).float().square().mean().backward()
    if wrap_config is not None:
        model.finish_grad_sync()
        return {n: p.main_grad.clone() for n, p in model.module.named_parameters()}
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_fp32_main_grads_of_bf16_weights_fuse_exactly():
    """bf16 weights with fp32 main grads (--bf16, gradients in fp32, Megatron's default): fused through
    the op table's ``accumulate_weight_grad``; the reference op adds the bf16 product as the unfused
    path does, so the buffers are bit-identical."""
    fp32_grads = DDPConfig(grad_reduce_in_fp32=True)
    fused_model = _ColumnRow(True, torch.bfloat16)
    fused = _column_row_grads(fused_model, fp32_grads)
    unfused_model = _ColumnRow(False, torch.bfloat16)
    unfused = _column_row_grads(unfused_model, fp32_grads)
    assert all(g.dtype == torch.float32 for g in fused.values())
    _assert_grads_close(fused, unfused, rtol=0, atol=0)
    assert fused_model.fc1.weight.grad_added_to_main_grad and fused_model.fc2.weight.grad_added_to_main_grad
    assert not any(getattr(p, "grad_added_to_main_grad", False) for p in unfused_model.parameters())

    # bf16 main grads (the weights' dtype): fused, and close to the fp32 accumulation
    fused_bf16_model = _ColumnRow(True, torch.bfloat16)
    fused_bf16 = _column_row_grads(fused_bf16_model, DDPConfig())
    assert fused_bf16_model.fc1.weight.grad_added_to_main_grad
    assert fused_bf16_model.fc2.weight.grad_added_to_main_grad
    for name, value in fused_bf16.items():
        assert value.dtype == torch.bfloat16
        torch.testing.assert_close(value.float(), fused[name], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
def test_accumulate_weight_grad_op(dtypes):
    """The selected backend's ``accumulate_weight_grad`` adds dY^T X in place, to the dtype's accuracy
    (an fp32 buffer of bf16 products: at most the bf16 rounding of the product)."""
    from mcore.plugins.manager import select_backend

    backend = select_backend(selected_backend_name())
    grad_dtype, act_dtype = dtypes
    device = backend.device(0)
    gen = torch.Generator().manual_seed(5)
    dy, x = torch.randn(64, 24, generator=gen), torch.randn(64, 40, generator=gen)
    start = torch.randn(24, 40, generator=gen)
    main_grad = start.to(device, grad_dtype, copy=True)
    storage = main_grad.data_ptr()
    backend.ops.accumulate_weight_grad(main_grad, dy.to(device, act_dtype), x.to(device, act_dtype))
    want = start.double() + dy.to(act_dtype).double().t() @ x.to(act_dtype).double()
    assert main_grad.data_ptr() == storage
    tol = 1e-5 if act_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(main_grad.double().cpu(), want, rtol=tol, atol=tol * 8)


def test_fusion_skipped_without_main_grad():
    """No DDP wrapper (a plain module, inference): F.linear, ordinary gradients, no flag."""
    fused_model, plain_model = _ColumnRow(True, torch.float32), _ColumnRow(False, torch.float32)
    fused, plain = _column_row_grads(fused_model), _column_row_grads(plain_model)
    _assert_grads_close(fused, plain, rtol=0, atol=0)
    assert not any(hasattr(p, "grad_added_to_main_grad") for p in fused_model.parameters())
    with torch.no_grad():
        x = torch.randn(4, 2, 6)
        torch.testing.assert_close(fused_model(x), plain_model(x), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(5,), (3, 5), (4, 2, 5), (2, 3, 2, 5)])
@pytest.mark.parametrize("shared", [False, True], ids=["owned", "shared"])
def test_fused_linear_any_leading_shape(shape, shared):
    """``linear_with_grad_accumulation_fusion`` on ``[..., in]``: output, input and bias gradients as
    ``F.linear``; ``main_grad`` accumulates ``dY^T X`` over calls; a shared weight gets no gradient
    from the layer (its other uses' gradient reaches the hook alone) and the flag is left alone."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(3, 5, generator=gen))
    bias = torch.nn.Parameter(torch.randn(3, generator=gen))
    weight.main_grad = torch.zeros_like(weight)
    ref_w, ref_b = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    for _ in range(2):
        x = torch.randn(shape, generator=gen)
        dy = torch.randn((*shape[:-1], 3), generator=gen)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = linear_with_grad_accumulation_fusion(
            x1, weight, bias, gradient_accumulation_fusion=True, shared_weight=shared
        )
        y_ref = F.linear(x2, ref_w, ref_b)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
        y.backward(dy)
        y_ref.backward(dy)
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-6)
        if shared:
            assert weight.grad is None
        weight.grad = None
    torch.testing.assert_close(weight.main_grad, ref_w.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bias.grad, ref_b.grad, rtol=1e-6, atol=1e-6)
    assert getattr(weight, "grad_added_to_main_grad", None) is (None if shared else True)


def test_cli_flag():
    groups = {"model": ModelConfig}
    base = "--num-layers 2 --hidden-size 16 --num-attention-heads 4 --seq-length 8".split()
    assert parse_config(groups, base)["model"].gradient_accumulation_fusion is True
    off = parse_config(groups, [*base, "--no-gradient-accumulation-fusion"])["model"]
    assert off.gradient_accumulation_fusion is False
    assert "--no-gradient-accumulation-fusion" in build_parser(groups).format_help()


def test_turning_fusion_off_clears_the_flag():
    """A layer that stops fusing (between steps) clears the flag, so its gradients are added again."""
    # seeded: the two paths differ in the order of two fp32 additions, which the TIGHT bounds admit
    # for these values; unseeded inputs occasionally put an element of near-cancelling sums past them
    torch.manual_seed(11)
    model = _ColumnRow(True, torch.float32)
    ddp = DistributedDataParallel(model, DDPConfig(), ProcessGroups.single())
    x = torch.randn(4, 2, 6)
    ddp(x).sum().backward()
    assert model.fc1.weight.grad_added_to_main_grad and model.fc2.weight.grad_added_to_main_grad
    fused = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    ddp.zero_grad_buffer()
    model.fc1.gradient_accumulation_fusion = model.fc2.gradient_accumulation_fusion = False
    ddp(x).sum().backward()
    assert not model.fc1.weight.grad_added_to_main_grad and not model.fc2.weight.grad_added_to_main_grad
    _assert_grads_close({n: p.main_grad for n, p in model.named_parameters()}, fused, **TIGHT)


# -- tensor and data parallel (2 processes) ----------------------------------------------------------


def _tensor_parallel_runs():
    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=2))
    return {
        (sp, untie): _gpt_grads(groups, sp=sp, untie=untie)[:2]
        for sp, untie in ((False, True), (True, True), (True, False))
    }


def _data_parallel_runs():
    groups = initialize_parallel(ParallelConfig())
    return {fusion: _gpt_grads(groups, fusion=fusion, overlap=True, bucket=500) for fusion in (True, False)}


def test_tp2_sequence_parallel_equals_tp1():
    results = run_distributed(_tensor_parallel_runs, 2)
    single = ProcessGroups.single()
    references = {untie: _gpt_grads(single, wrap=False, untie=untie)[0] for untie in (True, False)}
    for per_rank in results:
        for (sp, untie), (grads, flags) in per_rank.items():
            _assert_grads_close(grads, references[untie], rtol=1e-5, atol=1e-6)
            assert all(flags[n] for n in flags if _is_linear_weight(n)), (sp, untie)


def test_dp2_overlapped_reduction_equals_dp1():
    results = run_distributed(_data_parallel_runs, 2)
    single = ProcessGroups.single()
    reference = _gpt_grads(single, wrap=False)[0]
    for per_rank in results:
        for fusion, (grads, flags, started) in per_rank.items():
            _assert_grads_close(grads, reference, rtol=1e-5, atol=1e-6)
            # every bucket was complete, hence reduced, during the last micro-batch's backward
            assert len(started) > 3 and all(started), (fusion, started)
            assert any(flags.values()) is fusion
    # both ranks hold the same reduced gradients
    for fusion in (True, False):
        _assert_grads_close(results[0][fusion][0], results[1][fusion][0], rtol=0, atol=0)
