"""megatron-core trains its MoE GPTModel (local spec) at TP=2 x EP=2 (ETP=2) on 4 gloo ranks and saves
it as Megatron-LM does, optimizer state included; then continues training (the losses an mcore resume
must give).

Imported by the ranks that :func:`mcore.testing.distributed.run_distributed` starts. The model, the
CPU shims and the args come from :mod:`megatron_runs` (the ``moe`` family: 4 SwiGLU experts, top 2, a
gated shared expert, QK layernorm, the allgather dispatcher), the training step and the optimizer from
:mod:`megatron_optim_runs` (megatron-core's ``DistributedDataParallel`` and ``get_megatron_optimizer``:
a chained optimizer, the dense parameters' and the experts'). With 4 ranks, TP=2 and EP=2 the dense
parameters have DP=2 (each DP rank trains on its half of the global batch), the experts expert-DP=1.

The PyPI megatron-core has no ``megatron.training``, so Megatron-LM's ``save_checkpoint`` cannot run;
its layout is written here as it writes it: ``--ckpt-format torch`` ``iter_N/mp_rank_TT_EEE/
model_optim_rng.pt`` (``get_checkpoint_name`` with expert parallelism: the TP rank, then the EP rank),
each holding ``state_dict_for_save_checkpoint()`` (the EP rank's local experts ``local_experts.0/1``)
and the chained optimizer's ``state_dict()`` (a list: dense, experts), from the DP-rank-0 ranks as
Megatron saves; ``--ckpt-format torch_dist``: ``dist_checkpointing.save`` of the model's sharded state
dict (experts on the global-expert axis), megatron-core's own code. Then the same model trains again
with megatron-core's DistributedOptimizer at TP=1 x EP=2 (dense DP=4, expert DP=2) and saves
``--ckpt-format torch`` with ``distrib_optim.pt`` (``ChainedOptimizer.save_parameter_state``: the list
[dense, experts], each gathered to its group's DP rank 0), as Megatron-LM's ``save_checkpoint`` does.
"""

from __future__ import annotations

import os
import sys
import zlib

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import megatron_optim_runs as mo  # noqa: E402
import megatron_runs as mr  # noqa: E402

FAMILY = "moe256"
TP, EP = 2, 2
# the MoE family with a vocabulary both sides pad to 256 (megatron_optim_runs: the losses agree only then),
# with sequence parallelism: megatron-core trains MoE with TP only under SP (without it, each token is
# dispatched once per TP rank and the experts' gradients double)
_PARALLEL = dict(sequence_parallel=True, expert_model_parallel_size=EP, expert_tensor_parallel_size=TP)
mr.FAMILIES[FAMILY] = {**mr.FAMILIES["moe"], "vocab_size": 256, "moe": {**mr.MOE, **_PARALLEL}}
# the distributed optimizer's run: TP=1 x EP=2 on 4 ranks (dense DP=4, expert DP=2: both optimizers'
# buffers sharded, megatron-core gathers each over its own group into distrib_optim.pt)
DIST = "moe256_dist"
mr.FAMILIES[DIST] = {
    **mr.FAMILIES["moe"],
    "vocab_size": 256,
    "moe": {**mr.MOE, "expert_model_parallel_size": EP},
}
EP1 = "moe256_ep1"  # the same model in one process (megatron-core loading mcore's export)
mr.FAMILIES[EP1] = {**mr.FAMILIES["moe"], "vocab_size": 256}
SAVED_AT, CONTINUE = 2, 2


def allow_sequence_parallel_torch_norms() -> None:
    """megatron-core's local spec builds its norms with ``WrappedTorchNorm``, which refuses sequence
    parallelism only because it does not mark its parameters for the TP reduction of their gradients
    (``finalize_model_grads`` sums the grads of parameters with ``sequence_parallel=True``): build the
    torch norm, then mark them, as the fused norms of the Transformer-Engine spec are marked."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if getattr(WrappedTorchNorm, "_sp_marked", False):
        return
    build = WrappedTorchNorm.__new__

    def new(cls, config, *args, **kwargs):
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = build(cls, plain, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm

    WrappedTorchNorm.__new__ = staticmethod(new)
    WrappedTorchNorm._sp_marked = True


def perturb_experts(model) -> None:
    """Distinct experts on the two EP ranks: megatron-core initialises each EP rank's local experts
    from the same (CPU) seed, so experts 0/1 would equal 2/3 and a swapped expert would not show."""
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "local_experts" in name:
                seed = zlib.crc32(name.encode()) + 7919 * ps.get_expert_model_parallel_rank()
                seed += 104729 * ps.get_expert_tensor_parallel_rank()
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.02)


def _optimizer(ddp, iters: int, distributed: bool = False):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        optimizer="adam", lr=mo.LR, min_lr=0.0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999,
        adam_eps=1e-8, clip_grad=1.0, use_distributed_optimizer=distributed,
    )  # fmt: skip
    optimizer = get_megatron_optimizer(config, [ddp])
    decay = iters * mo.GLOBAL_BATCH
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=mo.LR, max_lr=mo.LR, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=decay,
        lr_decay_style="constant", start_wd=0.01, end_wd=0.01, wd_incr_steps=decay, wd_incr_style="constant",
    )  # fmt: skip
    return optimizer, scheduler


def _args(world: int, family: str = FAMILY, tp: int = TP, distributed: bool = False):
    args = mr.megatron_args(family, tp, 1, world, "torch")
    args.iteration, args.consumed_train_samples = SAVED_AT, SAVED_AT * mo.GLOBAL_BATCH
    args.train_iters = SAVED_AT + CONTINUE
    args.global_batch_size, args.micro_batch_size = mo.GLOBAL_BATCH, mo.GLOBAL_BATCH // (world // tp)
    args.optimizer, args.use_distributed_optimizer, args.lr = "adam", distributed, mo.LR
    return args


def train_save_continue(out_dir: str, distributed: bool = False) -> dict:
    """Rank function (4 ranks): train ``SAVED_AT`` Adam iterations at TP=2 x EP=2, save ``<out_dir>/torch``
    and ``<out_dir>/torch_dist``, write the logits and the loss of the fixed batch
    (``<out_dir>/logits.pt``), train ``CONTINUE`` more; returns the losses. ``distributed``: at TP=1 x
    EP=2 with the distributed optimizer instead, saving ``<out_dir>/torch`` only (with ``distrib_optim.pt``)."""
    mr.shim_megatron_for_cpu()
    mo.shim_megatron_optimizer_for_cpu()
    allow_sequence_parallel_torch_norms()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    family, tp = (DIST, 1) if distributed else (FAMILY, TP)
    world = dist.get_world_size()
    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=EP, expert_tensor_parallel_size=tp)
    torch.manual_seed(1234)
    model = mr.build_megatron_model(family, tp, 1)
    mr.perturb_norms_and_biases(model)
    perturb_experts(model)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=distributed
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    optimizer, scheduler = _optimizer(ddp, SAVED_AT + CONTINUE, distributed)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    micro = mo.GLOBAL_BATCH // dp
    rows = slice(dp_rank * micro, (dp_rank + 1) * micro)
    _, _, mask = mr.inputs(family)
    pos = torch.arange(mr.SEQ).expand(micro, mr.SEQ)

    def train_step(iteration: int) -> float:
        data = {k: v[rows] for k, v in mo.batch(iteration, family).items()}
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        ddp.train()
        per_token = ddp(data["tokens"], pos, attention_mask=mask, labels=data["labels"])
        loss = (per_token.float() * data["loss_mask"]).sum() / data["loss_mask"].sum()
        loss.backward()
        finalize_model_grads([ddp])  # Megatron's train_step: DP, and the QK norms' grads over TP
        assert optimizer.step()[0]
        scheduler.step(increment=mo.GLOBAL_BATCH)
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=ps.get_data_parallel_group())
        return mean.item() / dp

    losses = [train_step(i) for i in range(SAVED_AT)]
    args = _args(world, family, tp, distributed)
    _save_torch(out_dir, ddp, optimizer, scheduler, args)
    if not distributed:
        _save_torch_dist(out_dir, ddp, optimizer, scheduler, args)
        logits = mr.megatron_logits(model, FAMILY, TP, 1)
        if dist.get_rank() == 0:
            torch.save({"ids": mr.inputs(FAMILY)[0], "logits": logits}, os.path.join(out_dir, "logits.pt"))
    continued = [train_step(i) for i in range(SAVED_AT, SAVED_AT + CONTINUE)]
    dist.barrier()
    ps.destroy_model_parallel()
    return {"losses": losses, "continued": continued}


def megatron_side(out_dir: str) -> dict:
    """Rank function (4 ranks): :func:`train_save_continue`; then rank 0 exports the ``torch``
    checkpoint with ``mcore-export-megatron``'s code (TP=1, EP=1: ``<out_dir>/export``) and
    megatron-core's GPTModel at TP=1 x EP=1 loads the export (strict): adds its logits; then mcore's
    ``pretrain`` resumes the ``torch`` checkpoint at TP=1 x EP=1 x DP=4: adds its losses."""
    from megatron.core import parallel_state as ps

    from mcore.checkpoint.megatron.write import export_to_megatron

    result = train_save_continue(out_dir)
    if dist.get_rank() == 0:
        export_to_megatron(
            os.path.join(out_dir, "torch"), os.path.join(out_dir, "export"), "torch", tp=1, pp=1
        )
    dist.barrier()
    ps.initialize_model_parallel(1, 1)
    model = mr.build_megatron_model(EP1, 1, 1)
    step = SAVED_AT
    state = torch.load(
        os.path.join(out_dir, "export", f"iter_{step:07d}", "mp_rank_00", "model_optim_rng.pt"),
        weights_only=False,
    )
    model.load_state_dict(state["model"], strict=True)
    result["export_logits"] = mr.megatron_logits(model, EP1, 1, 1)
    ps.destroy_model_parallel()
    # mcore resumes the torch checkpoint (optimizer state and schedule included) at TP=1 x EP=1, DP=4
    iters = ["--train-iters", str(SAVED_AT + CONTINUE)]
    resumed = mo.mcore_resume(os.path.join(out_dir, "torch"), os.path.join(out_dir, "resumed"), iters)
    result["mcore_continued"] = resumed["losses"]
    # the distributed optimizer's state (distrib_optim.pt: [dense, experts] buffers), saved at TP=1 x EP=2
    # x DP=4 (expert DP=2), resumed the same way
    dist_dir = os.path.join(out_dir, "distopt")
    result["distopt"] = train_save_continue(dist_dir, distributed=True)
    resumed = mo.mcore_resume(os.path.join(dist_dir, "torch"), os.path.join(dist_dir, "resumed"), iters)
    result["distopt"]["mcore_continued"] = resumed["losses"]
    return result


def _save_torch(out_dir: str, ddp, optimizer, scheduler, args) -> None:
    """``--ckpt-format torch``: one ``mp_rank_TT_EEE/model_optim_rng.pt`` per (TP, EP) rank, written by
    the rank of data-parallel rank 0 that holds it (Megatron's ``get_checkpoint_name``)."""
    from megatron.core import parallel_state as ps

    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": SAVED_AT,
        "model": ddp.module.state_dict_for_save_checkpoint(),
        "optimizer": optimizer.state_dict(),
        "opt_param_scheduler": scheduler.state_dict(),
        "num_floating_point_operations_so_far": 0,
    }
    tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    folder = os.path.join(out_dir, "torch", f"iter_{SAVED_AT:07d}", f"mp_rank_{tp_rank:02d}_{ep_rank:03d}")
    if ps.get_expert_data_parallel_rank() == 0:  # the expert-DP group: each (TP, EP) rank once
        os.makedirs(folder, exist_ok=True)
        torch.save(state, os.path.join(folder, "model_optim_rng.pt"))
    dist.barrier()
    if args.use_distributed_optimizer:  # collective: each chained optimizer gathers to its DP rank 0,
        # whose rank writes the list ([dense, experts], None for a group it is not DP rank 0 of)
        optimizer.save_parameter_state(os.path.join(folder, "distrib_optim.pt"))
        dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "torch", "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(SAVED_AT))


def _save_torch_dist(out_dir: str, ddp, optimizer, scheduler, args) -> None:
    """``--ckpt-format torch_dist``: megatron-core's ``dist_checkpointing.save`` of the model's and the
    (chained) optimizer's sharded state dicts (the routed experts and their moments as
    ``[layers, experts, ...]`` global tensors)."""
    import argparse

    root = os.path.join(out_dir, "torch_dist")
    folder = os.path.join(root, f"iter_{SAVED_AT:07d}")
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    model_sd = ddp.module.sharded_state_dict()
    sharded = {
        "args": argparse.Namespace(**{**vars(args), "ckpt_format": "torch_dist"}),
        "checkpoint_version": 3.0,
        "iteration": SAVED_AT,
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=False),
        "opt_param_scheduler": scheduler.state_dict(),
    }
    mr.save_dist_checkpoint(sharded, folder)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(SAVED_AT))
