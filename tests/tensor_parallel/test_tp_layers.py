"""Tensor-parallel collectives, layers and vocab-parallel cross-entropy on 2 real processes.

Every check runs inside one 2-rank launch (a module-scoped fixture); each rank compares its results
with single-device math on the same (seeded) full tensors and returns the largest relative errors.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from mcore.backend import current_backend
from mcore.config.parallel import ParallelConfig
from mcore.distributed.groups import initialize_parallel
from mcore.tensor_parallel import mappings as M
from mcore.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mcore.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mcore.tensor_parallel.sharding import build_shard_specs
from mcore.testing.distributed import run_distributed
from mcore.testing.memory import SavedActivations

TP = 2
S, B, H, OUT = 4, 3, 6, 8  # sequence, batch, in features, out features (all divisible by TP)


def device() -> torch.device:
    """This rank's device on the test backend (``MCORE_TEST_BACKEND``; CPU by default)."""
    return current_backend().device(int(os.environ.get("LOCAL_RANK", "0")))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected| / max |expected|``."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale > 0 else diff


def _randn(*shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device())


def _check_mappings(group, rank) -> dict[str, float]:
    """Forward and backward of each mapping against the math it stands for."""
    errors = {}
    full = _randn(S, B, H, seed=1)  # identical on both ranks
    mine = full + rank  # different per rank
    grad_full = _randn(S, B, H, seed=2)

    def run(fn, x, grad):
        x = x.clone().requires_grad_(True)
        y = fn(x, group)
        y.backward(grad)
        return y.detach(), x.grad

    # copy: identity forward, all-reduce backward
    y, g = run(M.copy_to_tensor_model_parallel_region, mine, grad_full + rank)
    errors["copy"] = max(rel_err(y, mine), rel_err(g, 2 * grad_full + 1))
    # reduce: all-reduce forward, identity backward
    y, g = run(M.reduce_from_tensor_model_parallel_region, mine, grad_full)
    errors["reduce"] = max(rel_err(y, 2 * full + 1), rel_err(g, grad_full))
    # scatter/gather along the last dim. Each rank feeds its own chunk of grad_full as the gradient
    # of its scattered output, so the all-gathered input gradient is grad_full itself.
    y, g = run(M.scatter_to_tensor_model_parallel_region, full, grad_full.chunk(TP, -1)[rank])
    errors["scatter_tp"] = max(rel_err(y, full.chunk(TP, -1)[rank]), rel_err(g, grad_full))
    y, g = run(M.gather_from_tensor_model_parallel_region, full.chunk(TP, -1)[rank], grad_full)
    errors["gather_tp"] = max(rel_err(y, full), rel_err(g, grad_full.chunk(TP, -1)[rank]))
    # sequence parallel: scatter / gather / reduce-scatter along the first dim
    y, g = run(M.scatter_to_sequence_parallel_region, full, grad_full.chunk(TP, 0)[rank])
    errors["scatter_sp"] = max(rel_err(y, full.chunk(TP, 0)[rank]), rel_err(g, grad_full))
    y, g = run(M.gather_from_sequence_parallel_region, full.chunk(TP, 0)[rank], grad_full + rank)
    errors["gather_sp"] = max(rel_err(y, full), rel_err(g, (2 * grad_full + 1).chunk(TP, 0)[rank]))
    x = full.chunk(TP, 0)[rank].clone().requires_grad_(True)
    y = M.gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=False)
    y.backward(grad_full)
    errors["gather_sp_replicated"] = rel_err(x.grad, grad_full.chunk(TP, 0)[rank])
    y, g = run(M.reduce_scatter_to_sequence_parallel_region, mine, grad_full.chunk(TP, 0)[rank])
    errors["reduce_scatter_sp"] = max(rel_err(y, (2 * full + 1).chunk(TP, 0)[rank]), rel_err(g, grad_full))
    return errors


def _out_features(spec, t: torch.Tensor) -> torch.Tensor:
    """This rank's output features of ``t [..., out]``, cut as the weight's rows are."""
    return torch.cat([t.narrow(-1, start, length) for _, start, length in spec.chunks()], dim=-1)


def _set_from_full(layer, full: dict[str, torch.Tensor], group_rank):
    specs = build_shard_specs(layer, group_rank, TP)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(specs[name].shard(full[name]))
    return specs


def _check_layers(group, rank) -> dict[str, float]:
    errors = {}
    x_full = _randn(S, B, H, seed=3)
    w_col, b_col = _randn(OUT, H, seed=4), _randn(OUT, seed=5)
    grad_out = _randn(S, B, OUT, seed=6)

    def reference(fn, *params):
        x = x_full.clone().requires_grad_(True)
        params = [p.clone().requires_grad_(True) for p in params]
        y = fn(x, *params)
        y.backward(grad_out if y.shape[-1] == OUT else grad_h)
        return y.detach(), x.grad, [p.grad for p in params]

    grad_h = _randn(S, B, H, seed=7)

    for stacked, sp, fused in ((1, False, False), (1, True, False), (2, False, False), (2, True, False),
                               (1, True, True), (2, False, True)):  # fmt: skip
        layer = ColumnParallelLinear(
            H, OUT, tp_group=group, sequence_parallel=sp, num_stacked=stacked, device=device(),
            gradient_accumulation_fusion=fused,
        )  # fmt: skip
        specs = _set_from_full(layer, {"weight": w_col, "bias": b_col}, rank)
        if fused:  # a DDP buffer's view: the backward accumulates the weight gradient into it
            layer.weight.main_grad = torch.full_like(layer.weight, 0.5)
        x = (x_full.chunk(TP, 0)[rank] if sp else x_full).clone().requires_grad_(True)
        with SavedActivations(exclude=layer.parameters()) as saved:
            y, bias = layer(x)
        # for its weight gradient the layer keeps x, never the all-gathered [s, b, h] (with SP)
        name = f"stacked{stacked}_sp{sp}" + ("_fused" if fused else "")
        errors[f"kept_column_{name}"] = saved.nbytes() - x.numel() * x.element_size()
        saved.clear()
        assert bias is None
        y_ref, gx_ref, (gw_ref, gb_ref) = reference(lambda x, w, b: F.linear(x, w, b), w_col, b_col)
        y.backward(_out_features(specs["weight"], grad_out))
        gx_expected = gx_ref.chunk(TP, 0)[rank] if sp else gx_ref
        weight_grad = layer.weight.main_grad - 0.5 if fused else layer.weight.grad
        errors[f"column_{name}"] = max(
            rel_err(y, _out_features(specs["weight"], y_ref)),
            rel_err(x.grad, gx_expected),
            rel_err(weight_grad, specs["weight"].shard(gw_ref)),
            rel_err(layer.bias.grad, specs["bias"].shard(gb_ref)),
        )

    layer = ColumnParallelLinear(
        H, OUT, tp_group=group, gather_output=True, skip_bias_add=True, device=device()
    )
    _set_from_full(layer, {"weight": w_col, "bias": b_col}, rank)
    x = x_full.clone().requires_grad_(True)
    y, bias = layer(x)
    y_ref, gx_ref, (gw_ref,) = reference(lambda x, w: F.linear(x, w), w_col)
    y.backward(grad_out)
    errors["column_gather_output"] = max(
        rel_err(y, y_ref), rel_err(x.grad, gx_ref), rel_err(bias, b_col.chunk(TP)[rank])
    )

    w_row, b_row = _randn(H, OUT, seed=8), _randn(H, seed=9)
    x_out_full = _randn(S, B, OUT, seed=10)
    for sp in (False, True):
        for input_is_parallel in (True, False) if not sp else (True,):
            layer = RowParallelLinear(
                OUT,
                H,
                tp_group=group,
                sequence_parallel=sp,
                input_is_parallel=input_is_parallel,
                device=device(),
            )
            specs = _set_from_full(layer, {"weight": w_row, "bias": b_row}, rank)
            x_in = x_out_full.chunk(TP, -1)[rank] if input_is_parallel else x_out_full
            x = x_in.clone().requires_grad_(True)
            y, _ = layer(x)
            xr = x_out_full.clone().requires_grad_(True)
            wr, br = w_row.clone().requires_grad_(True), b_row.clone().requires_grad_(True)
            yr = F.linear(xr, wr, br)
            yr.backward(grad_h)
            y.backward(grad_h.chunk(TP, 0)[rank] if sp else grad_h)
            if sp:
                M.all_reduce_sequence_parallel_grads([layer.bias], group)
            gx = xr.grad.chunk(TP, -1)[rank] if input_is_parallel else xr.grad
            errors[f"row_sp{sp}_parallel_in{input_is_parallel}"] = max(
                rel_err(y, yr.chunk(TP, 0)[rank] if sp else yr),
                rel_err(x.grad, gx),
                rel_err(layer.weight.grad, specs["weight"].shard(wr.grad)),
                rel_err(layer.bias.grad, br.grad),
            )

    vocab = 8
    table = _randn(vocab, H, seed=11)
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(12)).to(device())
    for reduce_scatter in (False, True):
        emb = VocabParallelEmbedding(
            vocab, H, tp_group=group, reduce_scatter_embeddings=reduce_scatter, device=device()
        )
        specs = _set_from_full(emb, {"weight": table}, rank)
        out = emb(ids)
        t = table.clone().requires_grad_(True)
        ref = F.embedding(ids, t)  # [b, s, h]
        g = _randn(B, S, H, seed=13)
        ref.backward(g)
        if reduce_scatter:
            expected = ref.transpose(0, 1).chunk(TP, 0)[rank]
            out.backward(g.transpose(0, 1).chunk(TP, 0)[rank])
        else:
            expected = ref
            out.backward(g)
        errors[f"vocab_embedding_rs{reduce_scatter}"] = max(
            rel_err(out, expected), rel_err(emb.weight.grad, specs["weight"].shard(t.grad))
        )
    return errors


def _check_cross_entropy(group, rank) -> dict[str, float]:
    errors = {}
    vocab = 16
    logits_full = _randn(B, S, vocab, seed=14) * 3
    labels = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(15)).to(device())
    grad = _randn(B, S, seed=16)
    for smoothing in (0.0, 0.1):
        full = logits_full.clone().requires_grad_(True)
        ref = F.cross_entropy(
            full.reshape(-1, vocab), labels.reshape(-1), reduction="none", label_smoothing=smoothing
        )
        ref = ref.view(B, S)
        ref.backward(grad)
        for tp_group, local_rank, parts in ((group, rank, TP), (None, 0, 1)):
            local = logits_full.chunk(parts, -1)[local_rank].clone().requires_grad_(True)
            loss = vocab_parallel_cross_entropy(local, labels, tp_group, label_smoothing=smoothing)
            loss.backward(grad)
            assert loss.dtype == torch.float32
            errors[f"cross_entropy_tp{parts}_ls{smoothing}"] = max(
                rel_err(loss, ref), rel_err(local.grad, full.grad.chunk(parts, -1)[local_rank])
            )
    return errors


def _all_checks():
    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=TP))
    torch.manual_seed(0)
    errors = {}
    errors.update(_check_mappings(groups.tp, groups.tp_rank))
    errors.update(_check_layers(groups.tp, groups.tp_rank))
    errors.update(_check_cross_entropy(groups.tp, groups.tp_rank))
    return errors


@pytest.fixture(scope="module")
def errors():
    per_rank = run_distributed(_all_checks, TP)
    return {name: max(r[name] for r in per_rank) for name in per_rank[0]}


@pytest.mark.parametrize(
    "prefix", ["copy", "reduce", "scatter_tp", "gather_tp", "scatter_sp", "gather_sp", "reduce_scatter_sp"]
)
def test_mapping_forward_and_backward(errors, prefix):
    assert errors[prefix] < 1e-6, errors[prefix]
    assert errors["gather_sp_replicated"] < 1e-6


@pytest.mark.parametrize("prefix", ["column", "row", "vocab_embedding"])
def test_parallel_layers_match_single_device(errors, prefix):
    bad = {k: v for k, v in errors.items() if k.startswith(prefix) and v > 1e-5}
    assert not bad, bad
    assert any(k.startswith(prefix) for k in errors)


def test_column_parallel_layer_keeps_only_its_local_input(errors):
    """With sequence parallelism the input is all-gathered again in backward, not kept gathered."""
    kept = {k: v for k, v in errors.items() if k.startswith("kept_column")}
    assert len(kept) == 6 and all(v == 0 for v in kept.values()), kept


def test_vocab_parallel_cross_entropy_matches_torch(errors):
    found = {k: v for k, v in errors.items() if k.startswith("cross_entropy")}
    assert len(found) == 4
    assert all(v < 1e-5 for v in found.values()), found


def _compiled_sequence_parallel_column(fullgraph: bool):
    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=TP, sequence_parallel=True))
    layer = ColumnParallelLinear(H, OUT, tp_group=groups.tp, sequence_parallel=True, device=device())
    _set_from_full(layer, {"weight": _randn(OUT, H, seed=4), "bias": _randn(OUT, seed=5)}, groups.tp_rank)
    x = _randn(S, B, H, seed=3).chunk(TP, 0)[groups.tp_rank].clone().requires_grad_(True)
    grad = _randn(S, B, OUT // TP, seed=6)

    def run(fn):
        for t in (x, layer.weight, layer.bias):
            t.grad = None
        y = fn(x)
        y.backward(grad)
        return [y.detach(), x.grad, layer.weight.grad, layer.bias.grad]

    eager = run(lambda t: layer(t)[0])
    compiled = run(torch.compile(lambda t: layer(t)[0], backend="aot_eager", fullgraph=fullgraph))
    return max(rel_err(c, e) for c, e in zip(compiled, eager))


def test_compiled_sequence_parallel_column_layer_matches_eager():
    """Traced (``torch.compile``, ``fullgraph``), the sequence-parallel column layer's backward runs its
    all-gather and reduce-scatter synchronously and gives the eager results."""
    assert max(run_distributed(_compiled_sequence_parallel_column, TP, True)) < 1e-6
