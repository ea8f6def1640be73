"""T5Model on one process: megatron-core's parameter names, pipeline chunks, recompute with dropout, flags."""

from __future__ import annotations

import pytest
import torch

from mcore.config.fields import ConfigError
from mcore.distributed.groups import ProcessGroups
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.t5.t5_model import T5Model, relative_position_bucket
from mcore.models.transformer.model_config import ModelConfig
from mcore.tensor_parallel.random import model_parallel_seed

VOCAB = 128
BASE = dict(
    encoder_num_layers=2,
    decoder_num_layers=3,
    hidden_size=32,
    num_attention_heads=4,
    encoder_seq_length=8,
    decoder_seq_length=6,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
HF_V1_1 = dict(
    position_embedding_type="relative",
    normalization="RMSNorm",
    disable_bias_linear=True,
    geglu=True,
    openai_gelu=True,
    untie_embeddings_and_output_weights=True,
)


def _batch(b=2):
    gen = torch.Generator().manual_seed(3)
    enc = torch.randint(0, VOCAB, (b, 8), generator=gen)
    dec = torch.randint(0, VOCAB, (b, 6), generator=gen)
    labels = torch.randint(0, VOCAB, (b, 6), generator=gen)
    device = ProcessGroups.single().device  # the models' device (cuda under MCORE_TEST_BACKEND=cuda)
    return enc.to(device), dec.to(device), labels.to(device)


def test_megatron_core_parameter_names():
    names = set(dict(T5Model(ModelConfig(**BASE), ProcessGroups.single(), VOCAB).named_parameters()))
    layer = "decoder.layers.2."
    expected = {
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "encoder.layers.1.self_attention.linear_qkv.weight",
        "encoder.layers.1.mlp.linear_fc1.bias",
        "encoder.final_layernorm.weight",
        layer + "input_layernorm.weight",
        layer + "self_attention.linear_proj.bias",
        layer + "pre_cross_attn_layernorm.weight",
        layer + "cross_attention.linear_q.weight",
        layer + "cross_attention.linear_kv.weight",
        layer + "cross_attention.linear_proj.weight",
        layer + "pre_mlp_layernorm.bias",
        layer + "mlp.linear_fc2.weight",
        "decoder.final_layernorm.bias",
        "lm_head.output_layer.bias",  # tied: the output layer has only megatron-core's bias
    }
    assert expected <= names, expected - names
    assert not any(n.startswith("encoder.layers.2") or "relative" in n for n in names)
    relative = set(
        dict(T5Model(ModelConfig(**BASE, **HF_V1_1), ProcessGroups.single(), VOCAB).named_parameters())
    )
    assert {
        "encoder_relative_pos_emb.relative_attention_bias.weight",
        "decoder_relative_pos_emb.relative_attention_bias.weight",
        "lm_head.output_layer.weight",
    } <= relative
    assert (
        not any(n.endswith(".bias") for n in relative)
        and "embedding.position_embeddings.weight" not in relative
    )


@pytest.mark.parametrize("variant", ["megatron", "hf_v1_1"])
def test_pipeline_chunks_give_the_whole_model_loss(variant):
    """Encoder chunk -> decoder chunk 1 (embeds the decoder tokens) -> decoder chunk 2 (output layer)."""
    cfg = ModelConfig(**BASE, **(HF_V1_1 if variant == "hf_v1_1" else {}))
    single = ProcessGroups.single()
    enc, dec, labels = _batch()
    whole = T5Model(cfg, single, VOCAB)
    expected = whole(enc, dec, lm_labels=labels)

    encoder = T5Model(cfg, single, VOCAB, add_decoder=False, post_process=False)
    first = T5Model(cfg, single, VOCAB, add_encoder=False, post_process=False, decoder_num_layers=2)
    last = T5Model(cfg, single, VOCAB, add_encoder=False, pre_process=False, decoder_layer_offset=2)
    enc_out = encoder(enc, None)
    first.set_input_tensor([enc_out])
    dec_hidden = first(None, dec)
    last.set_input_tensor([dec_hidden, enc_out])
    loss = last(None, None, lm_labels=labels)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    # logical names and values line up with the whole model's (the tied copy maps to the embedding)
    whole_params = {s.name: p for s, p in zip(whole.sharded_parameters().values(), whole.parameters())}
    for chunk in (encoder, first, last):
        params = dict(chunk.named_parameters())
        for local, spec in chunk.sharded_parameters().items():
            assert torch.equal(params[local], whole_params[spec.name]), spec.name
    assert (last.shared_embedding_or_output_weight() is None) == (variant == "hf_v1_1")


def test_recompute_replays_dropout():
    enc, dec, labels = _batch()
    results = []
    for extra in (
        {},
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
        dict(recompute_granularity="selective", recompute_modules=("core_attn", "layernorm", "mlp")),
    ):
        cfg = ModelConfig(**{**BASE, "hidden_dropout": 0.2, "attention_dropout": 0.2}, **extra)
        model = T5Model(cfg, ProcessGroups.single(), VOCAB)
        model_parallel_seed(1234, 0, 0)
        loss = model(enc, dec, lm_labels=labels)
        loss.mean().backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-6, atol=1e-6)
        for g, g0 in zip(grads, results[0][1]):
            torch.testing.assert_close(g, g0, rtol=1e-5, atol=1e-6)


def test_relative_position_buckets_follow_t5():
    """Values of T5's bucketing (32 buckets, max distance 128), as transformers computes them."""
    rel = torch.tensor([-200, -20, -3, 0, 3, 20, 200])
    assert relative_position_bucket(rel, True, 32, 128).tolist() == [15, 10, 3, 0, 19, 26, 31]
    assert relative_position_bucket(rel, False, 32, 128).tolist() == [31, 17, 3, 0, 0, 0, 0]


def test_flags_and_refusals():
    cfg = ModelConfig(
        encoder_num_layers=3,
        decoder_num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        encoder_seq_length=16,
        decoder_seq_length=24,
    )
    assert (cfg.num_layers, cfg.seq_length, cfg.max_position_embeddings) == (3, 16, 24)
    with pytest.raises(ConfigError, match="decoder_seq_length=24 exceeds max_position_embeddings=16"):
        ModelConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            seq_length=16,
            max_position_embeddings=16,
            decoder_seq_length=24,
        )
    with pytest.raises(ConfigError, match="relative"):
        GPTModel(
            ModelConfig(
                num_layers=1,
                hidden_size=32,
                num_attention_heads=4,
                seq_length=8,
                position_embedding_type="relative",
            ),
            ProcessGroups.single(),
            VOCAB,
        )
    with pytest.raises(ConfigError, match="num_query_groups"):
        T5Model(
            ModelConfig(**BASE, group_query_attention=True, num_query_groups=2), ProcessGroups.single(), VOCAB
        )


def test_t5_flops_count_every_matrix_product_forward_and_backward():
    """The formula equals torch's FLOP counter over one forward and backward of a T5 (both variants:
    the v1.1 one has the gated MLP and no 1/sqrt(d) scale; relative bias and norms are not matmuls)."""
    from torch.utils.flop_counter import FlopCounterMode

    from mcore.training.flops import t5_flops_per_sample

    for variant in ({}, HF_V1_1):
        cfg = ModelConfig(**{**BASE, "ffn_hidden_size": 48, "kv_channels": 6}, **variant)
        model = T5Model(cfg, ProcessGroups.single(), VOCAB)
        enc, dec, labels = _batch(b=1)
        with FlopCounterMode(display=False) as counter:
            model(enc, dec, lm_labels=labels).sum().backward()
        assert counter.get_total_flops() == t5_flops_per_sample(cfg, VOCAB)
