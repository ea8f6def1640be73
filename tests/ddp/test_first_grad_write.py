"""The step's first FP8 weight gradient is written over ``main_grad`` (:mod:`mcore.tensor_parallel.first_grad`).

The DDP skips zeroing the FP8 linears' ``main_grad`` regions and their first wgrad GEMM of the step
writes instead of adding. Compared with the zero-then-add behaviour
(``DistributedDataParallel.overwrite_first_grads = False``) everything must be bit-identical, since
``0 + x == x``:

1. In-model (one process, CPU): a GPT with FP8 linears wrapped in the DDP, three steps with an SGD
   update between them, one and two micro-batches per step, for the delayed recipe with the fused
   Functions (``fp8_fused``; also under full recomputation) and without, and tensorwise: per-token losses and every ``main_grad``
   after ``finish_grad_sync`` are identical, and the write form really ran.
   The MoE experts' grouped weights (gradients from autograd, written by the DDP hook) likewise.
2. A weight that gets no gradient in a step: its region is not zeroed at ``zero_grad_buffer`` (the
   stale gradient is still there, flagged) but is zero after ``finish_grad_sync``.
3. ``pretrain`` (2 gloo processes, delayed recipe): DP=2 with the distributed optimizer and
   ``--overlap-grad-reduce`` (small buckets), and PP=2 with virtual stages, give the same losses
   with and without the skipped zeroing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mcore.distributed.ddp import DDPConfig, DistributedDataParallel
from mcore.distributed.groups import ProcessGroups
from mcore.fp8 import linear as fp8_module
from mcore.fp8.config import Fp8Config
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.model_config import ModelConfig, padded_vocab_size
from mcore.ops import reference
from mcore.tensor_parallel.first_grad import is_unwritten, opts_in
from mcore.testing.ddp_steps import sgd_steps_on_main_grad
from mcore.testing.distributed import run_distributed

sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoint"))

VOCAB, SEQ, BATCH = 100, 16, 2
MODEL = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=SEQ,
    max_position_embeddings=SEQ, make_vocab_size_divisible_by=32, attention_dropout=0.0,
    hidden_dropout=0.0,
)  # fmt: skip
RECIPES = {
    "delayed-fused": dict(fp8_recipe="delayed", fp8_fused_producers=True),
    "delayed": dict(fp8_recipe="delayed", fp8_fused_producers=False),
    "tensorwise": dict(fp8_recipe="tensorwise"),
    "delayed-fused-recompute": dict(fp8_recipe="delayed", fp8_fused_producers=True),
}
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


class _WgradForms:
    """Counts the FP8 weight gradients into a ``main_grad`` by form (written or added)."""

    def __init__(self, monkeypatch):
        self.forms = {"write": 0, "add": 0}
        original = fp8_module.take_first_write

        def counted(param):
            write = original(param)
            self.forms["write" if write else "add"] += 1
            return write

        monkeypatch.setattr(fp8_module, "take_first_write", counted)


def _train(recipe: str, micro_batches: int, overwrite: bool, steps: int = 3):
    """``steps`` DDP steps of ``micro_batches`` each (SGD on ``main_grad`` between them); returns the
    per-token losses and ``{name: main_grad}`` after every step's ``finish_grad_sync``."""
    torch.manual_seed(0)
    groups = ProcessGroups.single()
    fp8 = Fp8Config(fp8_format="hybrid", fp8_amax_history_len=2, **RECIPES[recipe])
    model = GPTModel(
        ModelConfig(**MODEL, **(RECOMPUTE if recipe.endswith("recompute") else {})),
        groups,
        padded_vocab_size(VOCAB, 32, 1),
        device=torch.device("cpu"),
        fp8=fp8,
    )
    ddp = DistributedDataParallel(model, DDPConfig(), groups)
    ddp.overwrite_first_grads = overwrite
    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (steps, micro_batches, 2, BATCH, SEQ), generator=gen)
    losses, grads = sgd_steps_on_main_grad(ddp, model, data, groups)
    return losses, grads, model


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_first_write_equals_zero_then_add(monkeypatch, recipe, micro_batches):
    want_losses, want_grads, _ = _train(recipe, micro_batches, overwrite=False)
    counter = _WgradForms(monkeypatch)
    losses, grads, model = _train(recipe, micro_batches, overwrite=True)
    assert torch.equal(losses, want_losses)
    for step, (got, want) in enumerate(zip(grads, want_grads)):
        for name, g in got.items():
            assert torch.equal(g, want[name]), (step, name)
    # the FP8 weights opted in after the first step's forward; steps 2 and 3 wrote their first gradient
    fp8_weights = [p for n, p in model.named_parameters() if opts_in(p)]
    assert len(fp8_weights) == 2 * 4  # QKV, proj, fc1, fc2 of 2 layers
    assert counter.forms["write"] == 2 * len(fp8_weights)
    assert counter.forms["add"] == len(fp8_weights) * (3 * micro_batches - 2)


def test_a_weight_without_gradient_ends_the_step_with_a_zero_main_grad():
    """Step 2 skips the second layer's MLP: its FP8 weights get no gradient, so their skipped zeroing
    must happen before the reduction (the stale step-1 gradient must not be reduced)."""
    torch.manual_seed(0)
    groups = ProcessGroups.single()
    fp8 = Fp8Config(
        fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=2, fp8_fused_producers=False
    )
    model = GPTModel(
        ModelConfig(**MODEL), groups, padded_vocab_size(VOCAB, 32, 1), device=torch.device("cpu"), fp8=fp8
    )
    ddp = DistributedDataParallel(model, DDPConfig(), groups)
    gen = torch.Generator().manual_seed(7)
    tokens, labels = torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=gen)
    mlp = model.decoder.layers[1].mlp
    skipped = [mlp.linear_fc1.weight, mlp.linear_fc2.weight]

    ddp.zero_grad_buffer()
    ddp(tokens, None, None, labels=labels).mean().backward()
    ddp.finish_grad_sync()
    assert all(opts_in(p) and p.main_grad.abs().sum() > 0 for p in skipped)

    ddp.zero_grad_buffer()
    assert all(is_unwritten(p) and p.main_grad.abs().sum() > 0 for p in skipped)  # not zeroed: stale
    mlp.forward = lambda x: (torch.zeros_like(x), None)  # the layer skips its MLP this step
    try:
        ddp(tokens, None, None, labels=labels).mean().backward()
    finally:
        del mlp.forward
    assert all(is_unwritten(p) for p in skipped)  # still flagged: no gradient was written
    ddp.finish_grad_sync()
    for p in skipped:
        assert not is_unwritten(p) and torch.count_nonzero(p.main_grad) == 0
    others = [p for p in model.parameters() if all(p is not q for q in skipped)]
    assert all(not is_unwritten(p) for p in others)
    assert sum(torch.count_nonzero(p.main_grad) for p in others) > 0


MOE = dict(num_experts=4, moe_router_topk=2, swiglu=True, disable_bias_linear=True, moe_ffn_hidden_size=16)


def _train_moe(micro_batches: int, overwrite: bool, fusion: bool, monkeypatch):
    """As :func:`_train` for an MoE GPT without FP8 (the experts' grouped weights opt in; their first
    gradient is written by the backward with gradient-accumulation fusion, else by the DDP hook); also
    counts the first writes."""
    from mcore.distributed import ddp as ddp_module
    from mcore.tensor_parallel import weight_grad as weight_grad_module

    writes = [0]
    original = ddp_module.take_first_write

    def counted(param):
        write = original(param)
        writes[0] += write
        return write

    monkeypatch.setattr(ddp_module, "take_first_write", counted)
    monkeypatch.setattr(weight_grad_module, "take_first_write", counted)
    torch.manual_seed(0)
    groups = ProcessGroups.single()
    config = ModelConfig(**MODEL, **MOE, gradient_accumulation_fusion=fusion)
    model = GPTModel(config, groups, padded_vocab_size(VOCAB, 32, 1), device=torch.device("cpu"))
    ddp = DistributedDataParallel(model, DDPConfig(), groups)
    ddp.overwrite_first_grads = overwrite
    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (3, micro_batches, 2, BATCH, SEQ), generator=gen)
    losses, grads = sgd_steps_on_main_grad(ddp, model, data, groups)
    return losses, grads, model, writes[0]


@pytest.mark.parametrize("fusion", [True, False], ids=["in-backward", "by-the-hook"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_moe_experts_first_gradient_written_equals_zero_then_add(monkeypatch, micro_batches, fusion):
    want_losses, want_grads, _, _ = _train_moe(micro_batches, False, fusion, monkeypatch)
    losses, grads, model, writes = _train_moe(micro_batches, True, fusion, monkeypatch)
    assert torch.equal(losses, want_losses)
    for step, (got, want) in enumerate(zip(grads, want_grads)):
        for name, g in got.items():
            assert torch.equal(g, want[name]), (step, name)
    expert_weights = [n for n, p in model.named_parameters() if opts_in(p)]
    assert len(expert_weights) == 2 * 2 and all(".experts.linear_fc" in n for n in expert_weights)
    assert writes == 2 * len(expert_weights)  # steps 2 and 3 wrote, step 1 had nothing skipped


def test_reference_wgrad_overwrite_is_the_add_into_zeros():
    gen = torch.Generator().manual_seed(1)
    a = (torch.randn(48, 32, generator=gen) * 64).to(torch.float8_e5m2)
    b = (torch.randn(64, 32, generator=gen) * 64).to(torch.float8_e4m3fn)
    sa, sb = torch.tensor(0.0123), torch.tensor(0.0071)
    for dtype in (torch.float32, torch.bfloat16):
        stale = torch.randn(48, 64, generator=gen).to(dtype)
        out = reference.scaled_linear_wgrad(a, b, sa, sb, dtype, stale, accumulate=False)
        want = reference.scaled_linear_wgrad(a, b, sa, sb, dtype, torch.zeros(48, 64, dtype=dtype))
        assert out is stale and torch.equal(out, want)


# -- pretrain: DP=2 with the distributed optimizer and overlapped reduction, PP=2 with virtual stages --

FP8_DELAYED = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "4"]
LAYOUTS = {
    "dp2-distopt-overlap": [
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "4000",
    ],
    "pp2-vp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
}  # fmt: skip


def _pretrain_losses(extra: list[str], overwrite: bool) -> tuple[list[float], int]:
    """This rank's losses (last stage) and how many FP8 weight gradients it wrote over ``main_grad``."""
    from ckpt_runs import argv, tiny_datasets_provider

    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    DistributedDataParallel.overwrite_first_grads = overwrite
    original, writes = fp8_module.take_first_write, [0]

    def counted(param):
        write = original(param)
        writes[0] += write
        return write

    fp8_module.take_first_write = counted
    result = pretrain(model_provider, forward_step, tiny_datasets_provider, argv=argv(*extra))
    return result.train_losses, writes[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pretrain_layouts_give_the_zero_then_add_losses(layout):
    extra = [*FP8_DELAYED, *LAYOUTS[layout], "--train-iters", "4"]
    want = run_distributed(_pretrain_losses, 2, extra, False, timeout=300)
    got = run_distributed(_pretrain_losses, 2, extra, True, timeout=300)
    assert all(writes == 0 for _, writes in want)
    # every rank wrote the first gradient of its FP8 weights (4 per layer) in steps 2-4
    layers_per_rank = 2 if layout.startswith("pp2") else 4
    assert all(writes == 3 * 4 * layers_per_rank for _, writes in got), got
    assert len(got[-1][0]) == 4 and got[-1][0] == want[-1][0], (got, want)
