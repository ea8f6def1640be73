"""Megatron-LM flags that mcore accepts without a field, or refuses with a reason.

Users bring launch scripts written for Megatron-LM. A flag mcore implements is a config field
(see :mod:`mcore.config.fields`). The two tables here cover the rest, so that nothing a script
passes is silently dropped:

* ``IGNORED_MEGATRON_FLAGS``: flags that select an implementation detail mcore decides itself
  (the device backend picks kernels, fusions and the communication library). They are accepted,
  take an optional value, and change nothing.
* ``UNSUPPORTED_MEGATRON_FLAGS``: features mcore does not have; passing one is an error that says so.
"""

IGNORED_MEGATRON_FLAGS: dict[str, str] = {
    "--use-mcore-models": "mcore has one model implementation",
    "--use-legacy-models": "mcore has one model implementation",
    "--transformer-impl": "kernels come from the device backend's op table",
    "--use-flash-attn": "the device backend serves flash attention when it has it",
    "--no-masked-softmax-fusion": "the device backend decides fusions",
    "--no-bias-gelu-fusion": "the device backend decides fusions",
    "--no-bias-swiglu-fusion": "the device backend decides fusions",
    "--no-bias-dropout-fusion": "the device backend decides fusions",
    "--no-rope-fusion": "the device backend decides fusions",
    "--no-async-tensor-model-parallel-allreduce": "mcore's TP collectives are synchronous",
    "--distributed-backend": "the device backend names its torch.distributed backend",
    "--DDP-impl": "mcore has its own DDP wrapper",
    "--ckpt-format": "mcore writes its own sharded format (see the checkpoint docs)",
    "--use-dist-ckpt": "mcore checkpoints are always sharded",
    "--no-persist-layer-norm": "the device backend decides fusions",
    "--attention-softmax-in-fp32": "mcore always computes the attention softmax in fp32",
    "--no-position-embedding": "use --position-embedding-type rope or alibi",
    "--dataloader-type": "mcore's sampler is Megatron's 'single' type",
    "--timing-log-level": "mcore logs its phase timers at every log interval",
    "--log-params-norm": "not logged yet; accepted",
    "--log-num-zeros-in-grad": "not logged yet; accepted",
    "--log-timers-to-tensorboard": "timers always go to TensorBoard when it is on",
    "--log-validation-ppl-to-tensorboard": "validation perplexity always goes to TensorBoard",
    "--log-memory-to-tensorboard": "memory always goes to TensorBoard when it is on",
    "--log-throughput": "throughput is always logged",
    "--no-create-attention-mask-in-dataloader": "mcore builds the causal mask inside attention",
    "--ckpt-fully-parallel-save": "every rank always writes its own shards",
    "--ckpt-fully-parallel-load": "every rank always reads only what it needs",
    "--manual-gc": "accepted; Python's collector is left on",
    "--wandb-save-dir": "Weights & Biases writes to its default directory",
    "--mmap-bin-files": "memory-mapping .bin files is the default (--no-mmap-bin-files turns it off)",
}

UNSUPPORTED_MEGATRON_FLAGS: dict[str, str] = {
    "--num-experts": "mixture-of-experts models are not implemented",
    "--expert-model-parallel-size": "mixture-of-experts models are not implemented",
    "--moe-router-topk": "mixture-of-experts models are not implemented",
    "--fp8-hybrid": "use --fp8-format hybrid",
    "--fp8-e4m3": "use --fp8-format e4m3",
    "--fp8-interval": "deprecated in Megatron-LM and Transformer Engine; FP8 scales update every step",
    "--fp8-dot-product-attention": "FP8 attention needs Transformer Engine's fused attention; mcore runs "
    "attention in bf16 and the linear layers in FP8 (--fp8-format)",
    "--fp8-multi-head-attention": "FP8 attention needs Transformer Engine's fused attention; mcore runs "
    "attention in bf16 and the linear layers in FP8 (--fp8-format)",
    "--tp-comm-overlap": "overlapping TP communication with GEMMs needs Transformer Engine userbuffers",
    "--use-torch-fsdp2": "use --use-distributed-optimizer (ZeRO-1) instead of FSDP",
    "--use-custom-fsdp": "use --use-distributed-optimizer (ZeRO-1) instead of FSDP",
    "--spec": "mcore builds GPT layers from its own specs",
    "--encoder-num-layers": "encoder-decoder models are not implemented",
    "--retro-add-retriever": "RETRO is not implemented",
    "--use-mup": "muP is not implemented",
}
