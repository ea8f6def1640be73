"""Hugging Face interoperability: GPT-2, Llama-style (Llama, Mistral, Qwen2/3, Mixtral, Qwen2/3-MoE, OLMoE),
BERT and T5 v1.1 export/import with self-checking parity.

Commands::

    python -m mcore.hf.export   --load CKPT --save HF_DIR        # mcore checkpoint -> transformers
    python -m mcore.hf.importer --hf-dir HF_DIR --save CKPT      # transformers -> mcore checkpoint

Library (all on logical, unsharded state dicts, so independent of the checkpoint layout):

* :func:`export_to_hf` / :func:`export_checkpoint`, :func:`import_from_hf`;
* :func:`mcore_to_hf` / :func:`hf_to_mcore` (tensors), :func:`hf_config_dict` /
  :func:`model_config_from_hf` (configs), :func:`check_logit_parity`.

Every export and import runs the same token batch through both models and fails (writing nothing)
when the largest logit difference exceeds the tolerance (fp32: 1e-4).

Modules: the command lines :mod:`mcore.hf.export` and :mod:`mcore.hf.importer` look the family up
in the table of :mod:`mcore.hf.families` (:class:`~mcore.hf.family.HfFamily`) and run it on the shared
helpers: :mod:`mcore.hf.staging` (dtypes, directory files, staging), :mod:`mcore.hf.reports`,
:mod:`mcore.hf.parity`, :mod:`mcore.hf.tokenizer`, :mod:`mcore.hf.tensors` (QKV packing, vocabulary
rows), :mod:`mcore.hf.megatron_flags`. One mapping module per family states its mapping (names,
shapes, QKV and gate/up packing, RoPE conventions): :mod:`mcore.hf.gpt2` and :mod:`mcore.hf.llama`
(``GPT2LMHeadModel``, ``LlamaForCausalLM``, on :mod:`mcore.hf.gpt_state`), :mod:`mcore.hf.bert` with
:mod:`mcore.hf.bert_io` (Megatron's BERT, ``MegatronBertForPreTraining``), :mod:`mcore.hf.t5`
(``T5ForConditionalGeneration``; encoder output, decoder logits and greedy ``generate`` checked).
"""

import importlib

_EXPORTS = {
    "GPT2": "mcore.hf.gpt_state",
    "LLAMA": "mcore.hf.gpt_state",
    "check_exportable": "mcore.hf.families",
    "hf_config_dict": "mcore.hf.families",
    "megatron_model_flags": "mcore.hf.megatron_flags",
    "model_config_from_hf": "mcore.hf.families",
    "ConversionError": "mcore.hf.errors",
    "ParityError": "mcore.hf.errors",
    "ExportReport": "mcore.hf.reports",
    "export_checkpoint": "mcore.hf.export",
    "export_to_hf": "mcore.hf.export",
    "ImportReport": "mcore.hf.reports",
    "import_from_hf": "mcore.hf.importer",
    "hf_to_mcore": "mcore.hf.families",
    "mcore_to_hf": "mcore.hf.families",
    "merge_qkv": "mcore.hf.tensors",
    "split_qkv": "mcore.hf.tensors",
    "ParityReport": "mcore.hf.parity",
    "check_logit_parity": "mcore.hf.parity",
}


def __getattr__(name: str):
    # Lazy, so that ``python -m mcore.hf.export`` does not import its own module twice.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mcore.hf' has no attribute {name!r}")


__all__ = [
    "GPT2",
    "LLAMA",
    "ConversionError",
    "ExportReport",
    "ImportReport",
    "ParityError",
    "ParityReport",
    "check_exportable",
    "check_logit_parity",
    "export_checkpoint",
    "export_to_hf",
    "hf_config_dict",
    "hf_to_mcore",
    "import_from_hf",
    "mcore_to_hf",
    "megatron_model_flags",
    "merge_qkv",
    "model_config_from_hf",
    "split_qkv",
]
