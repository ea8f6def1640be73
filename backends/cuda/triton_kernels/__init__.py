"""Triton kernels of the CUDA backend, each wrapped as a ``torch.autograd.Function``.

Importing any module of this package imports Triton, so only :mod:`mcore.backends.cuda.ops` imports
them, and only when an op runs on a CUDA tensor: ``import mcore`` and the CPU suite never need Triton.

Modules:

* :mod:`.norms`: RMSNorm and LayerNorm, forward and backward (weight and bias gradients).
* :mod:`.rotary`: rotary position embedding (rotate-half, partial rotary), forward and backward.
* :mod:`.activations`: SwiGLU, bias-GeLU (exact and tanh), bias-dropout-add.
* :mod:`.cross_entropy`: chunked cross-entropy over bf16/fp16/fp32 logits (no fp32 copy of the logits).
* :mod:`.adam`: the one-pass AdamW over flat buffers (``adam_step_flat``, ``adam_step_flat_fp8``).
* :mod:`.fp8_cast`: the FP8 amax and cast(-transpose) kernels (``fp8_amax``, ``fp8_cast``,
  ``fp8_cast_dbias``, ``fp8_cast_packed``).
* :mod:`.fp8_transpose`: the FP8 transpose (``fp8_transpose``).
* :mod:`.act_fp8`: the MLP activation writing fc2's FP8 input and fc1's FP8 output gradient
  (``act_fp8_forward``, ``act_fp8_backward``).
* :mod:`.norm_fp8`: the norm's statistics and the normalising FP8 cast (``norm_fp8_forward``), and
  ``norm_backward`` with the residual gradient.
* :mod:`.fp8_flat`: the flat FP8 maps of ``--fp8-param-gather`` (``fp8_quantize_flat``,
  ``fp8_dequantize_flat``).
* :mod:`.gelu_reference`: the GeLU kernels' fp32 math against float64 (a test and benchmark helper).
* :mod:`._common`: shared helpers (device facts, block-size heuristics, dtype checks).

The FP8 kernels' op glue is :mod:`mcore.backends.cuda.fp8` (and :mod:`mcore.backends.cuda.ops` for
``norm_fp8_forward`` and ``adam_step_flat_fp8``).

Every launcher takes optional block-size overrides (``config=``), used by the kernel benchmark's sweep.
Setting ``TRITON_INTERPRET=1`` before the first import runs the kernels in Triton's CPU interpreter
(on CPU tensors), which is how the kernels can be debugged without a GPU.
"""
