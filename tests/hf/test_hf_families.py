"""Qwen2, Qwen3 and Mistral in and out: tiny random models built with transformers on the CPU, saved
without tokenizer files, imported with ``--no-tokenizer`` (padded for TP=2; the import's parity check
loads them with ``AutoModelForCausalLM``, eager and sdpa, 1e-4 fp32) and exported back to the same
class with identical tensors (the export's parity check loads the export the same way), and
``pipeline("text-generation")`` loads the export and generates; an mcore
model with ``--qk-layernorm`` exports as Qwen3 by default; unsupported config fields are refused
naming the field, with nothing written."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mcore.hf import ConversionError, export_checkpoint, export_to_hf, import_from_hf
from mcore.hf.families import model_config_from_hf
from mcore.models.transformer.model_config import ModelConfig

V = 100
TINY = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    rope_theta=5000.0,
)
EXPERTS = dict(num_experts_per_tok=2, router_aux_loss_coef=0.01)
MODELS = {
    "Qwen2ForCausalLM": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(head_dim=16, attention_bias=True)),
    "MistralForCausalLM": ("MistralConfig", dict(sliding_window=None, head_dim=8)),
    "MixtralForCausalLM": ("MixtralConfig", dict(**EXPERTS, num_local_experts=4, sliding_window=None)),
    "Qwen2MoeForCausalLM": (
        "Qwen2MoeConfig",
        dict(
            **EXPERTS,
            num_experts=4,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            mlp_only_layers=[1],
        ),
    ),
    "Qwen3MoeForCausalLM": (
        "Qwen3MoeConfig",
        dict(**EXPERTS, num_experts=4, moe_intermediate_size=24, head_dim=16, norm_topk_prob=True),
    ),
    "OlmoeForCausalLM": ("OlmoeConfig", dict(**EXPERTS, num_experts=4, pad_token_id=None, eos_token_id=None)),
}
MOE = [a for a in MODELS if a[0] in "MQO" and ("Moe" in a or "Mixtral" in a or "Olmoe" in a)]


def _save_hf_model(architecture: str, path, **overrides) -> None:
    import transformers

    config_class, settings = MODELS[architecture]
    config = getattr(transformers, config_class)(**{**TINY, **settings, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():  # norms and biases away from their 1 / 0 initial values
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith("o_proj.bias"):  # mcore's --add-qkv-bias has no o_proj bias: zero
                param.zero_()
    model.save_pretrained(path)


@pytest.mark.parametrize("architecture", list(MODELS))
def test_import_then_export_gives_back_the_same_model(architecture, tmp_path):
    from safetensors.torch import load_file

    _save_hf_model(architecture, tmp_path / "hf")
    tp = 1 if architecture == "OlmoeForCausalLM" else 2  # (OLMoE's full-width q/k norms span all TP ranks)
    report = import_from_hf(
        str(tmp_path / "hf"), str(tmp_path / "ckpt"), tensor_model_parallel_size=tp, use_tokenizer=False
    )
    assert report.parity.max_abs_diff < 1e-4, report.parity.describe()
    assert set(report.parity.per_implementation) == {"eager", "sdpa"}
    cfg = report.model_config
    assert cfg.qk_layernorm == architecture.startswith(("Qwen3", "Olmoe"))
    assert cfg.add_qkv_bias == architecture.startswith(("Qwen2", "Qwen3ForCausalLM"))
    assert (cfg.num_experts is not None) == (architecture in MOE)
    back = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "again"))
    assert back.architecture == architecture and back.parity.max_abs_diff < 1e-4
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["architectures"] == [architecture] and config.get("sliding_window") is None
    before = load_file(tmp_path / "hf" / "model.safetensors")
    after = load_file(tmp_path / "again" / "model.safetensors")
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    _pipeline_generates(str(tmp_path / "again"), architecture)


def _pipeline_generates(export: str, architecture: str) -> None:
    """``pipeline("text-generation")`` loads the export (the tokenizer: token ``i`` is the word ``"i"``,
    the export has no tokenizer files) and continues a prompt with its model's greedy tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, pipeline

    words = Tokenizer(models.WordLevel({str(i): i for i in range(V)}, unk_token="0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    generate = pipeline(
        "text-generation", model=export, tokenizer=PreTrainedTokenizerFast(tokenizer_object=words)
    )
    assert type(generate.model).__name__ == architecture
    text = generate("5 17 42 8", max_new_tokens=4, do_sample=False, return_full_text=False)[0][
        "generated_text"
    ]
    greedy = generate.model.generate(torch.tensor([[5, 17, 42, 8]]), max_new_tokens=4, do_sample=False)
    assert [int(w) for w in text.split()] == greedy[0, 4:].tolist() and text.split()


def test_an_mcore_model_with_qk_layernorm_exports_as_qwen3(tmp_path):
    from mcore.distributed.groups import ProcessGroups
    from mcore.inference.loading import build_model_chunk, gather_logical_state

    cfg = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, ffn_hidden_size=48, seq_length=16, position_embedding_type="rope",
        normalization="RMSNorm", swiglu=True, disable_bias_linear=True, qk_layernorm=True,
    )  # fmt: skip
    single = ProcessGroups.single()
    model = build_model_chunk(cfg, single, V, device=torch.device("cpu"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    state = gather_logical_state([model], single)
    run = {"model": cfg, "tokenizer": {"tokenizer_type": "NullTokenizer", "vocab_size": V - 1}}
    report = export_to_hf(state, run, str(tmp_path / "hf"))
    assert report.architecture == "Qwen3ForCausalLM" and report.parity.max_abs_diff < 1e-4
    for wrong, named in (("LlamaForCausalLM", "qk_layernorm=True"), ("MistralForCausalLM", "qk_layernorm")):
        with pytest.raises(ConversionError, match=named):
            export_to_hf(state, run, str(tmp_path / wrong), architecture=wrong)
        assert not (tmp_path / wrong).exists()
    plain = dataclasses.replace(cfg, qk_layernorm=False)
    with pytest.raises(ConversionError, match="qk_layernorm=False"):
        export_to_hf({}, {**run, "model": plain}, str(tmp_path / "q3"), architecture="Qwen3ForCausalLM")


@pytest.mark.parametrize(
    "architecture, overrides, named",
    [
        ("MistralForCausalLM", dict(sliding_window=16), r"sliding_window=16 \(< max_position_embeddings=32\)"),
        ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), "sliding_window=8"),
        ("Qwen3ForCausalLM", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
        ("Qwen3ForCausalLM", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ],
)  # fmt: skip
def test_unsupported_config_fields_are_refused_and_nothing_is_written(
    architecture, overrides, named, tmp_path
):
    config = {**TINY, **MODELS[architecture][1], "architectures": [architecture]}
    config["model_type"] = {"Q": "qwen2" if "2" in architecture else "qwen3", "M": "mistral"}[architecture[0]]
    config.update(overrides)
    with pytest.raises(ConversionError, match=named):
        model_config_from_hf(config)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=named):
        import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), use_tokenizer=False)
    assert not (tmp_path / "ckpt").exists()


def test_a_window_covering_every_position_converts():
    config = {**TINY, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 32}
    assert model_config_from_hf(config).max_position_embeddings == 32


@pytest.mark.parametrize("architecture", ["MixtralForCausalLM", "Qwen2MoeForCausalLM"])
def test_transformers_5_stacked_experts_in_memory_convert_like_the_per_expert_files(architecture, tmp_path):
    """A live transformers 5 model holds ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj``; its
    ``state_dict()`` converts to the same mcore tensors as the saved per-expert names."""
    import transformers
    from safetensors.torch import load_file

    from mcore.hf.families import hf_to_mcore

    _save_hf_model(architecture, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg = model_config_from_hf(config)
    on_disk = load_file(tmp_path / "hf" / "model.safetensors")
    live = getattr(transformers, architecture).from_pretrained(tmp_path / "hf").state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in live and not any(".experts.0." in k for k in live)
    assert any(".experts.0." in k for k in on_disk)
    from_disk, from_memory = hf_to_mcore(on_disk, cfg, 128), hf_to_mcore(live, cfg, 128)
    assert from_disk.keys() == from_memory.keys()
    for key in from_disk:
        assert torch.equal(from_disk[key], from_memory[key]), key


@pytest.mark.parametrize(
    "architecture, overrides, named",
    [
        ("MixtralForCausalLM", dict(sliding_window=16), "sliding_window=16"),
        ("OlmoeForCausalLM", dict(clip_qkv=8.0), "clip_qkv=8.0"),
        ("Qwen3MoeForCausalLM", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type='dynamic'"),
    ],
)  # fmt: skip
def test_moe_configs_mcore_cannot_express_are_refused(architecture, overrides, named):
    config = {**TINY, **MODELS[architecture][1], "architectures": [architecture], **overrides}
    config["model_type"] = {"Mi": "mixtral", "Ol": "olmoe", "Qw": "qwen3_moe"}[architecture[:2]]
    with pytest.raises(ConversionError, match=named):
        model_config_from_hf(config)


def test_moe_routers_the_classes_lack_are_refused_on_export(tmp_path):
    cfg = ModelConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16, position_embedding_type="rope",
        normalization="RMSNorm", swiglu=True, disable_bias_linear=True, num_experts=4,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    )  # fmt: skip
    run = {"model": cfg, "tokenizer": {"tokenizer_type": "NullTokenizer", "vocab_size": V - 1}}
    with pytest.raises(
        ConversionError, match="MixtralForCausalLM.*moe_router_score_function='sigmoid'.*expert_bias"
    ):
        export_to_hf({}, run, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("architecture", ["MixtralForCausalLM", "OlmoeForCausalLM"])
def test_greedy_generation_from_an_imported_moe_checkpoint_is_transformers(architecture, tmp_path):
    """mcore's generator (key/value cache, the MoE layers) on the imported checkpoint gives
    transformers' greedy ``generate`` tokens (one process; at TP=2 x EP=2 the command gives the one process's
    tokens: tests/inference/test_generation_parallel.py)."""
    import transformers

    from mcore.distributed.groups import ProcessGroups
    from mcore.inference.generate import load_generator
    from mcore.inference.generation import SamplingParams

    _save_hf_model(architecture, tmp_path / "hf")
    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), use_tokenizer=False)
    generator, _ = load_generator(str(tmp_path / "ckpt"), ProcessGroups.single(), device=torch.device("cpu"))
    prompts = [[5, 17, 42, 8], [63, 2, 11, 90]]
    ours = generator.generate(prompts, SamplingParams(max_new_tokens=8, greedy=True, stop_at_eod=False))
    model = getattr(transformers, architecture).from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # eight tokens on both sides
    model.generation_config.pad_token_id = 0
    for prompt, tokens in zip(prompts, ours.tokens):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        assert out[0, len(prompt) :].tolist() == tokens
