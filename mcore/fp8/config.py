"""FP8's one typed config: Megatron-LM's ``--fp8-*`` flags (:class:`Fp8Config`), the scaling recipe
(:class:`Recipe`) and what the FP8 code asks of them (the config's properties).

``--fp8-format e4m3|hybrid`` turns FP8 on for the linear layers of the transformer layers (QKV,
attention projection, MLP fc1/fc2); embeddings, the output layer, norms, attention and the loss stay
in the parameters' dtype, as with Megatron and Transformer Engine. The GEMMs run on the backend's
``scaled_linear`` ops (:mod:`mcore.fp8.linear` has the math); the backend must have the ``fp8``
capability (CUDA on compute capability >= 8.9; the CPU backend emulates it for tests).

The layers get the config itself (a linear of a layer that runs in FP8, :meth:`Fp8Config.layer_in_fp8`)
and read the flags under their own names (``fp8_margin``, ``fp8_wgrad``, ...); the questions several
places ask are properties here (:attr:`Fp8Config.recipe`, :attr:`Fp8Config.per_tensor_fp8_wgrad`,
:attr:`Fp8Config.fuses_producers`, ...), so no code compares recipe names.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mcore.config.fields import check, flag


class Recipe(enum.Enum):
    """The scaling recipes (``--fp8-recipe``; :mod:`mcore.fp8.scaling` describes them)."""

    TENSORWISE = "tensorwise"
    """Current per-tensor scaling: one scale per tensor from its own amax (stateless)."""
    DELAYED = "delayed"
    """Per-tensor scales from an amax history of earlier steps
    (:class:`~mcore.fp8.scaling.Fp8DelayedState`)."""
    ROWWISE = "rowwise"
    """Current per-row scaling of each NT operand (needs the backend's ``fp8_rowwise``)."""

    @property
    def per_tensor(self) -> bool:
        """One scale per tensor (tensorwise, delayed): an operand can be cast once as a whole, its
        transpose written by the same cast, and gathered in FP8."""
        return self is not Recipe.ROWWISE


FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = tuple(r.value for r in Recipe)
AMAX_COMPUTE_ALGOS = ("most_recent", "max")

# Fp8Config.linear_call's builder, registered by mcore.fp8.linear (register_linear_factory): the config
# sits below the linear and its scaling state, and names neither.
_linear_factory: Callable[..., Any] | None = None


def register_linear_factory(factory: Callable[..., Any]) -> None:
    """Set what :meth:`Fp8Config.linear_call` returns: ``factory(config, tp_group, parallel_mode, device)``."""
    global _linear_factory
    _linear_factory = factory


FP8_RECIPE_CHOICES = ("tensorwise", "delayed", "rowwise", "mxfp8", "blockwise")
"""What ``--fp8-recipe`` accepts: Megatron's names plus ``rowwise``; mxfp8/blockwise are refused."""

_REFUSED_RECIPES = {
    "mxfp8": "MXFP8 block scaling needs Blackwell tensor cores (sm_100) and Transformer Engine's MXFP8 "
    "kernels; use --fp8-recipe tensorwise, delayed or rowwise",
    "blockwise": "Transformer Engine's 1x128/128x128 block scaling has no kernel in mcore's op table; "
    "use --fp8-recipe tensorwise, delayed or rowwise",
}


@dataclass(frozen=True, kw_only=True)
class Fp8Config:
    """FP8 linear layers: format, scaling recipe, amax history, and which layers stay in bf16."""

    fp8_format: str | None = flag(
        None,
        "Train the transformer layers' linears in FP8: e4m3 (all tensors e4m3) or hybrid (e4m3 "
        "forward, e5m2 gradients). Off when not given.",
        choices=FP8_FORMATS,
        name="--fp8-format",
    )
    fp8_recipe: str = flag(
        "delayed",
        "Scaling recipe: tensorwise (current per-tensor scaling), delayed (per-tensor scales from an "
        "amax history), rowwise (current per-row scaling; needs the backend's fp8_rowwise).",
        choices=FP8_RECIPE_CHOICES,
    )
    fp8_margin: int = flag(0, "Scales are divided by 2^margin (headroom for growing amaxes).")
    fp8_amax_history_len: int = flag(1, "Steps of amax history for the delayed recipe.")
    fp8_amax_compute_algo: str = flag(
        "most_recent", "Delayed recipe: the scale from the latest amax or the max of the history.",
        choices=AMAX_COMPUTE_ALGOS,
    )  # fmt: skip
    fp8_wgrad: bool = flag(
        True, "Run the weight-gradient GEMM in the activations' dtype, not FP8.", name="--no-fp8-wgrad"
    )
    fp8_fused_producers: bool = flag(
        True,
        "Delayed recipe: run the norm and the MLP activation unfused from the FP8 casts of the next "
        "linear's input (mcore's fused producers are bit-identical and faster; for comparisons).",
        name="--no-fp8-fused-producers",
    )
    fp8_keep_weight_transpose: bool = flag(
        True,
        "Tensorwise/delayed: do not keep each FP8 weight's transpose W_q^T from the forward for the "
        "backward's input gradient (1 byte a weight element held from forward to backward); the "
        "backward casts the weight again with the forward's scale instead (bit-identical; it reads "
        "the weight again, 2 bytes an element, and runs one more kernel a linear; with "
        "--fp8-param-gather it transposes the gathered FP8 weight). Rowwise keeps no transpose.",
        name="--no-fp8-keep-weight-transpose",
    )
    fp8_param_gather: bool = flag(
        False,
        "All-gather the FP8 linears' weights in FP8 (half the bytes of bf16) with "
        "--use-distributed-optimizer; the forward uses the gathered FP8 weight (tensorwise, delayed).",
    )
    first_last_layers_bf16: bool = flag(
        False,
        "Keep the first --num-layers-at-start-in-bf16 and last --num-layers-at-end-in-bf16 transformer "
        "layers in bf16.",
    )
    num_layers_at_start_in_bf16: int = flag(1, "With --first-last-layers-bf16: leading bf16 layers.")
    num_layers_at_end_in_bf16: int = flag(1, "With --first-last-layers-bf16: trailing bf16 layers.")

    def __post_init__(self) -> None:
        check(
            self.fp8_format in (None, *FP8_FORMATS),
            f"--fp8-format {self.fp8_format!r} is unknown; choose one of {', '.join(FP8_FORMATS)}",
        )
        check(
            self.fp8_recipe in FP8_RECIPE_CHOICES,
            f"--fp8-recipe {self.fp8_recipe!r} is unknown; choose one of tensorwise, delayed, rowwise",
        )
        check(
            self.fp8_recipe not in _REFUSED_RECIPES,
            f"--fp8-recipe {self.fp8_recipe} is not supported: {_REFUSED_RECIPES.get(self.fp8_recipe)}",
        )
        check(
            self.fp8_amax_compute_algo in AMAX_COMPUTE_ALGOS,
            f"--fp8-amax-compute-algo {self.fp8_amax_compute_algo!r} is unknown; choose most_recent or max",
        )
        check(
            isinstance(self.fp8_amax_history_len, int) and self.fp8_amax_history_len >= 1,
            f"--fp8-amax-history-len {self.fp8_amax_history_len} must be an integer >= 1",
        )
        check(
            isinstance(self.fp8_margin, int) and self.fp8_margin >= 0,
            f"--fp8-margin {self.fp8_margin} must be an integer >= 0",
        )
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            value = getattr(self, name)
            check(value >= 0, f"--{name.replace('_', '-')} {value} must be >= 0")
        check(
            self.enabled or not self.first_last_layers_bf16,
            "--first-last-layers-bf16 needs --fp8-format e4m3 or hybrid",
        )
        check(
            self.enabled or not self.fp8_param_gather,
            "--fp8-param-gather needs --fp8-format e4m3 or hybrid (it all-gathers the FP8 linears' weights)",
        )
        check(
            not (self.fp8_param_gather and self.recipe is Recipe.ROWWISE),
            "--fp8-param-gather with --fp8-recipe rowwise is not supported (a row-scaled weight would need "
            "its row amaxes reduced before the cast and a transposed copy with other scales for the "
            "backward); use --fp8-recipe tensorwise or delayed",
        )

    @property
    def enabled(self) -> bool:
        return self.fp8_format is not None

    @property
    def recipe(self) -> Recipe:
        """The scaling recipe (``--fp8-recipe``; the refused names never get past construction)."""
        return Recipe(self.fp8_recipe)

    @property
    def fwd_dtype(self) -> torch.dtype:
        """The forward operands' format (inputs and weights): e4m3 in both formats."""
        return torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        """The output gradients' format: e5m2 with ``hybrid``, e4m3 with ``e4m3``."""
        return torch.float8_e5m2 if self.fp8_format == "hybrid" else torch.float8_e4m3fn

    @property
    def per_tensor_fp8_wgrad(self) -> bool:
        """A per-tensor recipe with the FP8 weight gradient. Then an FP8 linear casts its output
        gradient ``dy`` as a whole in every backward, so the gradient of a bias its caller adds
        (``bias_added_by_caller``) comes from that cast's read of ``dy`` (``fp8_cast_dbias``) for free,
        and a sequence-parallel column layer all-gathers its input in FP8. (Rowwise quantizes ``dy``
        per row and per column separately and its scales are per token; ``--no-fp8-wgrad`` casts
        ``dy`` only when the input needs a gradient and its weight gradient needs the bf16 input.)"""
        return self.recipe.per_tensor and self.fp8_wgrad

    @property
    def fuses_producers(self) -> bool:
        """The fused producers may run (:mod:`mcore.fp8.fused`): the delayed recipe (the scales are
        known before the producer runs), FP8 weight gradients (the producer writes ``qT``) and
        ``--no-fp8-fused-producers`` not given."""
        return self.recipe is Recipe.DELAYED and self.fp8_wgrad and self.fp8_fused_producers

    @property
    def overwrites_first_grad(self) -> bool:
        """Whether an FP8 linear writes its weight's first gradient of a step over ``main_grad``
        (:func:`mcore.fp8.linear.fp8_wgrad`; the opt-in of
        :func:`mcore.tensor_parallel.layers.fusion_main_grad`): with the FP8 weight gradient, in eager
        mode (a compiled backward is traced once, with the flag's value at tracing time, so a
        compiled layer always adds into a zeroed ``main_grad``). Read at each forward."""
        return self.fp8_wgrad and not torch.compiler.is_compiling()

    def linear_call(self, tp_group: Any, parallel_mode: str, device=None):
        """A parallel linear's :class:`~mcore.fp8.linear.Fp8Linear` (with a new
        :class:`~mcore.fp8.scaling.Fp8DelayedState` for the delayed recipe). The tensor-parallel
        layers build their FP8 call through this (they import nothing of :mod:`mcore.fp8`, which sits
        above them)."""
        if _linear_factory is None:  # mcore.fp8's __init__ imports mcore.fp8.linear, which registers it
            raise RuntimeError("mcore.fp8.linear is not imported: import mcore.fp8")
        return _linear_factory(self, tp_group, parallel_mode, device)

    def layer_in_fp8(self, layer_number: int, num_layers: int) -> bool:
        """Whether transformer layer ``layer_number`` (1-based, global) runs its linears in FP8."""
        if not self.enabled:
            return False
        if self.first_last_layers_bf16:
            if layer_number <= self.num_layers_at_start_in_bf16:
                return False
            if layer_number > num_layers - self.num_layers_at_end_in_bf16:
                return False
        return True

    def check_with(
        self,
        num_layers: int,
        capabilities: frozenset[str],
        backend_name: str,
        use_distributed_optimizer: bool | None = None,
    ) -> None:
        """Cross-checks against the model depth, the device backend and (when given) the optimizer."""
        check(
            not self.fp8_param_gather or use_distributed_optimizer in (None, True),
            "--fp8-param-gather needs --use-distributed-optimizer (the FP8 weights are what the "
            "distributed optimizer all-gathers after its step)",
        )
        if not self.enabled:
            return
        if self.first_last_layers_bf16:
            bf16 = self.num_layers_at_start_in_bf16 + self.num_layers_at_end_in_bf16
            check(
                bf16 <= num_layers,
                f"--num-layers-at-start-in-bf16 {self.num_layers_at_start_in_bf16} + "
                f"--num-layers-at-end-in-bf16 {self.num_layers_at_end_in_bf16} exceed --num-layers {num_layers}",
            )
        check_fp8_backend(self, capabilities, backend_name)


def check_fp8_backend(fp8: Fp8Config | None, capabilities: frozenset[str], backend_name: str) -> None:
    """Refuse FP8 on a backend without the ``fp8`` capability (rowwise: ``fp8_rowwise``)."""
    if fp8 is None or not fp8.enabled:
        return
    check(
        "fp8" in capabilities,
        f"--fp8-format {fp8.fp8_format}: device backend {backend_name!r} has no 'fp8' capability (FP8 "
        "matrix units: CUDA compute capability >= 8.9, e.g. H100/L40S/RTX 4090); train with --bf16 there",
    )
    if fp8.recipe is Recipe.ROWWISE:
        check(
            "fp8_rowwise" in capabilities,
            f"--fp8-recipe rowwise: device backend {backend_name!r} has no 'fp8_rowwise' capability "
            "(row-scaled FP8 GEMMs need Hopper, compute capability 9.0); use --fp8-recipe tensorwise",
        )
