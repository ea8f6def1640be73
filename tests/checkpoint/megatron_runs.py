"""megatron-core (the PyPI ``megatron-core``) on CPU with gloo: build a tiny GPT or Llama-style model at
TP x PP, save it as Megatron-LM's training loop would (``--ckpt-format torch`` and ``torch_dist``), and
compute its logits; or load a checkpoint into megatron-core's own GPTModel and compute its logits.

Imported by the ranks that :func:`mcore.testing.distributed.run_distributed` starts. The three CUDA
assumptions of megatron-core are shimmed per process:
the global memory buffer's device, the CUDA RNG tracker the attention forks, and ``Tensor.cuda()`` in the
tied-embedding sync between the first and last pipeline stages.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist

ITERATION = 7
BATCH, SEQ = 2, 12

FAMILIES = {
    # GPT-2-like: learned positions, LayerNorm, exact GeLU, biases, tied embeddings.
    "gpt": dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        vocab_size=100,
        max_position_embeddings=32,
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        swiglu=False,
        add_bias_linear=True,
        num_query_groups=None,
        tied=True,
        rotary_base=10000,
        norm_epsilon=1e-5,
        qk_layernorm=False,
    ),
    # Llama-style: RoPE, RMSNorm, SwiGLU, GQA (8 heads, 2 groups), no biases, untied output layer,
    # per-head QK layernorm (Qwen3-style; megatron-core's self_attention.{q,k}_layernorm.weight).
    "llama": dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=8,
        ffn_hidden_size=96,
        vocab_size=100,
        max_position_embeddings=32,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        num_query_groups=2,
        tied=False,
        rotary_base=5000,
        norm_epsilon=1e-6,
        qk_layernorm=True,
    ),
}
# Mixture of experts (Qwen2-MoE-like): the llama family's attention, 4 SwiGLU experts (top 2) and a
# gated shared expert in every layer (megatron-core's SequentialMLP: local_experts.N names); trained and
# saved at TP=2 x EP=2 by megatron_moe_runs.
MOE = dict(
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=24,
    moe_shared_expert_intermediate_size=40,
    moe_shared_expert_gate=True,
    moe_token_dispatcher_type="allgather",
)
FAMILIES["moe"] = {**FAMILIES["llama"], "num_layers": 2, "moe": MOE}


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    m = divisible_by * tp
    return -(-vocab // m) * m


def shim_megatron_for_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    import megatron.core.transformer.dot_product_attention as mdpa
    from megatron.core import tensor_parallel

    class _NoTracker:
        def fork(self, name=None):
            return contextlib.nullcontext()

    mdpa.get_cuda_rng_tracker = tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: _NoTracker()
    # megatron-core 0.16's router GEMM names te_general_gemm, which is undefined without Transformer Engine
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def megatron_args(family: str, tp: int, pp: int, world: int, fmt: str) -> argparse.Namespace:
    """The fields of Megatron-LM's ``args`` that describe the model and the run (as its
    ``arguments.py`` names them)."""
    f = FAMILIES[family]
    gqa = f["num_query_groups"] is not None
    return argparse.Namespace(
        num_layers=f["num_layers"],
        hidden_size=f["hidden_size"],
        ffn_hidden_size=f["ffn_hidden_size"],
        num_attention_heads=f["num_attention_heads"],
        group_query_attention=gqa,
        num_query_groups=f["num_query_groups"] if gqa else 1,
        kv_channels=f["hidden_size"] // f["num_attention_heads"],
        max_position_embeddings=f["max_position_embeddings"],
        seq_length=SEQ,
        position_embedding_type=f["position_embedding_type"],
        rotary_base=f["rotary_base"],
        rotary_percent=1.0,
        rotary_interleaved=False,
        normalization=f["normalization"],
        norm_epsilon=f["norm_epsilon"],
        swiglu=f["swiglu"],
        openai_gelu=False,
        bias_gelu_fusion=False,
        squared_relu=False,
        add_bias_linear=f["add_bias_linear"],
        add_qkv_bias=f["add_bias_linear"],
        untie_embeddings_and_output_weights=not f["tied"],
        apply_residual_connection_post_layernorm=False,
        qk_layernorm=f["qk_layernorm"],
        multi_latent_attention=False,
        **{"num_experts": None, **f.get("moe", {})},
        padded_vocab_size=padded_vocab(f["vocab_size"], tp),
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        data_parallel_size=world // (tp * pp),
        world_size=world,
        transformer_impl="local",
        ckpt_format=fmt,
        params_dtype=torch.float32,
        fp16=False,
        bf16=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        seed=1234,
        iteration=ITERATION,
        train_iters=100,
        consumed_train_samples=ITERATION * 4,
        consumed_valid_samples=0,
        micro_batch_size=2,
        global_batch_size=4,
        tokenizer_type="NullTokenizer",
        vocab_size=f["vocab_size"],
    )


def build_megatron_model(family: str, tp: int, pp: int):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    f = FAMILIES[family]
    kwargs = {}
    if f["swiglu"]:
        kwargs.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    cfg = TransformerConfig(
        num_layers=f["num_layers"],
        hidden_size=f["hidden_size"],
        num_attention_heads=f["num_attention_heads"],
        num_query_groups=f["num_query_groups"],
        ffn_hidden_size=f["ffn_hidden_size"],
        normalization=f["normalization"],
        layernorm_epsilon=f["norm_epsilon"],
        add_bias_linear=f["add_bias_linear"],
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        init_method_std=0.02,
        qk_layernorm=f["qk_layernorm"],
        **{("num_moe_experts" if k == "num_experts" else k): v for k, v in f.get("moe", {}).items()},
        **kwargs,
    )
    rope = f["position_embedding_type"] == "rope"
    model = GPTModel(
        cfg,
        get_gpt_layer_local_spec(
            num_experts=f.get("moe", {}).get("num_experts"),
            normalization=f["normalization"],
            qk_layernorm=f["qk_layernorm"],
        ),
        vocab_size=padded_vocab(f["vocab_size"], tp),
        max_sequence_length=f["max_position_embeddings"],
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=f["tied"],
        position_embedding_type=f["position_embedding_type"],
        rotary_base=f["rotary_base"] if rope else 10000,
    )
    return model


def perturb_norms_and_biases(model) -> None:
    """Random non-trivial norm weights and biases, so a mapping mistake shows in the logits. A
    replicated parameter gets the same values on every TP rank (as Megatron keeps them)."""
    import zlib

    from megatron.core import parallel_state as ps

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                split = getattr(p, "tensor_model_parallel", False)
                seed = zlib.crc32(name.encode()) + 7919 * ps.get_pipeline_model_parallel_rank()
                seed += 104729 * ps.get_tensor_model_parallel_rank() if split else 0
                g = torch.Generator().manual_seed(seed)
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def inputs(family: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(0, FAMILIES[family]["vocab_size"], (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool()
    return ids, pos, mask


@torch.no_grad()
def megatron_logits(model, family: str, tp: int, pp: int) -> torch.Tensor | None:
    """Forward through the pipeline (stage outputs sent with gloo p2p); the full-vocabulary logits
    ``[b, s, Vp]`` on the last stage's TP rank 0, None elsewhere."""
    from megatron.core import parallel_state as ps

    model.eval()
    ids, pos, mask = inputs(family)
    rank = dist.get_rank()
    hidden = None
    if not ps.is_pipeline_first_stage():
        f = FAMILIES[family]
        hidden = torch.empty(SEQ, BATCH, f["hidden_size"])
        dist.recv(hidden, src=rank - tp)  # the previous stage's same-TP rank (order tp-dp-pp, dp=1)
        model.set_input_tensor(hidden)
    out = model(ids, pos, attention_mask=mask)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=rank + tp)
        return None
    parts = [torch.empty_like(out) for _ in range(tp)]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1) if ps.get_tensor_model_parallel_rank() == 0 else None


def save_megatron_families(out_dir: str, families: list[str], tp: int, pp: int) -> None:
    """Rank function: :func:`save_megatron_checkpoints` for each family into ``out_dir/<family>``."""
    for family in families:
        folder = os.path.join(out_dir, family)
        os.makedirs(folder, exist_ok=True)
        save_megatron_checkpoints(folder, family, tp, pp)


def save_megatron_checkpoints(out_dir: str, family: str, tp: int, pp: int) -> str | None:
    """Rank function: build the model at TP x PP, save ``<out_dir>/torch`` and ``<out_dir>/torch_dist``,
    and write its logits to ``<out_dir>/logits.pt`` (from the rank that has them)."""
    shim_megatron_for_cpu()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tp, pp)
    # Megatron's seeding (megatron/training/initialize.py): seed + 100 * pipeline rank, the same on
    # every TP rank, so replicated parameters (position embeddings) start equal on all of them.
    torch.manual_seed(1234 + 100 * ps.get_pipeline_model_parallel_rank())
    model = build_megatron_model(family, tp, pp)
    perturb_norms_and_biases(model)
    if FAMILIES[family]["tied"] and pp > 1:
        weight = model.shared_embedding_or_output_weight()  # make the stage copies equal again
        if ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage():
            src = weight.data.clone() if ps.is_pipeline_first_stage() else torch.zeros_like(weight.data)
            dist.all_reduce(src, group=ps.get_embedding_group())
            weight.data.copy_(src)
    world = dist.get_world_size()
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()

    # --ckpt-format torch (megatron/training/checkpointing.py: get_checkpoint_name, generate_state_dict)
    root = os.path.join(out_dir, "torch")
    sub = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    folder = os.path.join(root, f"iter_{ITERATION:07d}", sub)
    os.makedirs(folder, exist_ok=True)
    state = {
        "args": megatron_args(family, tp, pp, world, "torch"),
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": model.state_dict_for_save_checkpoint(),
        "rng_state": [
            {
                "random_rng_state": __import__("random").getstate(),
                "np_rng_state": __import__("numpy").random.get_state(),
                "torch_rng_state": torch.get_rng_state(),
                "cuda_rng_state": torch.get_rng_state(),
                "rng_tracker_states": {},
            }
        ],
        "num_floating_point_operations_so_far": 0,
    }
    torch.save(state, os.path.join(folder, "model_optim_rng.pt"))

    # --ckpt-format torch_dist (megatron.core.dist_checkpointing.save of the sharded state dict)
    dist_root = os.path.join(out_dir, "torch_dist")
    dist_dir = os.path.join(dist_root, f"iter_{ITERATION:07d}")
    if dist.get_rank() == 0:
        os.makedirs(dist_dir, exist_ok=True)
    dist.barrier()
    sharded = {
        "args": megatron_args(family, tp, pp, world, "torch_dist"),
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": model.sharded_state_dict(),
    }
    save_dist_checkpoint(sharded, dist_dir)
    dist.barrier()
    if dist.get_rank() == 0:
        for r in (root, dist_root):
            with open(os.path.join(r, "latest_checkpointed_iteration.txt"), "w") as fh:
                fh.write(str(ITERATION))
    logits = megatron_logits(model, family, tp, pp)
    if logits is not None:
        torch.save({"ids": inputs(family)[0], "logits": logits}, os.path.join(out_dir, "logits.pt"))
    dist.barrier()
    ps.destroy_model_parallel()
    return None


def save_dist_checkpoint(sharded: dict, dist_dir: str) -> None:
    """``dist_checkpointing.save`` with the ``torch_dist`` strategy, from a test rank (collective)."""
    # Megatron's file writer forks one writer process per bucket and collects their results through
    # a spawned multiprocessing Manager. A test rank is daemonic (it may not have children) and its
    # main module is not importable by a spawned process: the save is synchronous here, so a plain
    # queue in this process serves, and the daemon flag is lifted while the writers run.
    import multiprocessing
    import queue

    import megatron.core.dist_checkpointing.strategies.filesystem_async as fs_async
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    fs_async._get_write_results_queue = queue.Queue
    fs_async._process_memory = lambda: 0  # a debug log of the writer (needs psutil)
    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
        dist_checkpointing.save(sharded, dist_dir, strategy)
    finally:
        config["daemon"] = daemon


def megatron_load_logits(ckpt_root: str, family: str, fmt: str) -> torch.Tensor:
    """Rank function (one process): load a checkpoint into megatron-core's own GPTModel (TP=1, PP=1)
    as Megatron-LM would (``torch``: ``load_state_dict(strict=True)`` of the ``model`` entry;
    ``torch_dist``: ``dist_checkpointing.load`` of the model's sharded state dict) and return its
    logits ``[b, s, Vp]``."""
    shim_megatron_for_cpu()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    model = build_megatron_model(family, 1, 1)
    with open(os.path.join(ckpt_root, "latest_checkpointed_iteration.txt")) as fh:
        iteration = int(fh.read().strip())
    folder = os.path.join(ckpt_root, f"iter_{iteration:07d}")
    if fmt == "torch":
        state = torch.load(os.path.join(folder, "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
        model.load_state_dict(state["model"], strict=True)
    else:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, folder)
        model.load_state_dict(loaded["model"], strict=True)
    logits = megatron_logits(model, family, 1, 1)
    ps.destroy_model_parallel()
    return logits


def megatron_load_logits_many(jobs: list[tuple[str, str, str]]) -> list[torch.Tensor]:
    """Rank function: :func:`megatron_load_logits` for each ``(ckpt_root, family, fmt)`` in one process."""
    return [megatron_load_logits(*job) for job in jobs]


# -- the mcore side ---------------------------------------------------------------------------------

TRAIN_ITERS = 3


def tiny_datasets_provider(cfg, tokenizer, num_samples):
    from ckpt_runs import TinyDataset

    train = TinyDataset(max(int(num_samples[0]), 1), cfg.model.seq_length, 100, cfg.training.seed)
    return train, None, None


def mcore_train_argv(load: str, save: str, tp: int, pp: int) -> list[str]:
    from mcore.testing.distributed import test_backend_name

    return [
        "--device-backend", test_backend_name(),
        "--load", load, "--use-checkpoint-args", "--no-load-optim",
        "--save", save, "--save-interval", "1000",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--micro-batch-size", "1", "--global-batch-size", "4",
        "--lr", "3e-3", "--train-iters", str(ITERATION + TRAIN_ITERS),
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--log-interval", "1000", "--eval-iters", "0", "--num-workers", "0",
    ]  # fmt: skip


def mcore_logits_and_training(load: str, save: str, family: str, tp: int, pp: int) -> dict:
    """Rank function: (1) load the Megatron checkpoint with mcore's training-loop loader at TP x PP
    (PP=1 here) and return the full logits of the reference inputs; (2) resume training from it with
    ``--use-checkpoint-args --no-load-optim`` for a few iterations, saving an mcore checkpoint."""
    from mcore.checkpoint import CheckpointConfig, load_checkpoint
    from mcore.checkpoint.checkpoint_args import checkpoint_model_flags
    from mcore.config.parallel import ParallelConfig
    from mcore.distributed.groups import initialize_parallel
    from mcore.inference.loading import build_model_chunk
    from mcore.models.transformer.model_config import ModelConfig
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    assert pp == 1
    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=tp))
    flags = checkpoint_model_flags(load)
    cfg = ModelConfig(**{**flags, "hidden_dropout": 0.0, "attention_dropout": 0.0})
    model = build_model_chunk(cfg, groups, 100, None, device=torch.device("cpu"))
    state = load_checkpoint(CheckpointConfig(load=load, no_load_optim=True), [model], None, None, groups)
    with torch.no_grad():
        local = model(inputs(family)[0])
    parts = [torch.empty_like(local) for _ in range(groups.tp_size)]
    dist.all_gather(parts, local.contiguous(), group=groups.tp)
    logits = torch.cat(parts, dim=-1)
    del model, groups, parts, local

    result = pretrain(
        model_provider, forward_step, tiny_datasets_provider, argv=mcore_train_argv(load, save, tp, pp)
    )
    return {
        "loaded_iteration": state["iteration"],
        "logits": logits,
        "losses": result.train_losses,
        "iteration": result.state.iteration,
        "consumed": result.state.consumed_train_samples,
    }
