"""Triton kernels of the CUDA backend, each wrapped as a ``torch.autograd.Function``.

Importing any module of this package imports Triton, so only :mod:`mcore.backends.cuda.ops` imports
them, and only when an op runs on a CUDA tensor: ``import mcore`` and the CPU suite never need Triton.

Modules:

* :mod:`.norms`: RMSNorm and LayerNorm, forward and backward (weight and bias gradients).
* :mod:`.rotary`: rotary position embedding (rotate-half, partial rotary), forward and backward.
* :mod:`.activations`: SwiGLU, bias-GeLU (exact and tanh), bias-dropout-add.
* :mod:`.cross_entropy`: chunked cross-entropy over bf16/fp16/fp32 logits (no fp32 copy of the logits).

Every launcher takes optional block-size overrides (``config=``), used by the kernel benchmark's sweep.
Setting ``TRITON_INTERPRET=1`` before the first import runs the kernels in Triton's CPU interpreter
(on CPU tensors), which is how the kernels can be debugged without a GPU.
"""
