"""Pipelined runs give the single-stage losses and gradients (real processes, gloo on CPU).

The model is a small stack of linear layers with Megatron's stage contract (``pre_process`` reads
the batch, later stages take ``set_input_tensor``, ``post_process`` returns per-token loss
``[b, s]``); every layer is initialized from its global index, so each layout holds the same weights.
"""

import pytest
import torch
from torch import nn

from mcore.config.parallel import ParallelConfig
from mcore.distributed.groups import ProcessGroups, initialize_parallel
from mcore.pipeline import PipelineStats, get_forward_backward_func
from mcore.pipeline.layout import build_model_chunks
from mcore.testing.distributed import run_distributed

SEQ, MBS, HIDDEN, LAYERS = 4, 2, 8, 8


class ToyStage(nn.Module):
    """Layers ``layer_offset .. layer_offset + num_layers - 1`` of a tanh-linear stack."""

    def __init__(self, *, pre_process, post_process, layer_offset, num_layers):
        super().__init__()
        self.pre_process, self.post_process, self.layer_offset = pre_process, post_process, layer_offset
        self.layers = nn.ModuleList()
        for i in range(layer_offset, layer_offset + num_layers):
            layer = nn.Linear(HIDDEN, HIDDEN)
            gen = torch.Generator().manual_seed(1000 + i)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5)
                layer.bias.copy_(torch.randn(HIDDEN, generator=gen) * 0.1)
            self.layers.append(layer)
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x, target):
        h = x if self.pre_process else self.input_tensor
        for layer in self.layers:
            h = torch.tanh(layer(h))
        if not self.post_process:
            return h
        return ((h - target) ** 2).mean(-1).transpose(0, 1)  # [b, s]


def microbatches(num):
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(SEQ, MBS, HIDDEN, generator=gen), torch.randn(SEQ, MBS, HIDDEN, generator=gen)) for _ in range(num)]


def forward_step(data_iterator, model):
    x, target = next(data_iterator)
    output = model(x, target)

    def loss_func(per_token):
        loss = per_token.mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def run_step(groups, config, num_microbatches, forward_only=False):
    chunks = build_model_chunks(ToyStage, groups, config, LAYERS)
    batches = microbatches(num_microbatches)
    iterators = [iter(batches) for _ in chunks]
    schedule = get_forward_backward_func(groups.pp_size, len(chunks))
    finalized = []
    stats = PipelineStats()
    logs = schedule(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MBS,
        hidden_size=HIDDEN,
        groups=groups,
        forward_only=forward_only,
        finalize_grads_func=finalized.append,
        timeout_s=30,
        stats=stats,
    )
    grads = {}
    for chunk in chunks:
        for i, layer in enumerate(chunk.layers):
            grads[chunk.layer_offset + i] = None if layer.weight.grad is None else (layer.weight.grad, layer.bias.grad)
    return [float(log["lm loss"]) for log in logs], grads, len(finalized), stats.total_s >= stats.wait_s


def _pipelined(tp, pp, vp, num_microbatches, forward_only=False):
    config = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
    )
    groups = initialize_parallel(config)
    return groups.pp_rank, groups.is_last_stage, run_step(groups, config, num_microbatches, forward_only)


def reference(num_microbatches, forward_only=False):
    return run_step(ProcessGroups.single(), ParallelConfig(), num_microbatches, forward_only)


def check_against_reference(results, num_microbatches, forward_only=False):
    ref_losses, ref_grads, _, _ = reference(num_microbatches, forward_only)
    merged = {}
    for _, is_last, (losses, grads, finalized, timing_ok) in results:
        assert timing_ok
        assert finalized == (0 if forward_only else 1)
        if is_last:
            assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
        else:
            assert losses == []
        merged.update(grads)
    assert sorted(merged) == list(range(LAYERS))
    for layer, grad in merged.items():
        if forward_only:
            assert grad is None
            continue
        torch.testing.assert_close(grad[0], ref_grads[layer][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad[1], ref_grads[layer][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pp,vp,num_microbatches", [(2, 1, 4), (4, 1, 6), (2, 2, 4), (4, 1, 2)])
def test_pipeline_matches_single_stage(pp, vp, num_microbatches):
    results = run_distributed(_pipelined, pp, 1, pp, vp, num_microbatches, timeout=60)
    check_against_reference(results, num_microbatches)


def test_interleaved_forward_only_gives_the_losses():
    results = run_distributed(_pipelined, 2, 1, 2, 2, 4, True, timeout=60)
    check_against_reference(results, 4, forward_only=True)


def test_tp2_pp2_on_four_ranks():
    results = run_distributed(_pipelined, 4, 2, 2, 1, 4, timeout=60)
    check_against_reference(results, 4)
    # both tensor-parallel ranks of the last stage saw the losses
    assert [r[1] for r in results] == [False, False, True, True]

