"""``--output-layer-loss-chunks N``: the output layer and the loss over N chunks of tokens, each
chunk's logits recomputed in backward (:mod:`mcore.tensor_parallel.output_loss`).

Checked: the function against the output layer followed by the fused loss in float64 (chunk counts
from one to more than the rows, label smoothing, ignored labels); a GPT model with the flag has the
losses and the gradients of the model without it (tied and untied embeddings, label smoothing, plain
autograd and the DDP wrapper with gradient-accumulation fusion, fp32 and bf16); TP=2 with and without
sequence parallelism equals TP=1; the bytes kept for backward are those of ``--cross-entropy-loss-fusion``
less exactly the logits; the flag parses and a negative value is refused naming it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mcore.config.cli import build_parser, parse_config
from mcore.config.fields import ConfigError
from mcore.config.parallel import ParallelConfig
from mcore.distributed.ddp import DDPConfig, DistributedDataParallel
from mcore.distributed.finalize import finalize_model_grads
from mcore.distributed.groups import ProcessGroups, initialize_parallel
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.build_context import default_device
from mcore.models.transformer.model_config import ModelConfig
from mcore.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mcore.tensor_parallel.output_loss import linear_cross_entropy
from mcore.testing.distributed import run_distributed
from mcore.testing.memory import SavedActivations

SEQ, MBS, VOCAB, NUM_MICRO, CHUNKS = 8, 2, 80, 2, 3  # 16 token rows: chunks of 6, 6 and 4; V != 4h
MODEL = dict(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=4,
    seq_length=SEQ,
    max_position_embeddings=SEQ,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


# -- the function ------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [1, 3, 7, 100])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_function_matches_linear_then_fused_loss(chunks, smoothing):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 3, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(24, 8, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 24, (5, 3), generator=gen)
    labels[1, 2] = labels[4, 0] = -100  # ignored ids are outside every slice, as in the fused loss
    upstream = torch.rand(5, 3, generator=gen, dtype=torch.float64)

    x1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss1 = linear_cross_entropy(x1, w1, labels, num_chunks=chunks, label_smoothing=smoothing)
    (loss1 * upstream).sum().backward()
    x2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss2 = vocab_parallel_cross_entropy(F.linear(x2, w2), labels, None, smoothing, overwrite_logits=True)
    (loss2 * upstream).sum().backward()

    assert loss1.shape == labels.shape
    torch.testing.assert_close(loss1, loss2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-12, atol=1e-12)


def test_function_refuses_bad_chunks():
    x, w, y = torch.randn(2, 1, 4), torch.randn(6, 4), torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="--output-layer-loss-chunks"):
        linear_cross_entropy(x, w, y, num_chunks=0)


# -- GPT model ---------------------------------------------------------------------------------------


def _micro_batches():
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (NUM_MICRO, MBS, SEQ + 1), generator=gen).to(default_device())
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _run(groups, chunks, *, untie=False, smoothing=0.0, wrap=False, sp=False, dtype=torch.float32, ddp=None):
    """Per-micro-batch losses, logical gradients (TP shards merged) and the placeholder flags."""
    config = ModelConfig(**MODEL, untie_embeddings_and_output_weights=untie, output_layer_loss_chunks=chunks)
    module = GPTModel(config, groups, VOCAB, sequence_parallel=sp, params_dtype=dtype)
    model = DistributedDataParallel(module, ddp or DDPConfig(), groups) if wrap else module
    batches = _micro_batches()
    weights = torch.linspace(0.5, 1.5, MBS * SEQ, device=default_device()).view(MBS, SEQ)
    losses = []
    for i, (tokens, labels) in enumerate(batches):
        sync = model.no_sync() if wrap and i < len(batches) - 1 else contextlib.nullcontext()
        with sync:
            loss = model(tokens, labels=labels, label_smoothing=smoothing)
            (loss * weights).sum().backward()
        losses.append(loss.detach().float().cpu())
    if wrap:
        finalize_model_grads([model], groups)
    params = dict(module.named_parameters())
    grads, flags = {}, {}
    for name, spec in module.sharded_parameters().items():
        param = params[name]
        grad = (param.main_grad if wrap else param.grad).detach().float().clone()
        if wrap:
            assert param.grad is None, name
        if groups.tp_size > 1:
            parts = [torch.empty_like(grad) for _ in range(groups.tp_size)]
            dist.all_gather(parts, grad.contiguous(), group=groups.tp)
            grad = spec.merge(parts)
        grads[spec.name] = grad.cpu()
        flags[name] = getattr(param, "grad_added_to_main_grad", None)
    return torch.stack(losses), grads, flags


def _assert_close(actual, expected, **tolerance):
    losses, grads = actual
    ref_losses, ref_grads = expected
    torch.testing.assert_close(losses, ref_losses, **tolerance)
    assert grads.keys() == ref_grads.keys()
    for name, value in ref_grads.items():
        assert value.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], value, **tolerance, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("wrap", [False, True], ids=["autograd", "ddp-fusion"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("untie", [True, False], ids=["untied", "tied"])
def test_gpt_chunked_equals_default_fp32(untie, smoothing, wrap):
    single = ProcessGroups.single()
    ref_losses, ref_grads, _ = _run(single, 0, untie=untie, smoothing=smoothing, wrap=wrap)
    losses, grads, flags = _run(single, CHUNKS, untie=untie, smoothing=smoothing, wrap=wrap)
    _assert_close((losses, grads), (ref_losses, ref_grads), rtol=1e-5, atol=1e-6)
    if wrap and untie:  # the output layer fused its weight gradient into main_grad
        assert flags["output_layer.weight"] is True
    if wrap and not untie:  # the tied embedding: zero placeholder, the embedding's part via the hook
        assert flags["embedding.word_embeddings.weight"] is False
    if not wrap:
        assert not any(flags.values())


@pytest.mark.parametrize("grad_reduce_in_fp32", [False, True], ids=["bf16-grads", "fp32-grads"])
@pytest.mark.parametrize("untie", [True, False], ids=["untied", "tied"])
def test_gpt_chunked_equals_default_bf16(untie, grad_reduce_in_fp32):
    single = ProcessGroups.single()
    kw = dict(untie=untie, smoothing=0.1, wrap=True, dtype=torch.bfloat16)
    kw["ddp"] = DDPConfig(grad_reduce_in_fp32=grad_reduce_in_fp32)
    ref = _run(single, 0, **kw)
    out = _run(single, CHUNKS, **kw)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)  # fp32 losses of equal logits
    for name, value in ref[1].items():  # bf16 roundings of the logits' gradient and of its sums
        error = (out[1][name] - value).abs().max() / value.abs().max()
        assert error <= 2e-2, (name, error.item())  # measured <= 7e-3


def _last_stage_grads(chunks):
    """A last pipeline stage (not the first) with its tied copy of the word embedding, DDP + fusion."""
    single = ProcessGroups.single()
    config = ModelConfig(**MODEL, output_layer_loss_chunks=chunks)
    stage = GPTModel(config, single, VOCAB, pre_process=False, layer_offset=1, num_layers=1)
    model = DistributedDataParallel(stage, DDPConfig(), single)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(SEQ, MBS, MODEL["hidden_size"], generator=gen).to(default_device()).requires_grad_()
    stage.set_input_tensor(hidden)
    loss = model(None, labels=_micro_batches()[0][1], label_smoothing=0.1)
    loss.sum().backward()
    finalize_model_grads([model], single)
    grads = {n: p.main_grad.clone() for n, p in stage.named_parameters()}
    return loss.detach(), hidden.grad, grads, stage.output_layer.weight.grad_added_to_main_grad


def test_last_pipeline_stage_with_tied_copy():
    ref_loss, ref_dx, ref_grads, _ = _last_stage_grads(0)
    loss, dx, grads, fused = _last_stage_grads(CHUNKS)
    assert fused is True  # the stage owns its copy: fused with an empty placeholder
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-6)
    for name, value in ref_grads.items():
        torch.testing.assert_close(
            grads[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_gpt_without_labels_returns_the_logits():
    tokens = _micro_batches()[0][0]
    outputs = []
    for chunks in (0, CHUNKS):
        model = GPTModel(ModelConfig(**MODEL, output_layer_loss_chunks=chunks), ProcessGroups.single(), VOCAB)
        with torch.no_grad():
            outputs.append(model(tokens))
    assert outputs[0].shape == (MBS, SEQ, VOCAB)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)


def _kept_bytes(groups, chunks, fused, sp=False, dtype=torch.float32):
    config = ModelConfig(
        **MODEL,
        untie_embeddings_and_output_weights=True,
        output_layer_loss_chunks=chunks,
        cross_entropy_loss_fusion=fused,
    )
    model = GPTModel(config, groups, VOCAB, sequence_parallel=sp, params_dtype=dtype)
    tokens, labels = _micro_batches()[0]
    with SavedActivations(exclude=model.parameters()) as saved:
        loss = model(tokens, labels=labels)
    kept, tensors = saved.nbytes(), saved.tensors()
    saved.clear()
    loss.sum().backward()
    return kept, tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_no_logits_kept_for_backward(dtype):
    """The fused loss keeps the logits and 13 bytes a token; the chunked path the same less the logits."""
    single = ProcessGroups.single()
    fused, _ = _kept_bytes(single, 0, True, dtype=dtype)
    chunked, tensors = _kept_bytes(single, CHUNKS, False, dtype=dtype)
    logits_bytes = SEQ * MBS * VOCAB * dtype.itemsize
    assert fused - chunked == logits_bytes
    assert not any(shape and shape[-1] == VOCAB for shape, _, _ in tensors), tensors


# -- tensor parallel (2 processes) -------------------------------------------------------------------


def _tensor_parallel_runs():
    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=2))
    out = {}
    cases = ((False, True, True), (True, True, True), (True, False, True), (False, False, False))
    for sp, untie, wrap in cases:  # (sequence parallel, untied, DDP + fusion)
        losses, grads, flags = _run(groups, CHUNKS, untie=untie, smoothing=0.1, wrap=wrap, sp=sp)
        out[(sp, untie, wrap)] = (losses, grads, flags)
    # what the fused loss keeps minus what the chunked path keeps: this rank's logits [s, b, V/2]
    out["kept"] = _kept_bytes(groups, 0, True, sp=True)[0] - _kept_bytes(groups, CHUNKS, False, sp=True)[0]
    return out


def test_tp2_with_and_without_sequence_parallel_equals_tp1():
    results = run_distributed(_tensor_parallel_runs, 2, timeout=300)
    single = ProcessGroups.single()
    references = {untie: _run(single, 0, untie=untie, smoothing=0.1)[:2] for untie in (True, False)}
    for rank, per_rank in enumerate(results):
        assert per_rank.pop("kept") == SEQ * MBS * (VOCAB // 2) * 4, rank
        for (sp, untie, wrap), (losses, grads, flags) in per_rank.items():
            _assert_close((losses, grads), references[untie], rtol=1e-5, atol=1e-6)
            if wrap and untie:
                assert flags["output_layer.weight"] is True, (rank, sp)


# -- flag --------------------------------------------------------------------------------------------


def test_cli_flag_and_validation(capsys):
    groups = {"model": ModelConfig}
    base = "--num-layers 2 --hidden-size 16 --num-attention-heads 4 --seq-length 8".split()
    assert parse_config(groups, base)["model"].output_layer_loss_chunks == 0
    parsed = parse_config(groups, [*base, "--output-layer-loss-chunks", "4"])["model"]
    assert parsed.output_layer_loss_chunks == 4
    assert "--output-layer-loss-chunks" in build_parser(groups).format_help()
    with pytest.raises(SystemExit):
        parse_config(groups, [*base, "--output-layer-loss-chunks", "-1"])
    assert "--output-layer-loss-chunks" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--output-layer-loss-chunks"):
        ModelConfig(**MODEL, output_layer_loss_chunks=-2)
