"""Megatron-LM checkpoints in and out.

Reading (``--load DIR`` detects the format, :mod:`.detect`; nothing to convert first):

* ``--ckpt-format torch`` (:mod:`.read_torch`): ``latest_checkpointed_iteration.txt`` and
  ``iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt``, with megatron-core GPTModel names
  (``decoder.layers.N.self_attention.linear_qkv.weight``, local or Transformer-Engine spelling) or the
  legacy ``language_model.encoder.layers.N.self_attention.query_key_value.weight`` names
  (:mod:`.names`); ``checkpoint_version`` 0, 1.0 and >= 2.0 QKV layouts; ``args`` give the model config
  (:mod:`.args`).
* ``--ckpt-format torch_dist`` (:mod:`.read_dist`): megatron-core's torch.distributed.checkpoint
  directory (``metadata.json``, ``common.pt``, ``.metadata``, ``__R_N.distcp``), read with
  ``torch.distributed.checkpoint.FileSystemReader`` in each process (no megatron import).

Both present the saved shards to mcore's loader as placements of mcore's logical tensors (the same
names: megatron-core's, with global layer numbers), so the loader's resharding copies them into any
TP/PP/DP layout. The ``torch`` format's Adam state (``model_optim_rng.pt``'s ``optimizer``, or
``distrib_optim.pt``, :mod:`.read_optim`) and ``torch_dist``'s model-space ``optimizer.state.*`` tensors
become optimizer records the same way; what cannot be mapped is refused with a message naming the file
(``--no-load-optim`` or ``--finetune``). RNG states are reseeded (``--seed`` + iteration), as after a
layout change.

Writing (:mod:`.write`): ``mcore-export-megatron --load DIR --save OUT --ckpt-format torch|torch_dist``.
"""
