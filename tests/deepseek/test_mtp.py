"""Multi-token prediction against a hand-written reference on a tiny model (one process, milliseconds):
the loss and every gradient of ``main + factor/D * sum_k L_k``, Megatron's names, the logged
per-depth losses, eval/generation without MTP, and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore.config.fields import ConfigError
from mcore.distributed.groups import ProcessGroups
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.model_config import ModelConfig
from mcore.models.transformer.mtp.config import refuse_mla_mtp

V, B, S, D, FACTOR = 64, 2, 8, 2, 0.3
CFG = dict(
    num_layers=1,
    hidden_size=16,
    num_attention_heads=2,
    seq_length=S,
    ffn_hidden_size=24,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    untie_embeddings_and_output_weights=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    mtp_num_layers=D,
    mtp_loss_scaling_factor=FACTOR,
)


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _shift(x, k):
    return torch.cat((x[:, k:], torch.zeros_like(x[:, :k])), dim=1)


def _reference_loss(model, tokens, labels, mask):
    """DeepSeek-V3's MTP written out: h^k = norm(layer(W_eh [norm(emb(t^k)); norm(h^{k-1})]))."""
    freqs = model.rotary_pos_emb(S)
    h = model.decoder(model.embedding(tokens), None, freqs)  # the final norm applied
    w_out = model.output_layer.weight

    def ce(hidden, lab, m):
        per = F.cross_entropy(
            (hidden @ w_out.T).reshape(-1, w_out.shape[0]), lab.t().reshape(-1), reduction="none"
        )
        return (per.view(S, B).t() * m).sum() / m.sum()

    main = ce(h, labels, mask)
    total = main
    for k, layer in enumerate(model.mtp.layers, start=1):
        emb = model.embedding(_shift(tokens, k))
        x = (
            torch.cat((_rms(emb, layer.enorm.weight), _rms(h, layer.hnorm.weight)), -1)
            @ layer.eh_proj.weight.T
        )
        h = _rms(layer.mtp_model_layer(x, None, freqs), layer.final_layernorm.weight)
        total = total + FACTOR / D * ce(h, _shift(labels, k), _shift(mask, k))
    return main, total


def test_mtp_equals_the_reference_and_logs_each_depth():
    gen = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, V, (B, S), generator=gen), torch.randint(0, V, (B, S), generator=gen)
    mask = (torch.rand(B, S, generator=gen) > 0.2).float()
    model = GPTModel(ModelConfig(**CFG), ProcessGroups.single(), V, seed=5).train()
    names = set(model.sharded_parameters())
    for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"):
        assert f"mtp.layers.1.{part}" in names
    assert "mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.weight" in names
    per_token = model(tokens, labels=labels, loss_mask=mask)
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    logged = model.mtp.step_losses.clone()
    model.zero_grad()
    main, total = _reference_loss(model, tokens, labels, mask)
    total.backward()
    torch.testing.assert_close(loss, main)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, msg=name)
    assert model.mtp.layers[1].eh_proj.weight.grad.abs().sum() > 0  # depth 2 trains
    # logged: each depth's L_k (unscaled), recomputed from the reference's pieces
    assert logged.shape == (D,) and torch.all(logged > 0)
    torch.testing.assert_close((total - main).detach(), FACTOR / D * logged.sum())
    # evaluation and generation run no MTP: the loss is the main loss and nothing is logged
    model.eval().mtp.step_losses = None
    torch.testing.assert_close(model(tokens, labels=labels), per_token.detach())
    assert model.mtp.step_losses is None


def test_mtp_bad_input_names_the_flags():
    with pytest.raises(ConfigError, match="mtp_num_layers=1 .* does not take learned_absolute"):
        ModelConfig(**{**CFG, "mtp_num_layers": 1, "position_embedding_type": "learned_absolute"})
    with pytest.raises(
        ConfigError, match="BERT does not support --mtp-num-layers 2 .*shared embedding and output layer"
    ):
        refuse_mla_mtp(ModelConfig(**CFG), "BERT")


def test_the_megatron_export_refuses_what_megatron_cannot_hold_by_name():
    """MTP goes to megatron-core's ``torch`` format with its names only (the checkpoint round trip
    against megatron-core itself: tests/checkpoint/test_megatron_moe.py)."""
    from mcore.checkpoint.format import CheckpointError
    from mcore.checkpoint.megatron.write import _check_model_for_format, check_exportable

    check_exportable(ModelConfig(**CFG), 1, 1)  # MTP at TP=1: written
    for fmt, names in (("torch_dist", "mcore"), ("torch", "legacy")):
        with pytest.raises(CheckpointError, match="mtp_num_layers=2: multi-latent attention and multi-token"):
            _check_model_for_format(ModelConfig(**CFG), fmt, names)
