"""The GPT model trained with TP/SP/PP x DP, DDP and the (distributed) optimizer equals one process.

Each layout runs a few optimizer steps of Adam with gradient clipping (active at every step) on the
same global batch as a single process that accumulates gradients over micro-batches. Losses, the
global gradient norms (no parameter counted twice: tp-replicated norms and biases, the tied
embedding's last-stage copy) and the final logical weights must match.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from mcore.config.parallel import ParallelConfig
from mcore.distributed.ddp import DDPConfig, DistributedDataParallel
from mcore.distributed.finalize import finalize_model_grads
from mcore.distributed.groups import initialize_parallel
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.build_context import default_device
from mcore.models.transformer.model_config import ModelConfig
from mcore.optimizer import OptimizerConfig, PrecisionConfig, build_optimizer
from mcore.pipeline import get_forward_backward_func
from mcore.pipeline.layout import build_model_chunks
from mcore.testing.distributed import run_distributed

SEQ, MBS, VOCAB, GLOBAL_BATCH, STEPS = 8, 1, 64, 4, 3
MODEL = dict(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=4,
    seq_length=SEQ,
    max_position_embeddings=SEQ,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
CLIP = 0.05  # below every step's gradient norm, so clipping is always active


def forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    output = model(tokens, labels=labels)

    def loss_func(per_token_loss):
        loss = per_token_loss.mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _batches(step, dp_rank, dp_size):
    gen = torch.Generator().manual_seed(10 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    per_rank = GLOBAL_BATCH // dp_size
    mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank].to(default_device())
    return [(mine[i : i + MBS, :-1], mine[i : i + MBS, 1:]) for i in range(0, per_rank, MBS)]


def _logical_weights(chunks, groups):
    out = {}
    for chunk in chunks:
        params = dict(chunk.module.named_parameters())
        for local_name, spec in chunk.module.sharded_parameters().items():
            local = params[local_name].detach().float()
            if groups.tp_size > 1:
                parts = [torch.empty_like(local) for _ in range(groups.tp_size)]
                dist.all_gather(parts, local.contiguous(), group=groups.tp)
                local = spec.merge(parts)
            out[spec.name + (" (tied copy)" if spec.tied_copy else "")] = local.cpu()
    return out


def _train(tp=1, pp=1, sp=False, configs=({},)):
    parallel = ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp
    )
    groups = initialize_parallel(parallel)
    results = []
    for options in configs:
        opt_cfg = OptimizerConfig(
            clip_grad=CLIP,
            use_distributed_optimizer=options.get("distopt", False),
            overlap_param_gather=options.get("overlap_param_gather", False),
        )
        prec = PrecisionConfig()
        ddp_cfg = DDPConfig(overlap_grad_reduce=options.get("overlap", False), ddp_bucket_size=500)
        ddp_cfg = ddp_cfg.with_training(opt_cfg, prec)
        provider = functools.partial(GPTModel, ModelConfig(**MODEL), groups, VOCAB, sequence_parallel=sp)
        chunks = [
            DistributedDataParallel(c, ddp_cfg, groups)
            for c in build_model_chunks(provider, groups, parallel, 2)
        ]
        optimizer = build_optimizer(opt_cfg, prec, chunks, groups, lr=0.01)
        schedule = get_forward_backward_func(groups.pp_size, len(chunks))
        history = []
        for step in range(STEPS):
            optimizer.zero_grad()
            batches = _batches(step, groups.dp_rank, groups.dp_size)
            logs = schedule(
                forward_step_func=forward_step,
                data_iterator=[iter(batches) for _ in chunks],
                model=chunks,
                num_microbatches=len(batches),
                seq_length=SEQ,
                micro_batch_size=MBS,
                hidden_size=MODEL["hidden_size"],
                groups=groups,
                sequence_parallel=sp,
                grad_scale_func=optimizer.scale_loss,
                no_sync_func=[c.no_sync for c in chunks],
                finalize_grads_func=finalize_model_grads,
                timeout_s=60,
            )
            ok, norm, _ = optimizer.step()
            norm = (
                float(norm) if isinstance(norm, torch.Tensor) else norm
            )  # the one-pass step returns a device tensor
            loss = None
            if groups.is_last_stage:
                total = torch.stack([log["lm loss"] for log in logs]).mean().reshape(1)
                if groups.dp is not None:
                    dist.all_reduce(total, group=groups.dp)
                loss = total.item() / groups.dp_size
            history.append((ok, norm, loss))
        optimizer.finish_param_sync()
        results.append((history, _logical_weights(chunks, groups)))
    return results


@pytest.fixture(scope="module")
def reference():
    return _train()[0]


def _check(results, reference):
    ref_history, ref_weights = reference
    for per_rank in results:
        for history, weights in per_rank:
            for (ok, norm, loss), (_, ref_norm, ref_loss) in zip(history, ref_history):
                assert ok and ref_norm > CLIP
                assert norm == pytest.approx(ref_norm, rel=1e-5)
                assert loss is None or loss == pytest.approx(ref_loss, rel=1e-5)
            for name, value in weights.items():
                expected = ref_weights[name.replace(" (tied copy)", "")]
                torch.testing.assert_close(
                    value, expected, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
                )


def test_tp2_dp2(reference):
    configs = [{"overlap": True}, {"distopt": True, "overlap": True, "overlap_param_gather": True}]
    _check(run_distributed(_train, 4, tp=2, configs=configs), reference)


def test_tp2_sequence_parallel_dp2_distributed_optimizer(reference):
    _check(run_distributed(_train, 4, tp=2, sp=True, configs=[{"distopt": True, "overlap": True}]), reference)


def test_pp2_dp2_tied_embeddings(reference):
    configs = [{"overlap": True}, {"distopt": True, "overlap": True}]
    results = run_distributed(_train, 4, pp=2, configs=configs)
    _check(results, reference)
    assert any("embedding.word_embeddings.weight (tied copy)" in w for r in results for _, w in r)
