"""Mixture of experts (Megatron-core's ``transformer/moe``), one concern per module.

* ``config``: the ``--num-experts`` / ``--moe-*`` flags (:class:`MoEFlags`, inherited by
  ``ModelConfig``), their checks and the resolved view :class:`MoEConfig` (``ModelConfig.moe``);
* ``router``: :class:`TopKRouter` (fp32 weight, score function, expert bias, token counts);
* ``aux_losses``: load-balancing and z losses and the autograd function that adds their gradient;
* ``capacity``: expert capacity and token dropping;
* ``dispatcher``: token dispatch/combine (local, all-gather over TP x EP, all-to-all over EP);
* ``experts``: the routed experts on the op table's ``grouped_gemm``;
* ``shared_experts``: the shared expert(s) and their sigmoid gate;
* ``moe_layer``: :class:`MoELayer` (router -> dispatch -> experts -> combine, + shared), the MLP slot;
* ``training``: what the training loop does for MoE (aux-loss scale, expert-bias update, logs).

This package imports nothing at import time so that ``config`` can be read by ``model_config``.
"""
