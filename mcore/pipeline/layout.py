"""Which transformer layers each pipeline stage (and each of its virtual chunks) holds.

Layers are dealt out in virtual-stage order: virtual stage ``s = chunk * p + rank`` holds the
``s``-th slice. Worked example, 8 layers, ``p=2, v=2`` (two layers per chunk)::

    rank 0: chunk 0 = layers 0-1, chunk 1 = layers 4-5
    rank 1: chunk 0 = layers 2-3, chunk 1 = layers 6-7

With ``decoder_first_pipeline_num_layers=a`` / ``decoder_last_pipeline_num_layers=b`` the first / last
stage hold ``a`` / ``b`` layers and the stages between share the rest evenly; under virtual
pipelining each stage's layers are split evenly over its chunks (Megatron's rule), e.g. 10 layers,
``p=4``, first 1, last 3: stages hold 1, 3, 3, 3 layers.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from mcore.config.fields import ConfigError, check


def stage_layer_counts(
    num_layers: int,
    pp_size: int,
    *,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[int]:
    """Layers on each pipeline stage (before splitting into virtual chunks)."""
    check(num_layers >= 1, f"num_layers={num_layers} must be >= 1")
    check(pp_size >= 1, f"pipeline_model_parallel_size={pp_size} must be >= 1")
    if first_stage_layers is None and last_stage_layers is None:
        check(
            num_layers % pp_size == 0,
            f"num_layers={num_layers} is not divisible by pipeline_model_parallel_size={pp_size}; "
            "change one, or set --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers",
        )
        return [num_layers // pp_size] * pp_size
    check(
        pp_size > 1,
        "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers need "
        f"pipeline_model_parallel_size > 1 (got {pp_size})",
    )
    given = {"decoder_first_pipeline_num_layers": first_stage_layers}
    given["decoder_last_pipeline_num_layers"] = last_stage_layers
    for name, value in given.items():
        check(
            value is None or 1 <= value <= num_layers, f"{name}={value} must be in 1..num_layers={num_layers}"
        )
    first, last = first_stage_layers or 0, last_stage_layers or 0
    middle_stages = pp_size - (first_stage_layers is not None) - (last_stage_layers is not None)
    rest = num_layers - first - last
    named = ", ".join(f"{k}={v}" for k, v in given.items() if v is not None)
    if middle_stages == 0:
        check(
            rest == 0,
            f"{named} must add up to num_layers={num_layers} with pipeline_model_parallel_size={pp_size} "
            "(there are no stages in between)",
        )
    else:
        check(
            rest >= middle_stages and rest % middle_stages == 0,
            f"num_layers={num_layers} minus {named} leaves {rest} layers, which do not divide evenly "
            f"(at least one each) over the {middle_stages} remaining pipeline stage(s) of "
            f"pipeline_model_parallel_size={pp_size}",
        )
    per_middle = rest // middle_stages if middle_stages else 0
    counts = [per_middle] * pp_size
    if first_stage_layers is not None:
        counts[0] = first
    if last_stage_layers is not None:
        counts[-1] = last
    return counts


def stage_layer_ranges(
    num_layers: int,
    pp_size: int,
    vp_size: int = 1,
    *,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[list[range]]:
    """Global layer indices held by each stage and chunk: ``ranges[pp_rank][chunk]``.

    Raises:
        ConfigError: the layers do not divide over the stages and chunks (the message names the
            numbers).
    """
    counts = stage_layer_counts(
        num_layers, pp_size, first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers
    )
    check(vp_size >= 1, f"virtual_pipeline_model_parallel_size={vp_size} must be >= 1")
    for rank, count in enumerate(counts):
        if count % vp_size or count < vp_size:
            raise ConfigError(
                f"pipeline stage {rank} holds {count} layers (num_layers={num_layers}, "
                f"pipeline_model_parallel_size={pp_size}), which do not split into "
                f"virtual_pipeline_model_parallel_size={vp_size} chunks of at least one layer each"
            )
    ranges: list[list[range]] = [[] for _ in range(pp_size)]
    offset = 0
    for _chunk in range(vp_size):  # virtual stage order: chunk-major
        for rank in range(pp_size):
            size = counts[rank] // vp_size
            ranges[rank].append(range(offset, offset + size))
            offset += size
    return ranges


def build_model_chunks(
    model_provider: Callable[..., nn.Module], groups, parallel_config, num_layers: int
) -> list[nn.Module]:
    """Build this rank's model chunks, one per virtual stage.

    Calls ``model_provider(pre_process=..., post_process=..., layer_offset=..., num_layers=...)`` for
    each chunk: ``pre_process`` (embedding) on the first virtual stage, ``post_process`` (final norm,
    output layer, loss) on the last, and the chunk's slice of global layers from
    :func:`stage_layer_ranges`.

    Args:
        model_provider: builds one chunk.
        groups: the job's process groups (this rank's ``pp_rank``).
        parallel_config: a :class:`~mcore.config.parallel.ParallelConfig`.
        num_layers: transformer layers of the whole model.
    """
    pp_size = parallel_config.pipeline_model_parallel_size
    check(
        groups.pp_size == pp_size,
        f"process groups have pipeline size {groups.pp_size} but pipeline_model_parallel_size={pp_size}",
    )
    vp_size = parallel_config.virtual_stages(num_layers)
    ranges = stage_layer_ranges(
        num_layers,
        pp_size,
        vp_size,
        first_stage_layers=parallel_config.decoder_first_pipeline_num_layers,
        last_stage_layers=parallel_config.decoder_last_pipeline_num_layers,
    )
    chunks = []
    for chunk, layers in enumerate(ranges[groups.pp_rank]):
        chunks.append(
            model_provider(
                pre_process=chunk == 0 and groups.is_first_stage,
                post_process=chunk == vp_size - 1 and groups.is_last_stage,
                layer_offset=layers.start,
                num_layers=len(layers),
            )
        )
    return chunks
