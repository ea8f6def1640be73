"""The CUDA backend: NVIDIA GPUs through torch.cuda, NCCL for torch.distributed, fused ops.

Kernels it serves (see :mod:`mcore.backends.cuda.ops`, ``python -m mcore.backends`` lists them):

* Triton (when installed): RMSNorm, LayerNorm, rotary embedding, SwiGLU, bias-GeLU,
  bias-dropout-add and a chunked cross-entropy, forward and backward
  (:mod:`mcore.backends.cuda.triton_kernels`);
* attention through flash-attn when installed, else torch's scaled-dot-product attention;
* the Adam/AdamW step through torch's fused multi-tensor kernel (apex's on request);
* the MoE grouped GEMM through ``torch._grouped_mm`` (bf16), token permute/unpermute through index
  ops without host syncs (:mod:`mcore.backends.cuda.moe`).

Anything a kernel does not support (CPU tensors, unusual shapes or
dtype mixes) run the reference ops. Transformer Engine, apex and flash-attn are optional: detected
(:mod:`mcore.backends.cuda.extensions`), never required. ``compile_layer`` compiles a transformer
layer with torch.compile (capability ``compile_layers``; :mod:`mcore.backends.cuda.compile`).

Nothing here imports Triton or a kernel at import time: this module loads on every machine.
"""

from __future__ import annotations

import torch

from mcore.backend import BackendBase
from mcore.plugins import hookimpl

MCORE_PLUGIN_API_VERSION = "1.2"

# Dense bf16/fp16 tensor-core peaks (FLOP/s) by device-name fragment, for MFU.
_PEAK_BF16 = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "B200": 2250e12,
    "GB200": 2500e12,
}


TRITON_CAPABILITIES = (
    "fused_rms_norm",
    "fused_layer_norm",
    "fused_rotary",
    "fused_swiglu",
    "fused_bias_gelu",
    "fused_bias_dropout_add",
    "fused_cross_entropy",
)
"""Capabilities the Triton kernels add (only where Triton is installed)."""


class _CUDAGraph:
    """``torch.cuda.CUDAGraph`` behind the backend's graph interface (``capture(pool)``, ``replay()``)."""

    def __init__(self):
        self._graph = torch.cuda.CUDAGraph()

    def capture(self, pool=None):
        return torch.cuda.graph(self._graph, pool=pool)

    def replay(self) -> None:
        self._graph.replay()


class CUDABackend(BackendBase):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    priority = 100

    def is_available(self) -> tuple[bool, str]:
        if not torch.cuda.is_available():
            build = torch.version.cuda
            why = "this torch build has no CUDA" if build is None else "no CUDA device is visible"
            return False, why
        return True, f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"

    def capabilities(self) -> frozenset[str]:
        from mcore.backends.cuda import extensions

        caps = {"fp16", "fp32", "flash_attention", "fused_adam", "compile_layers", "device_graphs"}
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            caps.add("bf16")
        if extensions.triton_available():
            caps |= set(TRITON_CAPABILITIES)
        from mcore.backends.cuda.fp8.linear import fp8_capabilities

        caps |= fp8_capabilities()
        from mcore.backends.cuda.grouped_fp8 import grouped_fp8_capabilities

        caps |= grouped_fp8_capabilities()
        # Optional libraries found (informational: code asks for the features above, not for these).
        caps |= {f"lib:{name}" for name, present in extensions.detected().items() if present}
        return frozenset(caps)

    def compile_layer(self, module: torch.nn.Module, **kwargs) -> torch.nn.Module:
        """Compile one transformer layer in place with torch.compile (capability ``compile_layers``)."""
        from mcore.backends.cuda.compile import compile_layer

        return compile_layer(module, **kwargs)

    # --- device graphs (capability ``device_graphs``, used by mcore.models.transformer.layer_graphs) -----------

    def graph(self) -> _CUDAGraph:
        """A CUDA graph: ``with g.capture(pool): ...`` records, ``g.replay()`` launches it again."""
        return _CUDAGraph()

    def graph_pool(self):
        """A memory-pool handle that several captures share (``torch.cuda.graph_pool_handle``)."""
        return torch.cuda.graph_pool_handle()

    def side_stream(self):
        """A context running its work on a fresh stream (warm-up before a capture, as torch advises)."""
        return torch.cuda.stream(torch.cuda.Stream())

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        if not torch.cuda.is_available() or dtype not in (torch.bfloat16, torch.float16):
            return None
        name = torch.cuda.get_device_name()
        return next((peak for key, peak in _PEAK_BF16.items() if key in name), None)

    def register_ops(self, registry) -> None:
        """The fused kernels of :mod:`mcore.backends.cuda.ops` (the Triton ones where Triton is installed)."""
        from mcore.backends.cuda import ops

        for name, fn in ops.CUDA_OPS.items():
            registry.override(name, fn, provider=f"cuda:{ops.PROVIDERS[name]}")


@hookimpl
def mcore_backends():
    return [CUDABackend()]
