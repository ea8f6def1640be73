"""How a job is laid out over devices: tensor, pipeline (with virtual stages), context and data parallel."""

from __future__ import annotations

from dataclasses import dataclass

from mcore.config.fields import ConfigError, check, flag


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Parallel layout and device backend.

    The data-parallel size is not a flag: it is what is left of the world size,
    ``dp = world / (tp * cp * pp)``, computed by :func:`mcore.distributed.topology.Topology.create`.
    """

    tensor_model_parallel_size: int = flag(1, "Degree of tensor model parallelism.")
    pipeline_model_parallel_size: int = flag(1, "Degree of pipeline model parallelism (stages).")
    virtual_pipeline_model_parallel_size: int | None = flag(
        None, "Model chunks per pipeline stage (interleaved 1F1B)."
    )
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        None,
        "Layers in each virtual pipeline chunk; an alternative to --virtual-pipeline-model-parallel-size.",
    )
    decoder_first_pipeline_num_layers: int | None = flag(
        None, "Layers on the first pipeline stage when the split is uneven."
    )
    decoder_last_pipeline_num_layers: int | None = flag(
        None, "Layers on the last pipeline stage when the split is uneven."
    )
    # T5 (encoder-decoder pipelines; :func:`mcore.pipeline.layout.encoder_decoder_stages`)
    pipeline_model_parallel_split_rank: int | None = flag(
        None,
        "Encoder-decoder models: the pipeline stage where the decoder starts (stages before it hold the "
        "encoder).",
    )
    encoder_pipeline_model_parallel_size: int | None = flag(
        None,
        "Encoder-decoder models: pipeline stages of the encoder, added to --pipeline-model-parallel-size "
        "stages of the decoder (Megatron-LM's meaning: the run has both together).",
    )
    context_parallel_size: int = flag(1, "Degree of context parallelism (rank arithmetic only for now).")
    sequence_parallel: bool = flag(False, "Shard activations along the sequence in non-TP regions (TP>1).")
    parallel_order: str = flag(
        "tp-cp-dp-pp",
        "Order in which ranks are assigned to parallel axes, fastest-varying first (Megatron's default).",
    )
    device_backend: str = flag("auto", "Device backend: auto, cpu, cuda, npu or an installed plugin's name.")
    distributed_timeout_minutes: float = flag(10.0, "Timeout for collectives before the job fails.")
    heartbeat_timeout_seconds: float = flag(
        30.0,
        "A rank whose heartbeat (over the rendezvous store, every second) stops for this long is "
        "reported lost and the job ends (mcore.distributed.watchdog); 0 turns the watchdog off.",
    )
    local_rank: int | None = flag(None, "Local rank (set by the launcher; torchrun uses LOCAL_RANK).")
    # -- expert parallelism (MoE; mcore.distributed.topology's expert grid) --
    expert_model_parallel_size: int = flag(
        1, "Degree of expert model parallelism: each rank holds num_experts / this many routed experts."
    )
    expert_tensor_parallel_size: int | None = flag(
        None, "Degree of tensor parallelism inside each expert (default: --tensor-model-parallel-size)."
    )
    # -- end expert parallelism --

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, f"{name}={value} must be a positive integer")
        self._resolve_encoder_pipeline()
        self._check_expert_parallel()
        check(
            not self.sequence_parallel or self.tensor_model_parallel_size > 1,
            f"--sequence-parallel needs tensor_model_parallel_size > 1 "
            f"(got tensor_model_parallel_size={self.tensor_model_parallel_size})",
        )
        if self.context_parallel_size > 1:
            raise ConfigError(
                f"context_parallel_size={self.context_parallel_size}: context parallelism "
                "is not implemented yet; use 1"
            )
        if (
            self.virtual_pipeline_model_parallel_size is not None
            and self.num_layers_per_virtual_pipeline_stage is not None
        ):
            raise ConfigError(
                "give either --virtual-pipeline-model-parallel-size or "
                "--num-layers-per-virtual-pipeline-stage, not both"
            )
        vp = self.virtual_pipeline_model_parallel_size
        if vp is not None:
            check(vp >= 1, f"virtual_pipeline_model_parallel_size={vp} must be >= 1")
            check(
                vp == 1 or self.pipeline_model_parallel_size > 1,
                f"virtual_pipeline_model_parallel_size={vp} needs pipeline_model_parallel_size > 1 "
                f"(got {self.pipeline_model_parallel_size})",
            )
        axes = self.parallel_order.split("-")
        check(
            sorted(axes) == sorted(["tp", "cp", "dp", "pp"]),
            f"parallel_order={self.parallel_order!r} must order exactly tp, cp, dp and pp",
        )

    def _check_expert_parallel(self) -> None:
        """Sizes only; whether etp x ep x pp tiles the world is checked with the world size
        (:meth:`mcore.distributed.topology.Topology.create`), the expert count by the MoE config."""
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_parallel_size
        check(isinstance(ep, int) and ep >= 1, f"expert_model_parallel_size={ep} must be a positive integer")
        check(
            etp is None or (isinstance(etp, int) and etp >= 1),
            f"expert_tensor_parallel_size={etp} must be a positive integer",
        )

    @property
    def expert_tensor_parallel(self) -> int:
        """The resolved expert tensor-parallel size (``None`` means the dense tp size)."""
        etp = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if etp is None else etp

    def _resolve_encoder_pipeline(self) -> None:
        """Fold ``--encoder-pipeline-model-parallel-size E`` into the split rank: ``E`` encoder stages
        before the ``--pipeline-model-parallel-size`` decoder stages, ``E + P`` stages in all (kept as
        ``pipeline_model_parallel_size = E + P``, ``pipeline_model_parallel_split_rank = E``)."""
        encoder_stages, split = (
            self.encoder_pipeline_model_parallel_size,
            self.pipeline_model_parallel_split_rank,
        )
        if encoder_stages is not None and encoder_stages > 0:
            check(
                split is None,
                "give either --pipeline-model-parallel-split-rank or --encoder-pipeline-model-parallel-size, "
                "not both",
            )
            split = encoder_stages
            object.__setattr__(
                self, "pipeline_model_parallel_size", self.pipeline_model_parallel_size + split
            )
            object.__setattr__(self, "pipeline_model_parallel_split_rank", split)
            object.__setattr__(self, "encoder_pipeline_model_parallel_size", None)
        if split is not None:
            pp = self.pipeline_model_parallel_size
            check(
                0 < split < pp,
                f"pipeline_model_parallel_split_rank={split} must lie between 1 and "
                f"pipeline_model_parallel_size - 1 = {pp - 1} (the encoder and the decoder each need a stage)",
            )
            check(
                self.virtual_pipeline_model_parallel_size in (None, 1)
                and self.num_layers_per_virtual_pipeline_stage is None,
                "an encoder-decoder pipeline (--pipeline-model-parallel-split-rank) has no interleaved "
                "schedule: drop --virtual-pipeline-model-parallel-size / --num-layers-per-virtual-pipeline-stage",
            )

    def virtual_stages(self, num_layers: int) -> int:
        """Model chunks per pipeline stage, from either virtual-pipeline flag (1 = no interleaving)."""
        if self.virtual_pipeline_model_parallel_size is not None:
            return self.virtual_pipeline_model_parallel_size
        if self.num_layers_per_virtual_pipeline_stage is not None:
            if (
                self.decoder_first_pipeline_num_layers is not None
                or self.decoder_last_pipeline_num_layers is not None
            ):
                # With uneven first/last stages "layers per chunk" no longer fixes the chunk count.
                raise ConfigError(
                    "--num-layers-per-virtual-pipeline-stage cannot be combined with "
                    "--decoder-first/last-pipeline-num-layers; give --virtual-pipeline-model-parallel-size"
                )
            per_stage, rem = divmod(num_layers, self.pipeline_model_parallel_size)
            per_chunk = self.num_layers_per_virtual_pipeline_stage
            check(
                rem == 0 and per_stage % per_chunk == 0,
                f"num_layers={num_layers} over pipeline_model_parallel_size="
                f"{self.pipeline_model_parallel_size} gives {num_layers / self.pipeline_model_parallel_size:g} "
                f"layers per stage, not a multiple of num_layers_per_virtual_pipeline_stage={per_chunk}",
            )
            return per_stage // per_chunk
        return 1
