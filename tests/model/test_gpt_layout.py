"""The parameter layouts the checkpoint and Hugging Face work rely on, checked against plain math.

``linear_qkv`` is Megatron's per-group packed ``[ng, r+2, d, h]`` (see :mod:`mcore.hf.tensors`), RoPE is
"rotate half" on the first ``rotary_dim`` channels, ``linear_fc1`` of SwiGLU is ``[gate; up]``.
A model built at TP=1 is run beside a hand-written forward that splits the weights the way an
exporter would (Q/K/V per that table, GQA head ``j`` serving query heads ``j*r .. j*r+r-1``).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from mcore.distributed.groups import ProcessGroups
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.model_config import ModelConfig
from mcore.tensor_parallel.random import model_parallel_seed

S, B, H = 8, 2, 32


def _model(device, **kwargs):
    cfg = ModelConfig(
        num_layers=1, hidden_size=H, seq_length=S, hidden_dropout=0.0, attention_dropout=0.0, **kwargs
    )
    return GPTModel(cfg, ProcessGroups.single(), 64, device=device, seed=3), cfg


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _manual_attention(attn, cfg, x, rope: bool):
    n, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    r = n // g
    w = attn.linear_qkv.weight.view(g, r + 2, d, H)
    b = None if attn.linear_qkv.bias is None else attn.linear_qkv.bias.view(g, r + 2, d)
    wq, wk, wv = w[:, :r].reshape(n * d, H), w[:, r].reshape(g * d, H), w[:, r + 1].reshape(g * d, H)
    bq = bk = bv = None
    if b is not None:
        bq, bk, bv = b[:, :r].reshape(-1), b[:, r].reshape(-1), b[:, r + 1].reshape(-1)
    q = F.linear(x, wq, bq).view(S, B, n, d).permute(1, 2, 0, 3)  # [b, n, s, d]
    k = F.linear(x, wk, bk).view(S, B, g, d).permute(1, 2, 0, 3)
    v = F.linear(x, wv, bv).view(S, B, g, d).permute(1, 2, 0, 3)
    if rope:
        rot = cfg.rotary_dim
        inv_freq = 1.0 / cfg.rotary_base ** (
            torch.arange(0, rot, 2, dtype=torch.float32, device=x.device) / rot
        )
        angles = torch.outer(torch.arange(S, dtype=torch.float32, device=x.device), inv_freq)
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

        def apply(t):
            t_rot, t_pass = t[..., :rot], t[..., rot:]
            return torch.cat([t_rot * cos + _rotate_half(t_rot) * sin, t_pass], dim=-1)

        q, k = apply(q), apply(k)
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    context = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(S, B, n * d)
    return F.linear(context, attn.linear_proj.weight)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_attention_heads=4),  # GPT-2: per-head [q, k, v], with biases
        dict(
            num_attention_heads=4,
            group_query_attention=True,
            num_query_groups=2,
            position_embedding_type="rope",
            disable_bias_linear=True,
        ),
        dict(
            num_attention_heads=4,
            group_query_attention=True,
            num_query_groups=1,
            position_embedding_type="rope",
            rotary_percent=0.5,
            add_qkv_bias=True,
            disable_bias_linear=True,
        ),  # MQA, partial rotary
    ],
)
def test_packed_qkv_layout_and_rope(kwargs, device):
    model, cfg = _model(device, **kwargs)
    attn = model.decoder.layers[0].self_attention
    with torch.no_grad():
        for p in attn.parameters():  # biases are zero after init; make them matter
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(device) * 0.1)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(0)).to(device)
    rotary = model.rotary_pos_emb(S, device=device) if cfg.position_embedding_type == "rope" else None
    out, proj_bias = attn(x, None, rotary)
    torch.testing.assert_close(out, _manual_attention(attn, cfg, x, rotary is not None), rtol=1e-5, atol=1e-5)
    assert (proj_bias is None) == cfg.disable_bias_linear


def test_swiglu_fc1_is_gate_then_up(device):
    model, cfg = _model(
        device, num_attention_heads=4, swiglu=True, ffn_hidden_size=48, disable_bias_linear=True
    )
    mlp = model.decoder.layers[0].mlp
    assert mlp.linear_fc1.weight.shape == (96, H)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1)).to(device)
    gate, up = mlp.linear_fc1.weight[:48], mlp.linear_fc1.weight[48:]
    expected = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), mlp.linear_fc2.weight)
    out, bias = mlp(x)
    assert bias is None
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_gelu_variants(device):
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2)).to(device)
    for openai_gelu, approximate in ((False, "none"), (True, "tanh")):
        model, _ = _model(device, num_attention_heads=4, openai_gelu=openai_gelu)
        mlp = model.decoder.layers[0].mlp
        fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
        expected = F.linear(F.gelu(F.linear(x, fc1.weight, fc1.bias), approximate=approximate), fc2.weight)
        out, bias = mlp(x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        assert bias is fc2.bias


def test_logits_and_loss_shapes(device):
    model, _ = _model(device, num_attention_heads=4)
    tokens = torch.randint(0, 60, (B, S), generator=torch.Generator().manual_seed(3)).to(device)
    model.eval()
    logits = model(tokens)
    assert logits.shape == (B, S, 64)
    loss = model(tokens, labels=tokens)
    assert loss.shape == (B, S) and loss.dtype == torch.float32
    expected = F.cross_entropy(logits.reshape(-1, 64).float(), tokens.reshape(-1), reduction="none").view(
        B, S
    )
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_scaled_init_of_output_projections(device):
    cfg_kwargs = dict(num_attention_heads=4, init_method_std=0.05)
    cfg = ModelConfig(num_layers=8, hidden_size=64, seq_length=S, **cfg_kwargs)
    model = GPTModel(cfg, ProcessGroups.single(), 64, device=device, seed=3)
    layer = model.decoder.layers[0]
    scaled = 0.05 / math.sqrt(2 * 8)
    assert abs(layer.self_attention.linear_qkv.weight.std().item() - 0.05) < 0.005
    assert abs(layer.self_attention.linear_proj.weight.std().item() - scaled) < 0.1 * scaled
    assert abs(layer.mlp.linear_fc2.weight.std().item() - scaled) < 0.1 * scaled
    assert torch.all(layer.input_layernorm.weight == 1) and torch.all(layer.mlp.linear_fc1.bias == 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(fp32_residual_connection=True),
        dict(apply_residual_connection_post_layernorm=True),
        dict(normalization="RMSNorm", position_embedding_type="none"),
    ],
)
def test_residual_and_position_options_train(kwargs, device):
    cfg = ModelConfig(num_layers=2, hidden_size=H, seq_length=S, num_attention_heads=4, **kwargs)
    model = GPTModel(cfg, ProcessGroups.single(), 64, params_dtype=torch.bfloat16, device=device, seed=3)
    tokens = torch.randint(0, 60, (B, S), generator=torch.Generator().manual_seed(4)).to(device)
    model_parallel_seed(5)  # dropout is on (Megatron's default 0.1): the TP stream must exist
    hidden = model.embedding(tokens)
    assert hidden.dtype == (torch.float32 if cfg.fp32_residual_connection else torch.bfloat16)
    loss = model(tokens, labels=tokens)
    loss.mean().backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())
