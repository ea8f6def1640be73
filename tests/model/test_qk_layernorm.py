"""``--qk-layernorm`` (per head) and ``--qk-layernorm-full-width`` (OLMoE) in one process: the norm is
applied between the QKV projection and RoPE, over the documented width, on the plain and the FP8
fused-norm-QKV paths; the refusals name the flags. (TP=2/4, SP and recomputation with the per-head
norms: tests/model/test_gpt_equivalence.py's "llama" case; FP8 at TP=2: tests/tensor_parallel/
test_fp8_parallel.py; parity with transformers' Qwen3: tests/hf/test_hf_families.py.)"""

from __future__ import annotations

import pytest
import torch

import mcore.models.transformer.attention as attention_module
from mcore.config.fields import ConfigError
from mcore.distributed.groups import ProcessGroups
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.model_config import ModelConfig, check_tensor_parallel

BASE = dict(
    num_layers=1, hidden_size=32, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
    seq_length=8, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
    disable_bias_linear=True, hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=True,
)  # fmt: skip


def _model(fp8=None, **settings) -> GPTModel:
    cfg = ModelConfig(**{**BASE, **settings})
    return GPTModel(cfg, ProcessGroups.single(), 64, device=torch.device("cpu"), fp8=fp8).eval()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("full_width", [False, True], ids=["per-head", "full-width"])
def test_the_norm_sits_between_the_projection_and_rope(full_width, monkeypatch):
    model = _model(qk_layernorm_full_width=full_width)
    attn = model.decoder.layers[0].self_attention
    n, g, d = 4, 2, 8
    widths = (n * d, g * d) if full_width else (d, d)
    assert tuple(attn.q_layernorm.weight.shape) == (widths[0],)
    assert tuple(attn.k_layernorm.weight.shape) == (widths[1],)
    with torch.no_grad():
        attn.q_layernorm.weight.uniform_(0.5, 1.5)
        attn.k_layernorm.weight.uniform_(0.5, 1.5)
    seen = {}
    monkeypatch.setattr(attn, "forward_from_split", _recording(attn.forward_from_split, seen))
    rotated = []
    real_get_ops = attention_module.get_ops

    class Recording:
        def __getattr__(self, name):
            op = getattr(real_get_ops(), name)
            if name != "rotary_embedding":
                return op
            return lambda x, freqs: rotated.append(x.detach().clone()) or op(x, freqs)

    monkeypatch.setattr(attention_module, "get_ops", lambda: Recording())
    model(torch.randint(0, 64, (2, 8)))
    q_in = seen["query"].reshape(8, 2, n, d)
    k_in = seen["key"]
    if full_width:
        q_ref = _rms(q_in.reshape(8, 2, n * d), attn.q_layernorm.weight).view(8, 2, n, d)
        k_ref = _rms(k_in.reshape(8, 2, g * d), attn.k_layernorm.weight).view(8, 2, g, d)
    else:
        q_ref, k_ref = _rms(q_in, attn.q_layernorm.weight), _rms(k_in, attn.k_layernorm.weight)
    torch.testing.assert_close(rotated[0], q_ref, rtol=1e-5, atol=1e-6)  # RoPE's input: the normed q
    torch.testing.assert_close(rotated[1], k_ref, rtol=1e-5, atol=1e-6)


def _recording(forward, seen):
    def wrapper(query, key, value, *args, **kwargs):
        seen["query"], seen["key"] = query.detach().clone(), key.detach().clone()
        return forward(query, key, value, *args, **kwargs)

    return wrapper


def test_the_fp8_fused_norm_and_qkv_path_applies_the_qk_norms():
    from mcore.fp8.config import Fp8Config

    model = _model(fp8=Fp8Config(fp8_format="hybrid", fp8_recipe="delayed"))
    layer = model.decoder.layers[0]
    assert layer.fp8_fused_qkv  # the norm writes QKV's FP8 input itself (mcore.fp8.producers)
    calls = []
    layer.self_attention.q_layernorm.register_forward_hook(lambda *_: calls.append("q"))
    layer.self_attention.k_layernorm.register_forward_hook(lambda *_: calls.append("k"))
    tokens = torch.randint(0, 64, (2, 8))
    before = model(tokens)
    assert calls == ["q", "k"]
    with torch.no_grad():
        layer.self_attention.k_layernorm.weight.mul_(3.0)  # sharper keys: other attention weights
    assert (model(tokens) - before).abs().max() > 1e-3


def test_refusals_name_the_flags():
    with pytest.raises(ConfigError, match="qk_layernorm_full_width=True .* needs qk_layernorm=True"):
        ModelConfig(**{**BASE, "qk_layernorm": False, "qk_layernorm_full_width": True})
    cfg = ModelConfig(**{**BASE, "qk_layernorm_full_width": True})
    with pytest.raises(ConfigError, match="qk_layernorm_full_width=True .* tensor_model_parallel_size=1"):
        check_tensor_parallel(cfg, 2)
    check_tensor_parallel(ModelConfig(**BASE), 2)  # per head: splits with the heads
