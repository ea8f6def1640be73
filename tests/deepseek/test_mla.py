"""Multi-latent attention against a hand-written fp64 reference (DeepSeek's formulas as Hugging Face's
DeepseekV3Attention writes them: pair-interleaved RoPE, YaRN angles with the attention factor, the
mscale_all_dim softmax correction), plus the flags' checks. One process, milliseconds."""

from __future__ import annotations

import math

import pytest
import torch

from mcore.config.fields import ConfigError
from mcore.distributed.groups import ProcessGroups
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.mla.attention import MLASelfAttention, rotary_embedding_for
from mcore.models.transformer.model_config import ModelConfig, check_tensor_parallel

N, H, DN, DR, DV, CKV = 4, 32, 8, 4, 6, 12
MLA = dict(
    num_layers=1,
    hidden_size=H,
    num_attention_heads=N,
    seq_length=8,
    position_embedding_type="rope",
    normalization="RMSNorm",
    disable_bias_linear=True,
    swiglu=True,
    multi_latent_attention=True,
    qk_layernorm=True,  # the latent norms (megatron-core's MLA: IdentityOp without it)
    kv_lora_rank=CKV,
    qk_head_dim=DN,
    qk_pos_emb_head_dim=DR,
    v_head_dim=DV,
    rope_type="yarn",
    rotary_scaling_factor=4.0,
    original_max_position_embeddings=4,
    mscale=1.0,
    mscale_all_dim=0.8,
    rotary_base=100.0,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


def _rms(x, w, eps=1e-5):
    if w is None:  # no --qk-layernorm: no latent norm
        return x
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _yarn_cos_sin(s, dim, base, factor, orig, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8):
    """Hugging Face ``_compute_yarn_parameters`` and the DeepSeek attention factor, in fp64."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def correction(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(correction(beta_fast)), 0), min(math.ceil(correction(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = inter * ramp + extra * (1 - ramp)
    freqs = torch.outer(torch.arange(s, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), -1)

    def m(a):
        return 0.1 * a * math.log(factor) + 1.0 if factor > 1 else 1.0

    factor_attn = m(mscale) / m(mscale_all_dim)
    return emb.cos() * factor_attn, emb.sin() * factor_attn, m(mscale_all_dim) ** 2


def _rope_interleaved(x, cos, sin):
    b, h, s, d = x.shape
    x = x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def reference_mla(x, w, cfg):
    """HF DeepseekV3Attention on ``x [b, s, h]``; ``w``: mcore's parameters by name (fp64)."""
    b, s, _ = x.shape
    if cfg.q_lora_rank is None:
        q = x @ w["linear_q_proj.weight"].T
    else:
        q = (
            _rms(x @ w["linear_q_down_proj.weight"].T, w["q_layernorm.weight"])
            @ w["linear_q_up_proj.weight"].T
        )
    q = q.view(b, s, N, DN + DR).transpose(1, 2)
    q_nope, q_pe = q.split([DN, DR], -1)
    ckv = x @ w["linear_kv_down_proj.weight"].T
    c, k_pe = ckv.split([CKV, DR], -1)
    kv = (
        (_rms(c, w["kv_layernorm.weight"]) @ w["linear_kv_up_proj.weight"].T)
        .view(b, s, N, DN + DV)
        .transpose(1, 2)
    )
    k_nope, v = kv.split([DN, DV], -1)
    cos, sin, m2 = _yarn_cos_sin(
        s, DR, cfg.rotary_base, cfg.rotary_scaling_factor, cfg.original_max_position_embeddings
    )
    q_pe = _rope_interleaved(q_pe, cos, sin)
    k_pe = _rope_interleaved(k_pe.view(b, 1, s, DR), cos, sin).expand(b, N, s, DR)
    qq, kk = torch.cat((q_nope, q_pe), -1), torch.cat((k_nope, k_pe), -1)
    scores = qq @ kk.transpose(-1, -2) * (m2 / math.sqrt(DN + DR))
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, N * DV)
    return out @ w["linear_proj.weight"].T


@pytest.mark.parametrize("q_lora_rank, qk_layernorm", [(16, True), (None, True), (16, False)])
def test_mla_equals_the_fp64_reference(q_lora_rank, qk_layernorm):
    cfg = ModelConfig(**{**MLA, "qk_layernorm": qk_layernorm}, q_lora_rank=q_lora_rank)
    layer = MLASelfAttention(cfg, BuildContext(params_dtype=torch.float64), layer_number=1).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(
                1.0 + 0.1 * torch.randn(p.shape, generator=gen)
                if "layernorm" in name
                else torch.randn(p.shape, generator=gen) * 0.3
            )
    b, s = 2, 8
    x = torch.randn(s, b, H, generator=gen, dtype=torch.float64)
    freqs = rotary_embedding_for(cfg)(s).double()
    out, bias = layer(x, None, freqs)
    assert bias is None
    weights = dict(layer.named_parameters())
    assert ("kv_layernorm.weight" in weights) == qk_layernorm
    weights.setdefault("q_layernorm.weight", None)
    weights.setdefault("kv_layernorm.weight", None)
    expected = reference_mla(x.transpose(0, 1), weights, cfg).transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)  # angles are fp32 (as in every RoPE)
    # the latent cache: one token after s - 1 cached gives the last row
    cache = _Cache()
    layer(x[: s - 1], None, freqs[: s - 1], inference_context=cache)
    step, _ = layer(x[s - 1 :], None, freqs[s - 1 :], inference_context=cache)
    torch.testing.assert_close(
        step, expected[s - 1 :], rtol=1e-6, atol=1e-6
    )  # angles are fp32 (as in every RoPE)
    assert cache.kv[1][0].shape == (s, b, CKV) and cache.kv[1][1].shape == (s, b, 1, DR)  # latent, not K/V


class _Cache:
    def __init__(self):
        self.kv = {}

    def update_kv(self, layer, key, value):
        if layer in self.kv:
            key, value = (torch.cat((a, b)) for a, b in zip(self.kv[layer], (key, value)))
        self.kv[layer] = (key, value)
        return key, value


def test_mla_model_names_and_training_step():
    cfg = ModelConfig(
        **MLA, q_lora_rank=16, recompute_granularity="selective", recompute_modules=("mla_up_proj",)
    )
    model = GPTModel(cfg, ProcessGroups.single(), 64, seed=1)
    names = set(model.sharded_parameters())
    prefix = "decoder.layers.0.self_attention."
    for part in (
        "linear_q_down_proj",
        "linear_q_up_proj",
        "linear_kv_down_proj",
        "linear_kv_up_proj",
        "linear_proj",
    ):
        assert prefix + part + ".weight" in names
    assert {prefix + "q_layernorm.weight", prefix + "kv_layernorm.weight"} <= names
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = model(tokens, labels=tokens)
    loss.mean().backward()
    ref = GPTModel(ModelConfig(**MLA, q_lora_rank=16), ProcessGroups.single(), 64, seed=1)
    ref_loss = ref(tokens, labels=tokens)
    ref_loss.mean().backward()
    torch.testing.assert_close(loss, ref_loss)  # mla_up_proj recompute: same loss and gradients
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize(
    "changes,message",
    [
        (
            dict(num_attention_heads=3),
            "multi_latent_attention: num_attention_heads=3 is not divisible by tensor_model_parallel_size=2",
        ),
        (
            dict(position_embedding_type="learned_absolute"),
            "multi_latent_attention needs --position-embedding-type rope",
        ),
        (dict(qk_pos_emb_head_dim=3), "qk_pos_emb_head_dim=3 must be even"),
        (dict(rope_type="linear"), "rope_type"),
    ],
)
def test_bad_mla_input_names_the_flag(changes, message):
    with pytest.raises(ConfigError, match=message):
        check_tensor_parallel(ModelConfig(**{**MLA, **changes}), 2)


def test_mla_linears_run_in_fp8():
    from mcore.fp8.config import Fp8Config

    cfg = ModelConfig(**{**MLA, "num_layers": 1}, q_lora_rank=16)
    model = GPTModel(cfg, ProcessGroups.single(), 64, seed=1, fp8=Fp8Config(fp8_format="hybrid"))
    attention = model.decoder.layers[0].self_attention
    parts = (
        "linear_q_down_proj",
        "linear_q_up_proj",
        "linear_kv_down_proj",
        "linear_kv_up_proj",
        "linear_proj",
    )
    assert all(getattr(attention, p)._fp8_call is not None for p in parts)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = model(tokens, labels=tokens).mean()
    loss.backward()
    ref = GPTModel(cfg, ProcessGroups.single(), 64, seed=1)(tokens, labels=tokens).mean()
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) < 0.05 * ref.item()
    assert all(getattr(attention, p).weight.grad.abs().sum() > 0 for p in parts)


def test_mla_and_mtp_refuse_context_parallelism():
    from types import SimpleNamespace

    from mcore.models.transformer.model_config import validate_model_parallel

    # (ParallelConfig itself refuses CP until context parallelism lands; the model check stays)
    cp2 = SimpleNamespace(tensor_model_parallel_size=1, sequence_parallel=False, context_parallel_size=2)
    with pytest.raises(ConfigError, match="multi_latent_attention=True with context_parallel_size=2"):
        validate_model_parallel(ModelConfig(**MLA), cp2)


def test_flops_count_mla_active_experts_and_mtp():
    from mcore.training.flops import gpt_flops_per_sample, layerwise_flops_per_sample

    dense = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, swiglu=True, ffn_hidden_size=40
    )
    assert layerwise_flops_per_sample(dense, 64) == pytest.approx(gpt_flops_per_sample(dense, 64))
    cfg = ModelConfig(**{**MLA, "num_layers": 2}, q_lora_rank=16, num_experts=4, moe_router_topk=2,
                      moe_ffn_hidden_size=10, moe_shared_expert_intermediate_size=10, moe_layer_freq="[0,1]",
                      mtp_num_layers=1)  # fmt: skip
    attention = (
        H * 16
        + 16 * N * (DN + DR)
        + H * (CKV + DR)
        + CKV * N * (DN + DV)
        + N * DV * H
        + 8 * N * (DN + DR + DV)
    )
    dense_layer, moe_layer = (
        attention + 3 * H * 64,
        attention + 3 * H * (2 * 10 + 10),  # active experts + shared; router left out (Megatron)
    )  # ffn 64 (swiglu default)
    expected = 6 * 8 * (dense_layer + moe_layer + H * 64 + (moe_layer + 2 * H * H + H * 64))
    assert cfg.ffn_hidden_size == 64 and gpt_flops_per_sample(cfg, 64) == pytest.approx(expected)
