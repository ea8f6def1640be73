"""DeepSeek-V3's multi-token-prediction layers on the Hub <-> mcore's MTP depths (the mapping is in
:mod:`mcore.hf.deepseek`'s docstring and docs/deepseek.md). The transformer layer of each depth goes
through the DeepSeek layer mapping, passed in as ``layer_to_hf`` / ``layer_from_hf``
(``(src, cfg, mcore prefix, HF prefix, moe, out)``)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mcore.hf.errors import ConversionError
from mcore.hf.tensors import TensorSource
from mcore.models.transformer.model_config import ModelConfig

logger = logging.getLogger(__name__)

HF_WORD_KEY = "model.embed_tokens.weight"
MTP_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
"""An MTP depth's own tensors: mcore name (after ``mtp.layers.k.``) -> the Hub's (after the layer)."""
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
LayerFn = Callable[..., None]


def check_mtp_import(has_mtp: bool, arch: str, hf: Mapping[str, Any], where: str, depths: int | None) -> None:
    """``--mtp-num-layers D`` on import: the class and the checkpoint must have ``D`` MTP layers."""
    if not depths:
        return
    hub = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0
    if not has_mtp or depths > hub:
        raise ConversionError(
            f"{where}: --mtp-num-layers {depths}: the checkpoint has {hub} MTP layer(s) "
            f"(num_nextn_predict_layers of {arch})"
        )


def split_mtp_layers(
    hf_state: Mapping[str, torch.Tensor], layers: int, depths: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(the model's tensors, the first depths MTP layers' tensors)`` of a Hub state dict; the MTP
    layers past those are skipped with a note; fewer than ``depths`` are refused."""
    extra = sorted(
        {int(m.group(1)) for k in hf_state if (m := _LAYER.match(k)) and int(m.group(1)) >= layers}
    )
    if len(extra) < depths or extra[:depths] != list(range(layers, layers + depths)):
        raise ConversionError(
            f"--mtp-num-layers {depths}: the checkpoint has {len(extra)} MTP layer(s) past "
            f"num_hidden_layers={layers} (model.layers.{layers}.* ...)"
        )
    if len(extra) > depths:
        logger.warning(
            f"note: {len(extra) - depths} multi-token-prediction layer(s) of the checkpoint (model.layers."
            f"{extra[depths]}.* ...) not imported; --mtp-num-layers {len(extra)} imports them as mcore's MTP"
        )
    kept, mtp = {}, {}
    for k, v in hf_state.items():
        m = _LAYER.match(k)
        i = int(m.group(1)) if m else -1
        if i < layers:
            kept[k] = v
        elif i < layers + depths:
            mtp[k] = v
    return kept, mtp


def mtp_to_hf(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig, out: dict[str, torch.Tensor], layer_to_hf: LayerFn
) -> None:
    """MTP depths ``0..D-1`` as ``model.layers.{L + k}.*`` (with copies of the embedding and head)."""
    src = TensorSource({k: v for k, v in state.items() if k.startswith("mtp.")}, "the checkpoint")
    word, head = out[HF_WORD_KEY], out.get("lm_head.weight", out[HF_WORD_KEY])
    for k in range(cfg.mtp_num_layers):
        p, hp = f"mtp.layers.{k}.", f"model.layers.{cfg.num_layers + k}."
        for ours, theirs in MTP_OWN.items():
            out[hp + theirs] = src.get(p + ours)
        out[hp + "embed_tokens.weight"], out[hp + "shared_head.head.weight"] = word.clone(), head.clone()
        layer_to_hf(src, cfg, p + "mtp_model_layer.", hp, cfg.moe.moe_layers[-1], out)


def mtp_from_hf(
    mtp: Mapping[str, torch.Tensor],
    hf_state: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    base: dict,
    layer_from_hf: LayerFn,
) -> dict[str, torch.Tensor]:
    """The MTP depths' mcore tensors from their Hub layers ``mtp``; each depth's transformer layer has
    the last decoder layer's shapes (megatron-core builds it from that layer's spec)."""
    src, out = TensorSource(mtp, "the Hugging Face model"), {}
    shared = {"embed_tokens.weight": HF_WORD_KEY, "shared_head.head.weight": "lm_head.weight"}
    h, last = cfg.hidden_size, f"decoder.layers.{cfg.num_layers - 1}."
    for k in range(cfg.mtp_num_layers):
        p, hp = f"mtp.layers.{k}.", f"model.layers.{cfg.num_layers + k}."
        for ours, theirs in MTP_OWN.items():
            out[p + ours] = src.get(hp + theirs)
        for theirs, main in shared.items():
            copy = src.optional(hp + theirs)
            if copy is not None and not torch.equal(copy, hf_state.get(main, hf_state[HF_WORD_KEY])):
                raise ConversionError(
                    f"{hp}{theirs} differs from the model's {main}: mcore's multi-token prediction shares "
                    "the word embedding and the output layer"
                )
        layer_from_hf(src, cfg, p + "mtp_model_layer.", hp, cfg.moe.moe_layers[-1], out)
    if src.leftovers():
        raise ConversionError(
            f"the MTP layers have tensors with no place in mcore: {', '.join(src.leftovers()[:8])}"
        )
    for key, t in out.items():
        rest = key.split(".", 3)[3]
        want = (h, 2 * h) if rest == "eh_proj.weight" else (h,) if rest in MTP_OWN else None
        if want is None:
            want = tuple(base[last + rest.removeprefix("mtp_model_layer.")].shape)
        if tuple(t.shape) != want:
            raise ConversionError(f"{key}: shape {tuple(t.shape)} (expected {want})")
    return {k: v.contiguous() for k, v in out.items()}
