"""BERT at TP=2, TP=2 with sequence parallelism, and PP=2 reproduces the single-process model.

One 2-process launch (a module-scoped fixture). Each rank builds the single-process BertModel and the
parallel one from the same seed and compares, on a batch with padding, two token types and Megatron's
``-1`` labels where nothing is predicted:

* the initial weights (each rank's slices of the single-process tensors),
* the per-token MLM losses and the binary (NSP/SOP) logits,
* every gradient of ``masked-mean MLM loss + NSP loss`` (by logical name, TP slices cut from the
  reference with ``ShardSpec.shard``).

TP cases run with and without full / selective recomputation and ``--bert-no-binary-head``, and with
``--apply-residual-connection-post-layernorm`` plus untied output weights. PP=2 runs
through the real pipeline schedule (first stage: embedding + layer 0, last stage: layer 1 + heads;
two micro-batches; tied embedding copies summed by ``finalize_model_grads``).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F

from mcore.backend import current_backend
from mcore.config.parallel import ParallelConfig
from mcore.distributed.finalize import finalize_model_grads
from mcore.distributed.groups import ProcessGroups, initialize_parallel
from mcore.models.bert.bert_model import BertModel
from mcore.models.transformer.model_config import ModelConfig
from mcore.pipeline import get_forward_backward_func
from mcore.pipeline.layout import build_model_chunks
from mcore.testing.distributed import run_distributed

SEED, VOCAB, SEQ, BATCH = 1234, 128, 16, 2
MODEL = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=SEQ,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}
TOL = 1e-5


def _device() -> torch.device:
    return current_backend().device(int(os.environ.get("LOCAL_RANK", "0")))


def _batch(seed: int = 42) -> dict[str, torch.Tensor]:
    """Megatron's BERT sample keys: padding at the end of sample 1, labels -1 where not predicted."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    padding_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    padding_mask[1, 11:] = 0
    types = torch.zeros(BATCH, SEQ, dtype=torch.long)
    types[:, 6:] = 1
    predicted = (torch.rand(BATCH, SEQ, generator=gen) < 0.4) & (padding_mask == 1)
    labels = torch.where(predicted, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), -1)
    is_random = torch.tensor([0, 1])
    batch = dict(text=text, types=types, padding_mask=padding_mask, labels=labels, is_random=is_random)
    return {k: v.to(_device()) for k, v in batch.items()}


def _loss(output, batch, binary_head: bool) -> torch.Tensor:
    """Megatron's BERT loss: MLM loss averaged over the predicted tokens, plus the SOP/NSP loss."""
    lm_loss, binary_logits = output
    loss_mask = (batch["labels"] >= 0).float()
    loss = (lm_loss * loss_mask).sum() / loss_mask.sum()
    if binary_head:
        loss = loss + F.cross_entropy(binary_logits, batch["is_random"])
    return loss


VARIANTS = {"default": {}, "post-ln-residual-untied": dict(
    apply_residual_connection_post_layernorm=True, untie_embeddings_and_output_weights=True
)}  # fmt: skip


def _model(groups, sp=False, recompute="none", binary_head=True, variant="default", **chunk) -> BertModel:
    cfg = ModelConfig(**MODEL, **RECOMPUTE[recompute], **VARIANTS[variant])
    return BertModel(
        cfg,
        groups,
        VOCAB,
        sequence_parallel=sp,
        device=_device(),
        seed=SEED,
        add_binary_head=binary_head,
        **chunk,
    )


def _run(model: BertModel, binary_head: bool = True):
    batch = _batch()
    types = batch["types"] if binary_head else None
    output = model(batch["text"], batch["padding_mask"], types, lm_labels=batch["labels"])
    _loss(output, batch, binary_head).backward()
    model.all_reduce_sequence_parallel_grads()
    params = dict(model.named_parameters())
    grads = {spec.name: params[local].grad for local, spec in model.sharded_parameters().items()}
    weights = {spec.name: params[local].detach() for local, spec in model.sharded_parameters().items()}
    binary = None if output[1] is None else output[1].detach()
    return output[0].detach(), binary, grads, weights


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def _compare(model, result, reference) -> dict[str, float]:
    loss, binary, grads, weights = result
    ref_loss, ref_binary, ref_grads, ref_weights = reference
    worst_weight = worst_grad = 0.0
    for spec in model.sharded_parameters().values():
        worst_weight = max(worst_weight, _max_diff(weights[spec.name], spec.shard(ref_weights[spec.name])))
        worst_grad = max(worst_grad, _max_diff(grads[spec.name], spec.shard(ref_grads[spec.name])))
    out = {"weights": worst_weight, "loss": _max_diff(loss, ref_loss), "grads": worst_grad}
    if binary is not None:
        out["binary"] = _max_diff(binary, ref_binary)
    out["params"] = len(grads)
    return out


def _tensor_parallel_cases() -> dict:
    references = {bh: _run(_model(ProcessGroups.single(), binary_head=bh), bh) for bh in (True, False)}
    variant = "post-ln-residual-untied"
    references[variant] = _run(_model(ProcessGroups.single(), variant=variant))
    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=2))
    out = {}
    for sp in (False, True):
        model = _model(groups, sp, variant=variant)
        out[(sp, variant, True)] = _compare(model, _run(model), references[variant])
    for sp in (False, True):
        for recompute in RECOMPUTE:
            for binary_head in (True, False):
                if not binary_head and recompute != "none":
                    continue
                model = _model(groups, sp, recompute, binary_head)
                model.train()
                out[(sp, recompute, binary_head)] = _compare(
                    model, _run(model, binary_head), references[binary_head]
                )
    return out


# -- PP=2 through the pipeline schedule ---------------------------------------------------------------


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["text"], batch["padding_mask"], batch["types"], lm_labels=batch["labels"])
    return output, functools.partial(_pp_loss, batch)


def _pp_loss(batch, output):
    loss = _loss(output, batch, True)
    return loss, {"loss": loss.detach()}


def _pipelined_step(groups: ProcessGroups, parallel: ParallelConfig):
    provider = functools.partial(BertModel, ModelConfig(**MODEL), groups, VOCAB, device=_device(), seed=SEED)
    chunks = build_model_chunks(provider, groups, parallel, MODEL["num_layers"])
    batches = [_batch(1), _batch(2)]
    logs = get_forward_backward_func(groups.pp_size, len(chunks))(
        forward_step_func=_forward_step,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=BATCH,
        hidden_size=MODEL["hidden_size"],
        groups=groups,
        finalize_grads_func=lambda model_chunks: finalize_model_grads(model_chunks, groups),
        timeout_s=60,
    )
    grads = {}
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for local, spec in chunk.sharded_parameters().items():
            grads[(spec.name, spec.tied_copy)] = params[local].grad.detach().cpu()
    return [float(log["loss"]) for log in logs], grads


def _pipeline_case() -> dict:
    ref_losses, ref_grads = _pipelined_step(ProcessGroups.single(), ParallelConfig())
    parallel = ParallelConfig(pipeline_model_parallel_size=2)
    groups = initialize_parallel(parallel)
    losses, grads = _pipelined_step(groups, parallel)
    worst = max(_max_diff(g, ref_grads[(name, False)]) for (name, _), g in grads.items())
    return dict(
        is_last=groups.is_last_stage,
        losses=losses,
        ref_losses=ref_losses,
        grads=worst,
        names=sorted(grads),
    )


def _all_cases():
    return {"tp": _tensor_parallel_cases(), "pp": _pipeline_case()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_cases, 2, timeout=300)


def test_tensor_and_sequence_parallel_match_one_process(results):
    failures = []
    for rank, r in enumerate(results):
        assert len(r["tp"]) == 2 * (len(RECOMPUTE) + 2)
        for (sp, recompute, binary_head), diffs in r["tp"].items():
            if diffs["weights"] != 0.0 or any(v > TOL for k, v in diffs.items() if k != "params"):
                failures.append(
                    f"rank {rank} sp={sp} recompute={recompute} binary_head={binary_head}: {diffs}"
                )
    assert not failures, "\n".join(failures)
    with_head, without_head = (
        results[0]["tp"][(False, "none", True)],
        results[0]["tp"][(False, "none", False)],
    )
    # --bert-no-binary-head drops the pooler, the binary head (2 tensors each) and the token types.
    assert with_head["params"] - without_head["params"] == 5


def test_pipeline_parallel_matches_one_process(results):
    first, last = sorted(results, key=lambda r: r["pp"]["is_last"])
    assert first["pp"]["losses"] == [] and len(last["pp"]["losses"]) == 2
    assert last["pp"]["losses"] == pytest.approx(last["pp"]["ref_losses"], rel=1e-6)
    assert first["pp"]["grads"] <= TOL and last["pp"]["grads"] <= TOL
    first_names = {name for name, _ in first["pp"]["names"]}
    last_names = {name for name, _ in last["pp"]["names"]}
    assert (
        "embedding.tokentype_embeddings.weight" in first_names
        and "encoder.layers.1.input_layernorm.weight" in last_names
    )
    # The last stage holds the tied copy of the word embedding, summed with the first stage's.
    assert ("embedding.word_embeddings.weight", True) in last["pp"]["names"]
