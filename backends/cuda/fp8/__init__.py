"""The CUDA side of FP8: the op glue that serves the FP8 ops of the op table (each dispatcher checks
that its kernel fits, else runs the reference), beside :mod:`mcore.fp8`, the core's FP8.

* :mod:`.linear`: the ``scaled_linear`` family on ``torch._scaled_mm``, the casts (``fp8_amax``,
  ``fp8_cast``, ``fp8_cast_dbias``, ``fp8_cast_packed``, ``fp8_transpose``; the rowwise
  ``fp8_quantize`` compiled by Inductor) and the backend's ``fp8``/``fp8_rowwise`` capabilities;
* :mod:`.act`: ``act_fp8_forward`` / ``act_fp8_backward``, the activations that write fc2's FP8 input;
* :mod:`.flat`: ``fp8_quantize_flat`` / ``fp8_dequantize_flat`` of ``--fp8-param-gather``.

``norm_fp8_forward`` and ``adam_step_flat_fp8`` stay with the norms' and the flat Adam step's
dispatchers in :mod:`mcore.backends.cuda.ops` (they share those dispatchers' fit checks). The FP8
Triton kernels stay in :mod:`mcore.backends.cuda.triton_kernels` (``fp8_cast``, ``fp8_transpose``,
``act_fp8``, ``norm_fp8``, ``fp8_flat``), beside the kernels they share code with (``_common``, the
activations' and norms' math): that package is the one place that imports Triton. The device check
every dispatcher makes is :func:`mcore.backends.cuda.device.on_kernel_device`.
"""
