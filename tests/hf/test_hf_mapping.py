"""The GPT-2 / Llama mapping on random models in one process: layouts, parity of every variant,
round trips, refusals, and the Megatron flags printed on import."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from mcore.distributed.groups import ProcessGroups
from mcore.hf import ConversionError, ParityError, export_to_hf, import_from_hf, merge_qkv, split_qkv
from mcore.hf.families import model_config_from_hf
from mcore.hf.megatron_flags import megatron_model_flags
from mcore.inference.loading import build_model_chunk, gather_logical_state
from mcore.models.transformer.model_config import ModelConfig

V = 100  # real vocabulary (NullTokenizer with --vocab-size 99: ids 0..98 and EOD 99)
BASE = dict(num_layers=2, hidden_size=64, seq_length=32, max_position_embeddings=32)
LLAMA = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    ffn_hidden_size=96,
    norm_epsilon=1e-6,
    rotary_base=5000.0,
)
VARIANTS = {
    "gpt2": dict(num_attention_heads=4),
    "gpt2-tanh-untied-qkv-bias-only": dict(
        num_attention_heads=4,
        openai_gelu=True,
        untie_embeddings_and_output_weights=True,
        disable_bias_linear=True,
        add_qkv_bias=True,
    ),
    "llama-gqa-untied": dict(
        **LLAMA,
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=2,
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=True,
    ),
    "llama-mqa-tied-qkv-bias": dict(
        **LLAMA,
        num_attention_heads=4,
        group_query_attention=True,
        disable_bias_linear=True,
        add_qkv_bias=True,
    ),
    "llama-biases-head-dim-32": dict(**LLAMA, num_attention_heads=4, kv_channels=32),
}


def random_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """The logical state of a seeded model whose norms and biases are not 1 and 0."""
    single = ProcessGroups.single()
    model = build_model_chunk(cfg, single, V, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return gather_logical_state([model], single)


def run_config(cfg: ModelConfig) -> dict:
    return {
        "model": dataclasses.asdict(cfg),
        "tokenizer": {"tokenizer_type": "NullTokenizer", "vocab_size": V - 1},
    }


def test_qkv_split_follows_the_documented_row_formula():
    n, g, d, h = 8, 2, 4, 3
    r = n // g
    fused = torch.randn((n + 2 * g) * d, h)
    q, k, v = split_qkv(fused, n, g, d)
    for head in range(n):
        group, j = divmod(head, r)
        assert torch.equal(
            q[head * d : (head + 1) * d], fused[(group * (r + 2) + j) * d : (group * (r + 2) + j + 1) * d]
        )
    for group in range(g):
        assert torch.equal(
            k[group * d : (group + 1) * d], fused[(group * (r + 2) + r) * d : (group * (r + 2) + r + 1) * d]
        )
        assert torch.equal(
            v[group * d : (group + 1) * d],
            fused[(group * (r + 2) + r + 1) * d : (group * (r + 2) + r + 2) * d],
        )
    assert torch.equal(merge_qkv(q, k, v, n, g, d), fused)
    bias = torch.randn((n + 2 * g) * d)
    assert torch.equal(merge_qkv(*split_qkv(bias, n, g, d), n, g, d), bias)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_parity_and_import_roundtrip(variant, tmp_path):
    from mcore.checkpoint import load_logical_model_state

    cfg = ModelConfig(**BASE, **VARIANTS[variant])
    state = random_state(cfg)
    report = export_to_hf(state, run_config(cfg), str(tmp_path / "hf"))
    assert report.parity.ok and report.parity.max_abs_diff < 1e-4, report.parity.describe()
    assert set(report.parity.per_implementation) == {"eager", "sdpa"}
    print(f"{variant}: {report.parity.describe()}")
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["vocab_size"] == V and config["eos_token_id"] == V - 1

    back = import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert back.parity.max_abs_diff < 1e-4
    imported, meta = load_logical_model_state(tmp_path / "ckpt")
    assert meta["extra"]["tokenizer_vocab_size"] == V
    for name, tensor in state.items():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(imported[name][:V], tensor[:V]) and not imported[name][V:].any()
        else:
            assert torch.equal(imported[name], tensor), name
    extra = set(imported) - set(state)
    if variant.startswith("gpt2-"):  # GPT-2 always has biases: the missing ones come back as zeros
        assert extra and all(not imported[name].any() for name in extra)
    else:
        assert not extra
        # Llama has no hidden dropout setting: the import gives 0.
        assert dataclasses.replace(back.model_config, hidden_dropout=cfg.hidden_dropout) == cfg


def test_a_wrong_mapping_fails_the_parity_check_and_writes_nothing(tmp_path, monkeypatch):
    from mcore.hf.families import FAMILIES

    # Larger weights than at init, as after training, so that the two GeLUs differ visibly.
    cfg = ModelConfig(**BASE, **VARIANTS["gpt2"], init_method_std=0.2)
    real = FAMILIES["gpt2"].hf_config_dict

    def wrong_gelu(*args, **kwargs):  # the tanh GeLU for a model trained with the exact one
        return {**real(*args, **kwargs), "activation_function": "gelu_new"}

    monkeypatch.setitem(FAMILIES, "gpt2", dataclasses.replace(FAMILIES["gpt2"], hf_config_dict=wrong_gelu))
    with pytest.raises(ParityError, match="parity check FAILED") as failure:
        export_to_hf(random_state(cfg), run_config(cfg), str(tmp_path / "hf"))
    print(failure.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "settings, named",
    [
        (dict(num_attention_heads=4, position_embedding_type="alibi"), "position_embedding_type='alibi'"),
        (dict(num_attention_heads=4, position_embedding_type="none"), "position_embedding_type='none'"),
        (
            dict(num_attention_heads=4, position_embedding_type="rope", swiglu=True),
            "normalization='LayerNorm'",
        ),
        (
            dict(num_attention_heads=4, position_embedding_type="rope", normalization="RMSNorm"),
            "swiglu=False",
        ),
        ({**LLAMA, "num_attention_heads": 4, "rotary_percent": 0.5}, "rotary_percent=0.5"),
        (dict(num_attention_heads=4, normalization="RMSNorm"), "normalization='RMSNorm'"),
        (dict(num_attention_heads=4, swiglu=True), "swiglu=True"),
        (dict(num_attention_heads=4, group_query_attention=True, num_query_groups=2), "num_query_groups=2"),
        (dict(num_attention_heads=4, kv_channels=8), "kv_channels=8"),
        (dict(num_attention_heads=4, apply_residual_connection_post_layernorm=True), "post_layernorm"),
    ],
)
def test_export_refuses_what_the_target_cannot_represent(settings, named, tmp_path):
    cfg = ModelConfig(**BASE, **settings)
    with pytest.raises(ConversionError, match=named.replace("(", r"\(")):
        export_to_hf({}, run_config(cfg), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


GPT2_HF = dict(
    architectures=["GPT2LMHeadModel"],
    model_type="gpt2",
    n_embd=64,
    n_head=4,
    n_layer=2,
    n_positions=32,
    vocab_size=V,
)
LLAMA_HF = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=V,
)


@pytest.mark.parametrize(
    "config, named",
    [
        (dict(architectures=["BertModel"], model_type="bert"), "unsupported architecture"),
        (dict(model_type="falcon"), "unsupported architecture"),
        ({**LLAMA_HF, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        ({**LLAMA_HF, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
        (
            {**LLAMA_HF, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
        ({**LLAMA_HF, "hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({**LLAMA_HF, "mlp_bias": True}, "mlp_bias=True"),
        ({**LLAMA_HF, "num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({**GPT2_HF, "activation_function": "relu"}, "activation_function='relu'"),
        ({**GPT2_HF, "scale_attn_weights": False}, "scale_attn_weights=False"),
        ({**GPT2_HF, "scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
        ({**GPT2_HF, "add_cross_attention": True}, "add_cross_attention=True"),
    ],
)
def test_import_refuses_what_mcore_cannot_express(config, named):
    with pytest.raises(ConversionError, match=named):
        model_config_from_hf(config)


def test_hf_config_fields_map_both_ways():
    old_style = {**LLAMA_HF, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
    cfg = model_config_from_hf(old_style)  # transformers 4.x keys
    assert (
        cfg.rotary_base == 500000.0 and cfg.norm_epsilon == 1e-5 and cfg.share_embeddings_and_output_weights
    )
    assert cfg.num_query_groups == 2 and cfg.group_query_attention and cfg.kv_channels == 16
    gpt2 = model_config_from_hf({**GPT2_HF, "activation_function": "gelu_pytorch_tanh", "n_inner": None})
    assert gpt2.openai_gelu and gpt2.ffn_hidden_size == 256 and gpt2.add_bias_linear


QWEN2_MOE_HF = {
    **LLAMA_HF,
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "num_hidden_layers": 3,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 40,
    "mlp_only_layers": [1],
}
OLMOE_HF = {**LLAMA_HF, "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "num_experts": 4}


@pytest.mark.parametrize(
    "hf",
    [GPT2_HF, {**LLAMA_HF, "attention_bias": True, "head_dim": 32}, QWEN2_MOE_HF, OLMOE_HF],
    ids=["gpt2", "llama", "qwen2-moe-dense-layer", "olmoe"],
)
def test_printed_megatron_flags_build_the_same_model(hf):
    from mcore.config.cli import parse_config

    cfg = model_config_from_hf(hf)
    parsed = parse_config({"model": ModelConfig}, megatron_model_flags(cfg))["model"]
    assert parsed == cfg


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.GPT2LMHeadModel(
            t.GPT2Config(vocab_size=V, n_positions=32, n_embd=64, n_layer=2, n_head=4)
        ),
        lambda t: t.LlamaForCausalLM(
            t.LlamaConfig(
                vocab_size=V,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=8,
                num_key_value_heads=2,
                max_position_embeddings=64,
                attention_bias=True,
                mlp_bias=True,
                tie_word_embeddings=True,
            )
        ),
    ],
    ids=["gpt2", "llama-biases-tied"],
)
def test_a_model_saved_by_transformers_imports_and_exports_back_identically(make, tmp_path):
    """HF -> mcore (padded for TP=2) -> HF, starting from transformers' own save_pretrained."""
    import transformers
    from safetensors.torch import load_file

    from mcore.checkpoint import load_logical_model_state
    from mcore.hf import export_checkpoint

    torch.manual_seed(0)
    model = make(transformers)
    with torch.no_grad():  # norms and biases away from their 1 / 0 initial values
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(tmp_path / "hf")
    report = import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), tensor_model_parallel_size=2)
    assert report.parity.max_abs_diff < 1e-4, report.parity.describe()
    state, _ = load_logical_model_state(tmp_path / "ckpt")
    assert state["embedding.word_embeddings.weight"].shape[0] == 256  # 100 padded to a multiple of 128 x 2
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "again"))
    before, after = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "again" / "model.safetensors"),
    )
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
