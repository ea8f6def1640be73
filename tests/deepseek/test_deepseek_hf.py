"""DeepseekV3ForCausalLM and DeepseekV2ForCausalLM (V2-Lite-shaped: no q_lora_rank) in and out: tiny
random models built with transformers on the CPU, imported with the logit self-check (eager and sdpa,
1e-4 fp32; YaRN RoPE with the mscale corrections, sigmoid group-limited routing with the expert bias
and routed scaling, first-k-dense layers, a shared expert) and exported back with identical tensors;
unsupported settings are refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from mcore.hf import ConversionError, export_checkpoint, import_from_hf
from mcore.hf.families import hf_to_mcore, model_config_from_hf

V = 100
COMMON = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    kv_lora_rank=12,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=6,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
)
YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8,
)  # fmt: skip
MODELS = {
    "DeepseekV3ForCausalLM": (
        "DeepseekV3Config",
        dict(q_lora_rank=16, n_group=2, topk_group=1, norm_topk_prob=True, rope_parameters=YARN),
    ),
    "DeepseekV2ForCausalLM": (
        "DeepseekV2Config",
        dict(
            q_lora_rank=None,
            topk_method="greedy",
            num_experts=4,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        ),
    ),
}


def _save_hf_model(architecture: str, path, **overrides) -> None:
    import transformers

    config_class, settings = MODELS[architecture]
    config = getattr(transformers, config_class)(**{**COMMON, **settings, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():  # norms and router away from their initial values, experts non-trivial
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith("gate.weight") or "experts" in name:
                param.normal_(0.0, 0.2)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn_like(buf))
    model.save_pretrained(path)


@pytest.mark.parametrize("architecture", list(MODELS))
def test_import_then_export_gives_back_the_same_model(architecture, tmp_path):
    from safetensors.torch import load_file

    _save_hf_model(architecture, tmp_path / "hf")
    report = import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), use_tokenizer=False)
    assert report.parity.max_abs_diff < 1e-4, report.parity.describe()
    assert set(report.parity.per_implementation) == {"eager", "sdpa"}
    cfg = report.model_config
    assert cfg.multi_latent_attention and cfg.moe.moe_layers == (False, True)
    assert cfg.moe_shared_expert_intermediate_size == 16 and cfg.moe_router_topk_scaling_factor == 2.5
    if architecture == "DeepseekV3ForCausalLM":
        assert (cfg.rope_type, cfg.rotary_scaling_factor, cfg.mscale_all_dim) == ("yarn", 4.0, 0.8)
        assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias
        assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (2, 1)
    else:
        assert cfg.q_lora_rank is None and cfg.rope_type == "rope" and cfg.moe_router_pre_softmax
    back = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "again"))
    assert back.architecture == architecture and back.parity.max_abs_diff < 1e-4
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["architectures"] == [architecture]
    before = load_file(tmp_path / "hf" / "model.safetensors")
    after = load_file(tmp_path / "again" / "model.safetensors")
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key].float(), after[key].float()), key


def _hf_dict(architecture, **overrides):
    import transformers

    config_class, settings = MODELS[architecture]
    return getattr(transformers, config_class)(**{**COMMON, **settings, **overrides}).to_dict()


@pytest.mark.parametrize(
    "overrides, named",
    [
        (dict(rope_parameters={**YARN, "rope_type": "linear", "factor": 2.0}), "rope_type='linear' is not supported"),
        (dict(num_experts_per_tok=4, topk_group=1), "num_experts_per_tok=4, topk_group=1"),
        (dict(rope_interleave=False), "rope_interleave=False"),
    ],
)  # fmt: skip
def test_unsupported_deepseek_configs_are_refused_naming_the_field(overrides, named):
    with pytest.raises(ConversionError, match=named):
        model_config_from_hf(_hf_dict("DeepseekV3ForCausalLM", **overrides))


def test_greedy_generation_from_an_imported_deepseek_v3_is_transformers(tmp_path):
    """mcore's generator (MLA's latent key/value cache, YaRN, the sigmoid router with its expert bias)
    on the imported checkpoint gives transformers' greedy ``generate`` tokens."""
    import transformers

    from mcore.distributed.groups import ProcessGroups
    from mcore.inference.generate import load_generator
    from mcore.inference.generation import SamplingParams

    _save_hf_model("DeepseekV3ForCausalLM", tmp_path / "hf")
    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), use_tokenizer=False, check_parity=False)
    generator, _ = load_generator(str(tmp_path / "ckpt"), ProcessGroups.single(), device=torch.device("cpu"))
    prompts = [[5, 17, 42, 8], [63, 2, 11, 90]]
    ours = generator.generate(prompts, SamplingParams(max_new_tokens=8, greedy=True, stop_at_eod=False))
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    for prompt, tokens in zip(prompts, ours.tokens):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        assert out[0, len(prompt) :].tolist() == tokens


def _save_hub_style_mtp(path, tmp_path) -> None:
    """A tiny DeepseekV3 checkpoint as the Hub's carry MTP: a 3-layer model's files with
    ``num_hidden_layers=2``, its layer 2 the MTP layer, plus the depth's own tensors and the copies
    of the embedding and head (transformers' model ignores them)."""
    from safetensors.torch import load_file, save_file

    _save_hf_model("DeepseekV3ForCausalLM", path, num_hidden_layers=3)
    tensors = load_file(path / "model.safetensors")
    gen, h = torch.Generator().manual_seed(5), COMMON["hidden_size"]
    mtp = "model.layers.2."
    for name, shape in (
        ("enorm", (h,)),
        ("hnorm", (h,)),
        ("shared_head.norm", (h,)),
        ("eh_proj", (h, 2 * h)),
    ):
        base = torch.ones(shape) if len(shape) == 1 else torch.zeros(shape)
        tensors[f"{mtp}{name}.weight"] = base + 0.1 * torch.randn(shape, generator=gen)
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps({**config, "num_hidden_layers": 2, "num_nextn_predict_layers": 1})
    )


def _reference_mtp_loss(hub, ids, labels, padded: int) -> float:
    """Depth 1 of DeepSeek-V3's MTP from the Hub tensors with transformers' modules (vLLM's order):
    ``h1 = shared_head.norm(layer(eh_proj([enorm(embed(t_{i+1})); hnorm(h0)])))``, the loss against
    ``labels_{i+1}`` over the positions that have one (mcore's imported head has ``padded`` rows, the
    padding zero: their logits 0 join the softmax, as in Megatron)."""
    import transformers
    from safetensors.torch import load_file

    from mcore.models.transformer.mtp.block import shift_left

    tensors = load_file(hub / "model.safetensors")
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(
        hub, dtype=torch.float32, attn_implementation="sdpa"
    )
    config = transformers.DeepseekV3Config.from_pretrained(
        hub, num_hidden_layers=3, attn_implementation="sdpa"
    )
    layer = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(config, 2)
    prefix = "model.layers.2."
    own = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    layer_state = {
        k: v
        for k, v in own.items()
        if k.split(".")[0] in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
    }
    experts = {}
    for e in range(COMMON["n_routed_experts"]):
        x = f"mlp.experts.{e}."
        experts.setdefault("gate_up_proj", []).append(
            torch.cat([layer_state.pop(x + "gate_proj.weight"), layer_state.pop(x + "up_proj.weight")])
        )
        experts.setdefault("down_proj", []).append(layer_state.pop(x + "down_proj.weight"))
    layer_state.update({f"mlp.experts.{k}": torch.stack(v) for k, v in experts.items()})
    layer.load_state_dict(layer_state)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + COMMON["rms_norm_eps"]) * w

    with torch.no_grad():
        model.eval(), layer.eval()
        h0 = model.model(ids).last_hidden_state
        emb = model.model.embed_tokens(shift_left(ids))
        x = (
            torch.cat([rms(emb, own["enorm.weight"]), rms(h0, own["hnorm.weight"])], -1)
            @ own["eh_proj.weight"].T
        )
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        x = layer(x.contiguous(), position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos))
        logits = rms(x, own["shared_head.norm.weight"]) @ own["shared_head.head.weight"].T
        logits = torch.cat([logits, logits.new_zeros(*logits.shape[:2], padded - V)], -1)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, padded), labels[:, 1:].reshape(-1)
    ).item()


def test_the_hub_mtp_layer_imports_when_asked_and_exports_back(tmp_path, caplog, capsys):
    """``--mtp-num-layers 1``: the Hub's extra layer becomes mcore's MTP depth (its loss is the one
    computed with transformers' modules) and the export writes it back tensor for tensor; without the
    flag the layer is skipped with a note; a depth the checkpoint lacks is refused."""
    from safetensors.torch import load_file

    from mcore.checkpoint import load_logical_model_state
    from mcore.distributed.groups import ProcessGroups
    from mcore.inference.loading import build_model_chunk

    hub = tmp_path / "hub"
    _save_hub_style_mtp(hub, tmp_path)
    with caplog.at_level("WARNING"):
        plain = import_from_hf(str(hub), str(tmp_path / "plain"), use_tokenizer=False, check_parity=False)
    assert plain.model_config.mtp_num_layers is None and "--mtp-num-layers 1 imports them" in caplog.text
    report = import_from_hf(str(hub), str(tmp_path / "ckpt"), use_tokenizer=False, mtp_num_layers=1)
    assert report.parity.max_abs_diff < 1e-4 and report.model_config.mtp_num_layers == 1
    assert "--mtp-num-layers" in report.flags

    state, meta = load_logical_model_state(str(tmp_path / "ckpt"))
    model = build_model_chunk(report.model_config, ProcessGroups.single(), report.padded_vocab_size, state)
    gen = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, V, (2, 10), generator=gen), torch.randint(0, V, (2, 10), generator=gen)
    model.train()
    model(ids, labels=labels)
    ours = model.mtp.step_losses[0].item()
    assert ours == pytest.approx(_reference_mtp_loss(hub, ids, labels, report.padded_vocab_size), rel=1e-5)

    back = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "again"), mtp_num_layers=1)
    assert back.parity.max_abs_diff < 1e-4
    assert json.loads((tmp_path / "again" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    before, after = load_file(hub / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert before.keys() == after.keys()
    assert [k for k in before if not torch.equal(before[k].float(), after[k].float())] == []
    without = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "plain-hf"), check_parity=False)
    assert json.loads((tmp_path / "plain-hf" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert not any(
        k.startswith("model.layers.2.") for k in load_file(tmp_path / "plain-hf" / "model.safetensors")
    )
    assert without.architecture == "DeepseekV3ForCausalLM"

    # the command lines (exit status 2, one line naming the flag)
    from mcore.hf.export import main as export_main
    from mcore.hf.importer import main as import_main

    two = ["--mtp-num-layers", "2"]
    assert import_main(["--hf-dir", str(hub), "--save", str(tmp_path / "two"), "--no-tokenizer", *two]) == 2
    assert export_main(["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "two-hf"), *two]) == 2
    err = capsys.readouterr().err
    assert "--mtp-num-layers 2: the checkpoint has 1 MTP layer" in err
    assert "--mtp-num-layers 2: the checkpoint has mtp_num_layers=1" in err
    hub_state = load_file(hub / "model.safetensors")
    hub_state["model.layers.2.shared_head.head.weight"] = hub_state["lm_head.weight"] + 1
    with pytest.raises(
        ConversionError, match="model.layers.2.shared_head.head.weight differs from the model's lm_head"
    ):
        hf_to_mcore(hub_state, report.model_config, report.padded_vocab_size)
