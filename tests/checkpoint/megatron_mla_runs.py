"""megatron-core's side of the Megatron MLA/MTP checkpoint test (imported by the spawned rank): a tiny
DeepSeek-V3-style GPTModel (MLA with YaRN and q/kv latent norms, first layer dense, sigmoid
group-limited router with scaling, expert bias and a shared expert, one MTP depth) from megatron-core's
local spec, on CPU, at TP=1; saved as Megatron-LM's ``--ckpt-format torch`` saves it; its logits and
per-depth MTP losses; and the same for a checkpoint loaded back into it (strict).

What megatron-core 0.16.1 cannot run on CPU as shipped, and the stand-ins used here:

* MLA's core attention: ``MLASelfAttention`` passes ``k_channels`` / ``v_channels`` to its core
  attention, which the local ``DotProductAttention`` does not take (MLA expects Transformer Engine's);
  :class:`SdpaCoreAttention` (no parameters, so the checkpoint is unchanged) computes the causal
  softmax attention with MLA's ``softmax_scale``.
* ``multi_latent_attention.HAVE_TE`` is True when ``megatron.core.extensions.transformer_engine``
  imports without Transformer Engine, and ``isinstance(..., TELinear=None)`` then fails: set False.
* The MTP path computes its losses only with labels (``GPTModel._postprocess`` clones them even in
  eval): logits are taken with ``config.mtp_num_layers`` and ``mtp_process`` switched off, the MTP
  losses in training mode from ``MTPLossLoggingHelper``'s tracker.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import megatron_runs as mr  # noqa: E402

FAMILY = "dsv3"
MOE = dict(
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
    moe_shared_expert_intermediate_size=16,
    moe_router_score_function="sigmoid",
    moe_router_num_groups=2,
    moe_router_group_topk=1,
    moe_router_topk_scaling_factor=2.5,
    moe_router_enable_expert_bias=True,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-2,
    moe_layer_freq=[0, 1],
    moe_token_dispatcher_type="allgather",
)
MLA = dict(
    multi_latent_attention=True,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=6,
    rope_type="yarn",
    rotary_scaling_factor=4.0,
    original_max_position_embeddings=4,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=0.8,
)
MTP = dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
mr.FAMILIES[FAMILY] = {**mr.FAMILIES["llama"], "num_layers": 2, "num_query_groups": None, "moe": MOE}


def _args(fmt: str = "torch"):
    args = mr.megatron_args(FAMILY, 1, 1, 1, fmt)
    vars(args).update(MLA, **MTP)
    return args


class SdpaCoreAttention(torch.nn.Module):
    """Causal softmax attention for MLA (``[s, b, n, d]`` in, ``[s, b, n * dv]`` out)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, **_):
        s, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def build_model():
    import megatron.core.transformer.multi_latent_attention as mla_module
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    mla_module.HAVE_TE = False
    f = mr.FAMILIES[FAMILY]
    moe = {("num_moe_experts" if k == "num_experts" else k): v for k, v in MOE.items()}
    cfg = MLATransformerConfig(
        num_layers=f["num_layers"],
        hidden_size=f["hidden_size"],
        num_attention_heads=f["num_attention_heads"],
        ffn_hidden_size=f["ffn_hidden_size"],
        normalization="RMSNorm",
        layernorm_epsilon=f["norm_epsilon"],
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        init_method_std=0.02,
        qk_layernorm=True,
        rotary_base=f["rotary_base"],
        **{k: v for k, v in MLA.items() if k != "multi_latent_attention"},
        **moe,
        **MTP,
    )
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    mtp = get_gpt_mtp_block_spec(cfg, spec.layer_specs[-1], use_transformer_engine=False)
    return GPTModel(
        cfg,
        spec,
        vocab_size=mr.padded_vocab(f["vocab_size"], 1),
        max_sequence_length=f["max_position_embeddings"],
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=f["rotary_base"],
        mtp_block_spec=mtp,
    )


def outputs(model) -> dict:
    """The main logits ``[b, s, Vp]`` (eval, MTP off) and the per-depth MTP losses (training mode,
    labels = the inputs; dropout is off so the modes compute alike)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    ids, pos, mask = mr.inputs(FAMILY)
    model.eval()
    depths, process = model.config.mtp_num_layers, model.mtp_process
    model.config.mtp_num_layers, model.mtp_process = None, False
    with torch.no_grad():
        logits = model(ids, pos, attention_mask=mask)
    model.config.mtp_num_layers, model.mtp_process = depths, process
    model.train()
    MTPLossLoggingHelper.tracker.clear()
    with torch.no_grad():
        model(ids, pos, attention_mask=mask, labels=ids)
    return {"ids": ids, "logits": logits, "mtp": MTPLossLoggingHelper.tracker["values"].clone()}


def save_and_reload(out: str, export: str | None) -> dict:
    """Rank function (one process): build, perturb (norms, expert bias), save ``out/torch`` as
    Megatron-LM's ``torch`` format, return the outputs; with ``export``, then the outputs of a fresh
    model loading ``export`` (strict) after ``export_fn(out/torch, export)``."""
    mr.shim_megatron_for_cpu()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    model = build_model()
    mr.perturb_norms_and_biases(model)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(torch.tensor([0.3, -0.2, 0.1, -0.4]))
    folder = os.path.join(out, "torch", f"iter_{mr.ITERATION:07d}", "mp_rank_00")
    os.makedirs(folder)
    state = {"args": _args(), "checkpoint_version": 3.0, "iteration": mr.ITERATION}
    torch.save(
        {**state, "model": model.state_dict_for_save_checkpoint()}, os.path.join(folder, "model_optim_rng.pt")
    )
    with open(os.path.join(out, "torch", "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(mr.ITERATION))
    result = {"saved": outputs(model), "keys": sorted(model.state_dict_for_save_checkpoint())}
    if export is not None:
        from mcore.checkpoint.megatron.write import export_to_megatron

        export_to_megatron(os.path.join(out, "torch"), export, "torch", tp=1, pp=1)
        torch.manual_seed(99)
        again = build_model()
        data = torch.load(
            os.path.join(export, f"iter_{mr.ITERATION:07d}", "mp_rank_00", "model_optim_rng.pt"),
            weights_only=False,
        )
        again.load_state_dict(data["model"], strict=True)
        result["loaded"] = outputs(again)
        result["bias"] = [b.clone() for n, b in again.named_buffers() if n.endswith("expert_bias")]
    ps.destroy_model_parallel()
    return result
