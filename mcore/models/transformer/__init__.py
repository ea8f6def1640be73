"""The transformer building blocks every model family is built from.

Modules, in the order a layer uses them:

* ``model_config``: :class:`ModelConfig` (Megatron's model flags, the families' fields included),
  :func:`padded_vocab_size` and the checks against the parallel layout;
* ``build_context``: :class:`BuildContext`, how a model is split (process groups, dtype, FP8);
* ``spec``: :class:`ModuleSpec` and :func:`build_module` (which class builds each part of a layer);
* ``embeddings`` (word, position, token-type), ``positions`` (RoPE, ALiBi), ``norms``;
* ``attention`` (self-attention, the core attention), ``cross_attention`` (queries from the layer,
  keys and values from an encoder's output), ``mlp`` (the dense MLP);
* ``layer``: :class:`TransformerLayer` (norm, attention, residual; norm, MLP, residual) with
  selective recomputation; ``block``: :class:`TransformerBlock` (the layers and the final norm) with
  full recomputation; ``layer_graphs``: the block's device graphs (``--cuda-graph-impl local``) and
  their policy (what a run with graphs may not combine, when the trainer arms the capture);
* ``language_module``: :class:`LanguageModule`, what the families share (the vocab-parallel output
  layer, tied embeddings over pipeline stages, the sharded-parameter view).

The families (:mod:`mcore.models.gpt`, :mod:`mcore.models.bert`, :mod:`mcore.models.t5`) choose
these parts through layer specs. Each slot of a layer spec takes any module that keeps the slot's
call signature: the MLP slot (``TransformerLayerSubmodules.mlp``) is where the mixture-of-experts layer
plugs in (``moe``: :mod:`mcore.models.transformer.moe`, chosen per layer by ``--moe-layer-freq``); new attention variants (e.g.
multi-latent attention) go beside ``attention.py`` and plug into the ``self_attention`` slot.
"""
