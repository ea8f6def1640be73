"""THE NPU patch table: every change the NPU adaptor makes to mcore, as data, in one place.

Each row is technical debt with an exit: it says why it exists and which hook would retire it.
Most of what MindSpeed patches into Megatron needs no row here, because mcore has a seam for it:

==========================================  ===================================================
MindSpeed patches                           mcore uses instead
==========================================  ===================================================
RMSNorm / RoPE / SwiGLU / FA ops            the op table (``NPUBackend.register_ops``,
                                            :mod:`mcore.backends.npu.ops`)
``_set_cuda_rng_state``, CUDA RNG tracker   the backend's ``get/set_rng_state`` (``torch.npu``)
``get_nccl_options`` (HCCL group buffers)   ``NPUBackend.process_group_options``
apex FusedAdam -> NPU AdamW                 the ``adam_step`` op (``npu_apply_adam_w``)
``transfer_to_npu`` (cuda -> npu strings)   nothing: the core never names a device vendor
bf16 on 910A, feature checks                ``NPUBackend.configure`` (a ConfigError)
HCCL timeouts (MindSpeed CI exports them)   ``NPUBackend.configure``, which ``pretrain`` calls after
                                            selecting the backend and before torch.distributed
                                            starts (:func:`mcore.backends.npu.hccl.hccl_env_defaults`)
==========================================  ===================================================

Rows are applied in order (see :mod:`mcore.adaptors.patching` for the rules: everything is
resolved and checked before anything changes, a moved target fails naming its row).
"""

from __future__ import annotations

from mcore.adaptors.patching import Kind, Patch
from mcore.backends.npu.backend import import_torch_npu


def _has_fusion_attention() -> bool:
    return hasattr(import_torch_npu(), "npu_fusion_attention")


PATCHES: tuple[Patch, ...] = (
    # CANN fused attention's layout: cannot be an op override, the permutes happen outside the op.
    Patch(
        target="mcore.models.transformer.attention.CoreAttention.forward",
        replacement="mcore.adaptors.npu.impl.attention.fused_sbh_core_attention",
        kind=Kind.WRAP,
        when=_has_fusion_attention,
        reason=(
            "npu_fusion_attention takes the projections' [s, b, n*d] as layout 'SBH'; the core's forward "
            "permutes to the op table's [b, n, s, d] and copies the result back, which the op override "
            "cannot undo. The wrap feeds SBH directly, uses the compressed causal mask (sparse_mode=2) "
            "and merges an explicit mask once per forward; other inputs run the core forward. Retire when "
            "the op table gains a sequence-first attention op."
        ),
    ),
    # A core function that needs an NPU variant: HCCL cannot carry fp64.
    Patch(
        target="mcore.inference.generation.TextGenerator._from_last_stage",
        replacement="mcore.adaptors.npu.impl.generation.fp64_as_int32_pairs",
        kind=Kind.WRAP,
        reason=(
            "beam search broadcasts its fp64 scores from the last pipeline stage and HCCL has no fp64; "
            "the wrap sends the exact bits as int32 pairs (a cast to fp32 could change which beams win). "
            "No hook sees this tensor; retire when the core keeps collectives to HCCL's dtypes or the "
            "backend object gains a dtype-support query."
        ),
    ),
)
"""Applied by :func:`mcore.adaptors.npu.activate`, in this order."""
