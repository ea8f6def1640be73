"""mcore: Megatron-style LLM training on one hardware-agnostic core.

Where things live (each module owns one concern):

* ``mcore.config``: typed config dataclasses whose fields are Megatron's flags; the CLI generator.
* ``mcore.plugins``, ``mcore.backend``, ``mcore.ops``: the device-backend plugin API, the backend
  object and the named op table (every op has a pure-PyTorch reference).
* ``mcore.distributed``: rank arithmetic, process groups, DDP with bucketed grad reduction.
* ``mcore.tensor_parallel``: TP/SP layers, collectives, vocab-parallel cross-entropy, RNG tracker.
* ``mcore.models``: the GPT family (GPT-2/3, Llama-style) built from layer specs.
* ``mcore.pipeline``: pipeline schedules (no pipelining, 1F1B, interleaved) and p2p.
* ``mcore.optimizer``: mixed-precision Adam/SGD, loss scaling, the distributed optimizer.
* ``mcore.data``: tokenizers, Megatron ``.bin/.idx`` datasets, preprocessing, GPT datasets, blending.
* ``mcore.checkpoint``: sharded, resharding, crash-safe checkpoints.
* ``mcore.hf``, ``mcore.inference``: Hugging Face export/import and text generation.
* ``mcore.training``: ``pretrain()`` and the training loop.
* ``mcore.backends``, ``mcore.adaptors``: built-in backends (cpu, cuda, npu) and the NPU adaptor.

Importing ``mcore`` has no side effects: no device is probed and no plugin is loaded until used.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
