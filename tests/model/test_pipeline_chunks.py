"""Pipeline-stage chunks of a GPTModel, run in one process: the same weights, loss and gradients.

A 4-layer model is cut into three chunks (first: embedding + layer 0; middle: layers 1-2; last:
layer 3 + final norm + output layer) wired by ``set_input_tensor`` as a pipeline schedule does.
"""

import pytest
import torch

from mcore.distributed.groups import ProcessGroups
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.model_config import ModelConfig

SEQ, BATCH, VOCAB = 8, 2, 64
CONFIGS = {
    "gpt2-tied": dict(num_attention_heads=4),
    "llama-untied": dict(
        num_attention_heads=4,
        group_query_attention=True,
        num_query_groups=2,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=True,
    ),
}
CHUNKS = [(0, 1), (1, 2), (3, 1)]  # (layer_offset, num_layers)


def _config(name):
    return ModelConfig(
        num_layers=4,
        hidden_size=32,
        seq_length=SEQ,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **CONFIGS[name],
    )


def _chunks(cfg, device):
    last = len(CHUNKS) - 1
    return [
        GPTModel(
            cfg,
            ProcessGroups.single(),
            VOCAB,
            pre_process=i == 0,
            post_process=i == last,
            layer_offset=offset,
            num_layers=n,
            device=device,
            seed=7,
        )
        for i, (offset, n) in enumerate(CHUNKS)
    ]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunks_hold_the_full_models_weights(name, device):
    cfg = _config(name)
    full = GPTModel(cfg, ProcessGroups.single(), VOCAB, device=device, seed=7)
    full_weights = {s.name: p for s, p in zip(full.sharded_parameters().values(), full.parameters())}
    seen = set()
    for chunk in _chunks(cfg, device):
        params = dict(chunk.named_parameters())
        for local, spec in chunk.sharded_parameters().items():
            assert torch.equal(params[local], full_weights[spec.name]), (local, spec.name)
            if not spec.tied_copy:
                seen.add(spec.name)
    assert seen == set(full_weights)  # every logical tensor lives on exactly one chunk (plus the tied copy)


def test_layer_names_are_local_in_the_module_and_global_in_the_specs(device):
    middle = _chunks(_config("gpt2-tied"), device)[1]
    specs = middle.sharded_parameters()
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in specs
    assert specs["decoder.layers.1.mlp.linear_fc2.weight"].name == "decoder.layers.2.mlp.linear_fc2.weight"
    assert specs["decoder.layers.1.mlp.linear_fc2.weight"].layer_number == 2
    assert middle.shared_embedding_or_output_weight() is None


def test_tied_output_copy_on_the_last_stage(device):
    first, _, last = _chunks(_config("gpt2-tied"), device)
    spec = last.sharded_parameters()["output_layer.weight"]
    assert spec.name == "embedding.word_embeddings.weight" and spec.tied_copy and not spec.is_main_replica
    assert last.shared_embedding_or_output_weight() is last.output_layer.weight
    assert first.shared_embedding_or_output_weight() is first.embedding.word_embeddings.weight
    assert torch.equal(last.output_layer.weight, first.embedding.word_embeddings.weight)
    assert (
        last.output_layer.weight.shared_embedding and first.embedding.word_embeddings.weight.shared_embedding
    )
    # untied: the last stage's output layer is its own logical tensor
    untied = _chunks(_config("llama-untied"), device)[-1]
    assert untied.sharded_parameters()["output_layer.weight"].name == "output_layer.weight"
    assert untied.shared_embedding_or_output_weight() is None


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_forward_backward_equals_the_full_model(name, device):
    cfg = _config(name)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (BATCH, SEQ), generator=gen).to(device)
    labels = torch.randint(0, 50, (BATCH, SEQ), generator=gen).to(device)

    full = GPTModel(cfg, ProcessGroups.single(), VOCAB, device=device, seed=7)
    full_loss = full(tokens, labels=labels)
    full_loss.mean().backward()
    full_grads = {s.name: p.grad for s, p in zip(full.sharded_parameters().values(), full.parameters())}

    chunks = _chunks(cfg, device)
    outputs, inputs = [], []
    for i, chunk in enumerate(chunks):
        if i > 0:
            received = outputs[-1].detach().requires_grad_(True)  # what p2p would deliver
            inputs.append(received)
            chunk.set_input_tensor([received])
        outputs.append(chunk(tokens if i == 0 else None, labels=labels if i == len(chunks) - 1 else None))
    loss = outputs[-1]
    torch.testing.assert_close(loss, full_loss, rtol=1e-5, atol=1e-6)
    assert outputs[0].shape == (SEQ, BATCH, cfg.hidden_size)  # hidden states go on in [s, b, h]

    loss.mean().backward()
    for i in range(len(chunks) - 2, -1, -1):
        outputs[i].backward(inputs[i].grad)

    tied_sum = {}
    for chunk in chunks:
        for local, spec in chunk.sharded_parameters().items():
            grad = dict(chunk.named_parameters())[local].grad
            tied_sum[spec.name] = tied_sum.get(spec.name, 0) + grad  # the embedding-group all-reduce
    for logical, grad in tied_sum.items():
        torch.testing.assert_close(grad, full_grads[logical], rtol=1e-5, atol=1e-7, msg=logical)


def test_non_first_chunk_needs_an_input(device):
    middle = _chunks(_config("gpt2-tied"), device)[1]
    with pytest.raises(RuntimeError, match="set_input_tensor"):
        middle(None)
