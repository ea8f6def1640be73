"""Pipelined GPT steps give the single-stage losses and gradients (real processes, gloo on CPU).

A tiny GPT (4 layers, tied embeddings, no dropout) is built per stage with ``build_model_chunks``;
mcore initializes every tensor from its logical name and the seed, so each layout holds the same
weights. Gradients are compared per logical tensor (TP shards cut from the reference with
``ShardSpec.shard``), including both copies of the tied word embedding after the embedding-group
all-reduce.
"""

import contextlib
import functools

import pytest
import torch

from mcore.config.parallel import ParallelConfig
from mcore.distributed.finalize import finalize_model_grads
from mcore.distributed.groups import ProcessGroups, initialize_parallel
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.model_config import ModelConfig
from mcore.pipeline import PipelineStats, get_forward_backward_func
from mcore.pipeline.layout import build_model_chunks
from mcore.testing.distributed import run_distributed

SEQ, MBS, VOCAB = 8, 2, 64
MODEL = dict(
    num_layers=4,
    hidden_size=16,
    num_attention_heads=4,
    seq_length=SEQ,
    max_position_embeddings=SEQ,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def microbatches(num):
    gen = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
            torch.randint(0, VOCAB, (MBS, SEQ), generator=gen),
        )
        for _ in range(num)
    ]


def forward_step(data_iterator, model):
    device = next(model.parameters()).device  # the batch is made on the host
    tokens, labels = (t.to(device) for t in next(data_iterator))
    output = model(tokens, labels=labels)

    def loss_func(per_token_loss):
        loss = per_token_loss.mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def run_step(groups, parallel, num_microbatches, forward_only=False):
    config = ModelConfig(**MODEL)
    sp = parallel.sequence_parallel
    provider = functools.partial(GPTModel, config, groups, VOCAB, sequence_parallel=sp)
    chunks = build_model_chunks(provider, groups, parallel, config.num_layers)
    batches = microbatches(num_microbatches)
    schedule = get_forward_backward_func(groups.pp_size, len(chunks))
    stats = PipelineStats()
    events = []  # DDP's no_sync must stay on until the last backward of the step on this rank

    @contextlib.contextmanager
    def no_sync():
        events.append("no_sync on")
        yield
        events.append("no_sync off")

    for chunk in chunks:
        next(chunk.decoder.parameters()).register_hook(lambda grad: events.append("backward") or grad)
    logs = schedule(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MBS,
        hidden_size=config.hidden_size,
        groups=groups,
        sequence_parallel=sp,
        forward_only=forward_only,
        no_sync_func=no_sync,
        finalize_grads_func=lambda model_chunks: finalize_model_grads(model_chunks, groups),
        timeout_s=30,
        stats=stats,
    )
    grads = []
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for local_name, spec in chunk.sharded_parameters().items():
            grad = params[local_name].grad
            grads.append((spec, None if grad is None else grad.cpu()))
    assert 0 <= stats.wait_s <= stats.total_s
    if forward_only:
        assert events == []
    else:
        assert events.count("backward") == num_microbatches * len(chunks)
        assert events[0] == "no_sync on" and events[-2:] == ["no_sync off", "backward"], events
    return [float(log["lm loss"]) for log in logs], grads


def _pipelined(tp, pp, vp, num_microbatches, forward_only=False, sequence_parallel=False):
    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        sequence_parallel=sequence_parallel,
    )
    groups = initialize_parallel(parallel)
    result = run_step(groups, parallel, num_microbatches, forward_only)
    # The single-stage reference runs on this rank's device: initialization draws from the
    # device's generator, so a GPU run must be compared with a GPU reference.
    reference = run_step(ProcessGroups.single(), ParallelConfig(), num_microbatches, forward_only)
    return groups.is_last_stage, result, reference


def check_against_reference(results, num_microbatches, forward_only=False):
    ref_losses, ref_grads = results[0][2]
    reference = {spec.name: grad for spec, grad in ref_grads}
    seen = set()
    for is_last, (losses, grads), _ in results:
        if is_last:
            assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
        else:
            assert losses == []
        for spec, grad in grads:
            seen.add(spec.name)
            if forward_only:
                assert grad is None, spec.name
                continue
            assert grad is not None, spec.name
            expected = spec.shard(reference[spec.name])
            torch.testing.assert_close(
                grad, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=spec.name: f"{n}: {m}"
            )
    assert seen == set(reference)


@pytest.mark.parametrize(
    "pp,vp,num_microbatches",
    [(2, 1, 4), (4, 1, 6), (4, 1, 2), (2, 2, 4)],
    ids=["pp2-1f1b", "pp4-1f1b", "pp4-fewer-microbatches-than-stages", "pp2-vp2-interleaved"],
)
def test_pipeline_matches_single_stage(pp, vp, num_microbatches):
    results = run_distributed(_pipelined, pp, 1, pp, vp, num_microbatches, timeout=60)
    check_against_reference(results, num_microbatches)


def test_interleaved_evaluation_gives_the_losses_without_gradients():
    results = run_distributed(_pipelined, 2, 1, 2, 2, 4, True, timeout=60)
    check_against_reference(results, 4, forward_only=True)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2-pp2", "tp2-pp2-sp"])
def test_tensor_and_pipeline_parallel_on_four_ranks(sequence_parallel):
    results = run_distributed(_pipelined, 4, 2, 2, 1, 4, False, sequence_parallel, timeout=60)
    assert [is_last for is_last, _, _ in results] == [False, False, True, True]
    check_against_reference(results, 4)
