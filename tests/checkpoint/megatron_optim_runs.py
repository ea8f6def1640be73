"""megatron-core trains a tiny GPT with Adam on CPU/gloo and saves it as Megatron-LM does, optimizer
state included; then continues training (the reference an mcore resume must match).

Imported by the ranks that :func:`mcore.testing.distributed.run_distributed` starts. The model, the
shims and the args come from :mod:`megatron_runs`; the data is :class:`ckpt_runs.TinyDataset` (vocabulary
100), the samples in order, so that mcore's ``pretrain`` resumed from the checkpoint (its sampler
continues at ``args.consumed_train_samples``) sees the samples Megatron went on with.

Megatron's side follows Megatron-LM's ``train_step`` for one micro-batch per iteration: the
megatron-core ``DistributedDataParallel`` wrapper (grad buffers; ``--use-distributed-optimizer``
optional), ``get_megatron_optimizer`` (torch's AdamW on CPU, the default weight-decay groups, gradient
clipping 1.0), and ``OptimizerParamScheduler`` (constant learning rate) stepped by the global batch.
``--ckpt-format torch``: ``model_optim_rng.pt`` holds ``optimizer.state_dict()`` and
``opt_param_scheduler``; the distributed optimizer's parameter state goes to ``distrib_optim.pt``
(``save_parameter_state``), as ``megatron/training/checkpointing.py`` writes them. ``--ckpt-format
torch_dist`` (:func:`save_torch_dist`): the model's and the optimizer's sharded state dicts.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import megatron_runs as mr  # noqa: E402

LR = 3e-3
GLOBAL_BATCH = 4
SAVED_AT = 3  # Megatron iterations before the save
CONTINUE = 3  # iterations after it (the reference losses)
TRAIN_ITERS = SAVED_AT + CONTINUE
SEED = 1234  # mcore's default --seed: TinyDataset(seed) gives the same samples on both sides
DATA_VOCAB = 100  # the token ids of the samples (megatron_runs.tiny_datasets_provider's)

# The softmax of the loss runs over the padded vocabulary, whose extra rows are trained parameters: the
# losses of two runs agree only when their padded vocabularies do. Megatron pads to 128 * TP (256 at
# TP=2), mcore at TP=1 to 128: a vocabulary of 256 (mcore: NullTokenizer --vocab-size 255, plus its
# end-of-document id) is padded to 256 by both.
FAMILY = "gpt256"
mr.FAMILIES[FAMILY] = {**mr.FAMILIES["gpt"], "vocab_size": 256}
MCORE_VOCAB_FLAG = "255"


class _CpuTorch:
    """``torch`` as megatron-core's optimizer modules see it: a ``device="cuda"`` becomes the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _factory(fn):
        def make(*args, device=None, **kwargs):
            return fn(*args, device="cpu" if device == "cuda" else device, **kwargs)

        return make

    def __init__(self):
        for name in ("tensor", "zeros", "empty", "ones"):
            setattr(self, name, self._factory(getattr(torch, name)))


def shim_megatron_optimizer_for_cpu() -> None:
    """megatron-core's optimizer on CPU: the scale and found-inf tensors it makes on ``"cuda"`` are
    made on the CPU, and its check that parameters are CUDA tensors (``param.type()``) sees the CUDA
    name of the same type."""
    import megatron.core.distributed.param_and_grad_buffer as pgb
    import megatron.core.optimizer.clip_grads as clip
    import megatron.core.optimizer.distrib_optimizer as dopt
    import megatron.core.optimizer.optimizer as opt
    import megatron.core.utils as mutils

    for module in (opt, clip, dopt, pgb, mutils):
        module.torch = _CpuTorch()
    if getattr(torch.Tensor.type, "_cuda_names", False):
        return  # shimmed already (several runs in one process)
    plain_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        if args or kwargs:
            return plain_type(self, *args, **kwargs)
        return plain_type(self).replace("torch.", "torch.cuda.", 1)

    cuda_type._cuda_names = True
    torch.Tensor.type = cuda_type


def batch(iteration: int, family: str) -> dict[str, torch.Tensor]:
    """The global batch of ``iteration`` (0-based): TinyDataset samples in order."""
    from ckpt_runs import TinyDataset

    data = TinyDataset(GLOBAL_BATCH * TRAIN_ITERS, mr.SEQ, DATA_VOCAB, SEED)
    samples = [data[i] for i in range(iteration * GLOBAL_BATCH, (iteration + 1) * GLOBAL_BATCH)]
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def _per_param_state(optimizer, ddp_model, distributed: bool) -> dict[str, dict[str, torch.Tensor]]:
    """name -> {param (the fp32 main copy), exp_avg, exp_avg_sq, step} of this TP rank, read through
    Megatron's own optimizer objects (the reference the reader's mapping is checked against)."""
    inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
    masters = {}  # bf16 model parameter -> its fp32 main copy (the non-distributed mixed-precision optimizer)
    for model_group, main_group in zip(
        getattr(inner, "float16_groups", []), getattr(inner, "fp32_from_float16_groups", [])
    ):
        masters.update({id(p): m for p, m in zip(model_group, main_group)})
    out = {}
    for name, param in ddp_model.module.named_parameters():
        name = name.removeprefix("module.")  # Float16Module
        if distributed:
            tensors = inner._get_main_param_and_optimizer_states(param)
            keys = ("param", "exp_avg", "exp_avg_sq")
            state = {k: tensors[k].detach().clone().reshape(param.shape) for k in keys}
        else:
            main = masters.get(id(param), param)
            st = inner.optimizer.state[main]
            state = {"param": main.detach().clone(), "exp_avg": st["exp_avg"].clone()}
            state["exp_avg_sq"] = st["exp_avg_sq"].clone()
        out[name] = state
    return out


def save_torch_dist(
    root: str, ddp, optimizer, scheduler, args, distributed: bool, sharding: str = "fully_reshardable"
) -> None:
    """``--ckpt-format torch_dist`` as Megatron-LM's ``save_checkpoint`` writes it: the model's and the
    optimizer's sharded state dicts through ``dist_checkpointing.save``; the distributed optimizer in
    the ``sharding`` layout (``fully_reshardable``: model space, ``--dist-ckpt-optim-fully-reshardable``;
    ``dp_reshardable``: Megatron-LM's default, bucket space)."""

    folder = os.path.join(root, f"iter_{SAVED_AT:07d}")
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    model_sd = ddp.module.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": sharding} if distributed else None
    dist_args = argparse.Namespace(**{**vars(args), "ckpt_format": "torch_dist"})
    sharded = {
        "args": dist_args,
        "checkpoint_version": 3.0,
        "iteration": SAVED_AT,
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=metadata),
        "opt_param_scheduler": scheduler.state_dict(),
    }
    mr.save_dist_checkpoint(sharded, folder)


def train_save_continue(out_dir: str, family: str, distributed: bool, bf16: bool = False) -> dict:
    """Rank function (TP=2, PP=1): train ``SAVED_AT`` Adam iterations, save ``<out_dir>/torch``
    (``model_optim_rng.pt`` with the optimizer state, ``distrib_optim.pt`` with
    ``distributed``), write Megatron's per-parameter optimizer state to
    ``<out_dir>/reference_tp<r>.pt``, then train ``CONTINUE`` more; returns the losses."""
    mr.shim_megatron_for_cpu()
    shim_megatron_optimizer_for_cpu()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    tp = dist.get_world_size()
    ps.initialize_model_parallel(tp, 1)
    torch.manual_seed(1234)
    model = mr.build_megatron_model(family, tp, 1)
    mr.perturb_norms_and_biases(model)
    if bf16:  # Megatron-LM's --bf16: the model in bf16 (Float16Module), fp32 main params and grads
        from megatron.core.transformer.module import Float16Module

        model.config.bf16 = True
        model = Float16Module(model.config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=bf16, overlap_grad_reduce=False, use_distributed_optimizer=distributed
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        min_lr=0.0,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        clip_grad=1.0,
        use_distributed_optimizer=distributed,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    decay_steps = TRAIN_ITERS * GLOBAL_BATCH
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=LR,
        max_lr=LR,
        min_lr=0.0,
        lr_warmup_steps=0,
        lr_decay_steps=decay_steps,
        lr_decay_style="constant",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    _, pos, mask = mr.inputs(family)
    pos = torch.arange(mr.SEQ).expand(GLOBAL_BATCH, mr.SEQ)

    def train_step(iteration: int) -> float:
        data = batch(iteration, family)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        ddp.train()
        per_token = ddp(data["tokens"], pos, attention_mask=mask, labels=data["labels"])  # [b, s]
        loss = (per_token.float() * data["loss_mask"]).sum() / data["loss_mask"].sum()
        loss.backward()
        ddp.finish_grad_sync()
        ok, _, _ = optimizer.step()
        assert ok
        scheduler.step(increment=GLOBAL_BATCH)
        return loss.item()

    losses = [train_step(i) for i in range(SAVED_AT)]

    tp_rank = ps.get_tensor_model_parallel_rank()
    folder = os.path.join(out_dir, "torch", f"iter_{SAVED_AT:07d}", f"mp_rank_{tp_rank:02d}")
    os.makedirs(folder, exist_ok=True)
    args = mr.megatron_args(family, tp, 1, dist.get_world_size(), "torch")
    args.iteration = SAVED_AT
    args.consumed_train_samples = SAVED_AT * GLOBAL_BATCH
    args.global_batch_size = GLOBAL_BATCH
    args.micro_batch_size = GLOBAL_BATCH
    args.train_iters = TRAIN_ITERS
    args.optimizer = "adam"
    args.use_distributed_optimizer = distributed
    args.lr = LR
    args.bf16 = bf16
    args.params_dtype = torch.bfloat16 if bf16 else torch.float32
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": SAVED_AT,
        "model": ddp.module.state_dict_for_save_checkpoint(),
        "optimizer": optimizer.state_dict(),
        "opt_param_scheduler": scheduler.state_dict(),
        "num_floating_point_operations_so_far": 0,
    }
    torch.save(state, os.path.join(folder, "model_optim_rng.pt"))
    if distributed:
        optimizer.save_parameter_state(os.path.join(folder, "distrib_optim.pt"))
    torch.save(
        _per_param_state(optimizer, ddp, distributed), os.path.join(out_dir, f"reference_tp{tp_rank}.pt")
    )
    save_torch_dist(os.path.join(out_dir, "torch_dist"), ddp, optimizer, scheduler, args, distributed)
    if distributed:
        save_torch_dist(
            os.path.join(out_dir, "torch_dist_bucket_space"),
            ddp,
            optimizer,
            scheduler,
            args,
            True,
            "dp_reshardable",
        )
    dist.barrier()
    if dist.get_rank() == 0:
        for fmt in ("torch", "torch_dist") + (("torch_dist_bucket_space",) if distributed else ()):
            with open(os.path.join(out_dir, fmt, "latest_checkpointed_iteration.txt"), "w") as fh:
                fh.write(str(SAVED_AT))

    continued = [train_step(i) for i in range(SAVED_AT, TRAIN_ITERS)]
    ps.destroy_model_parallel()
    return {"losses": losses, "continued": continued}


# -- the mcore side ---------------------------------------------------------------------------------


def mcore_resume(load: str, save: str, extra: list[str]) -> dict:
    """Rank function: mcore's ``pretrain`` resumes the Megatron checkpoint (optimizer state and
    schedule included: no ``--no-load-optim``) with Megatron's hyperparameters and continues to
    iteration ``TRAIN_ITERS`` on the same samples; returns the losses of the continued iterations."""
    from mcore.testing.distributed import test_backend_name
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    argv = [
        "--device-backend", test_backend_name(),
        "--load", load, "--use-checkpoint-args",
        "--save", save, "--save-interval", "1000",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--global-batch-size", str(GLOBAL_BATCH),
        "--lr", str(LR), "--min-lr", "0", "--lr-decay-style", "constant",
        "--weight-decay", "0.01", "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--adam-eps", "1e-8",
        "--clip-grad", "1.0", "--train-iters", str(TRAIN_ITERS), "--seed", str(SEED),
        "--tokenizer-type", "NullTokenizer", "--vocab-size", MCORE_VOCAB_FLAG,
        "--log-interval", "1000", "--eval-iters", "0", "--num-workers", "0",
        *extra,
    ]  # fmt: skip
    result = pretrain(model_provider, forward_step, mr.tiny_datasets_provider, argv=argv)
    return {"losses": list(result.train_losses), "iteration": result.state.iteration}


def train_variants(out_root: str, family: str, variants: list[tuple[str, bool, bool]]) -> dict:
    """Rank function: :func:`train_save_continue` for each ``(name, distributed, bf16)`` into
    ``<out_root>/<name>`` in one process (one start-up for all)."""
    results = {}
    for name, distributed, bf16 in variants:
        os.makedirs(os.path.join(out_root, name), exist_ok=True)
        results[name] = train_save_continue(os.path.join(out_root, name), family, distributed, bf16)
    return results


def train_save_dp_layouts(out_dir: str, family: str) -> int:
    """Rank function (TP=1, DP=world, the distributed optimizer): train ``SAVED_AT`` Adam iterations,
    each DP rank on its slice of the global batch, and save ``torch_dist`` twice,
    ``<out_dir>/fully_reshardable`` (model space) and ``<out_dir>/dp_reshardable`` (bucket space, each
    bucket's DP shards stored as pieces of one tensor, a parameter split where a shard ends)."""
    mr.shim_megatron_for_cpu()
    shim_megatron_optimizer_for_cpu()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    dp = dist.get_world_size()
    ps.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    model = mr.build_megatron_model(family, 1, 1)
    mr.perturb_norms_and_biases(model)
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=True)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=LR, weight_decay=0.01, clip_grad=1.0, use_distributed_optimizer=True
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    decay = TRAIN_ITERS * GLOBAL_BATCH
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=LR, max_lr=LR, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=decay,
        lr_decay_style="constant", start_wd=0.01, end_wd=0.01, wd_incr_steps=decay, wd_incr_style="constant",
    )  # fmt: skip
    _, _, mask = mr.inputs(family)
    micro = GLOBAL_BATCH // dp
    rows = slice(ps.get_data_parallel_rank() * micro, (ps.get_data_parallel_rank() + 1) * micro)
    pos = torch.arange(mr.SEQ).expand(micro, mr.SEQ)
    for iteration in range(SAVED_AT):
        data = {k: v[rows] for k, v in batch(iteration, family).items()}
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        per_token = ddp(data["tokens"], pos, attention_mask=mask, labels=data["labels"])
        ((per_token * data["loss_mask"]).sum() / data["loss_mask"].sum()).backward()
        ddp.finish_grad_sync()
        assert optimizer.step()[0]
        scheduler.step(increment=GLOBAL_BATCH)
    args = mr.megatron_args(family, 1, 1, dp, "torch")
    args.iteration, args.consumed_train_samples, args.train_iters = (
        SAVED_AT,
        SAVED_AT * GLOBAL_BATCH,
        TRAIN_ITERS,
    )
    args.global_batch_size, args.micro_batch_size, args.lr = GLOBAL_BATCH, micro, LR
    args.optimizer, args.use_distributed_optimizer, args.bf16, args.params_dtype = (
        "adam",
        True,
        False,
        torch.float32,
    )
    for sharding in ("fully_reshardable", "dp_reshardable"):
        save_torch_dist(os.path.join(out_dir, sharding), ddp, optimizer, scheduler, args, True, sharding)
        if dist.get_rank() == 0:
            with open(os.path.join(out_dir, sharding, "latest_checkpointed_iteration.txt"), "w") as fh:
                fh.write(str(SAVED_AT))
    dist.barrier()
    ps.destroy_model_parallel()
    return dp
