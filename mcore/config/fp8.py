"""FP8 training flags (Megatron-LM's ``--fp8-*`` transformer-engine flags), for mcore's own FP8 linears.

``--fp8-format e4m3|hybrid`` turns FP8 on for the linear layers of the transformer layers (QKV,
attention projection, MLP fc1/fc2); embeddings, the output layer, norms, attention and the loss stay
in the parameters' dtype, as with Megatron and Transformer Engine. The GEMMs run on the backend's
``scaled_linear`` ops (:mod:`mcore.tensor_parallel.fp8` has the math); the backend must have the
``fp8`` capability (CUDA on compute capability >= 8.9; the CPU backend emulates it for tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore.config.fields import check, flag

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed", "rowwise")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")


@dataclass(frozen=True)
class Fp8Recipe:
    """How one linear layer quantizes (built from :class:`mcore.config.fp8.Fp8Config`).

    Attributes:
        format: ``e4m3`` (every tensor e4m3) or ``hybrid`` (e4m3 forward, e5m2 output gradients).
        recipe: ``tensorwise``, ``delayed`` or ``rowwise`` (see the module docstring).
        margin: scales are divided by ``2**margin`` (headroom for amax growth).
        amax_history_len, amax_compute_algo: the delayed recipe's history.
        wgrad: the weight-gradient GEMM in FP8 (``--no-fp8-wgrad``: in the activations' dtype).
        fused_producers: with the delayed recipe and FP8 weight gradients, the norm before QKV/fc1
            and the MLP activation write the FP8 GEMM inputs themselves
            (:mod:`mcore.tensor_parallel.fp8_fused`; bit-identical to the unfused path).
            ``--no-fp8-fused-producers`` runs the unfused path.
        keep_weight_transpose: the tensorwise and delayed recipes' forward cast of a weight also
            writes ``W_q^T`` and keeps it for the input gradient (1 byte a weight element held from
            forward to backward); ``--no-fp8-keep-weight-transpose`` casts ``W_q`` only and the
            backward casts ``W^T`` again with the forward's scale (bit-identical; a second read of
            the weight, 2 bytes an element, and one more kernel a linear).
    """

    format: str = "hybrid"
    recipe: str = "tensorwise"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True
    fused_producers: bool = True
    keep_weight_transpose: bool = True

    def __post_init__(self):
        if self.format not in FP8_FORMATS:
            raise ValueError(f"fp8 format {self.format!r} is unknown; choose one of {', '.join(FP8_FORMATS)}")
        if self.recipe not in FP8_RECIPES:
            raise ValueError(f"fp8 recipe {self.recipe!r} is unknown; choose one of {', '.join(FP8_RECIPES)}")

    @property
    def fwd_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn


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
            not (self.fp8_param_gather and self.fp8_recipe == "rowwise"),
            "--fp8-param-gather with --fp8-recipe rowwise is not supported (a row-scaled weight would need "
            "its row amaxes reduced before the cast and a transposed copy with other scales for the "
            "backward); use --fp8-recipe tensorwise or delayed",
        )

    @property
    def enabled(self) -> bool:
        return self.fp8_format is not None

    def recipe(self) -> Fp8Recipe | None:
        """The layers' :class:`Fp8Recipe`, or None when FP8 is off."""
        if not self.enabled:
            return None
        return Fp8Recipe(
            format=self.fp8_format,
            recipe=self.fp8_recipe,
            margin=self.fp8_margin,
            amax_history_len=self.fp8_amax_history_len,
            amax_compute_algo=self.fp8_amax_compute_algo,
            wgrad=self.fp8_wgrad,
            fused_producers=self.fp8_fused_producers,
            keep_weight_transpose=self.fp8_keep_weight_transpose,
        )

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
        check_fp8_backend(self.recipe(), capabilities, backend_name)


def check_fp8_backend(recipe: Fp8Recipe | None, capabilities: frozenset[str], backend_name: str) -> None:
    """Refuse FP8 on a backend without the ``fp8`` capability (rowwise: ``fp8_rowwise``)."""
    if recipe is None:
        return
    check(
        "fp8" in capabilities,
        f"--fp8-format {recipe.format}: device backend {backend_name!r} has no 'fp8' capability (FP8 "
        "matrix units: CUDA compute capability >= 8.9, e.g. H100/L40S/RTX 4090); train with --bf16 there",
    )
    if recipe.recipe == "rowwise":
        check(
            "fp8_rowwise" in capabilities,
            f"--fp8-recipe rowwise: device backend {backend_name!r} has no 'fp8_rowwise' capability "
            "(row-scaled FP8 GEMMs need Hopper, compute capability 9.0); use --fp8-recipe tensorwise",
        )
