"""Pipeline parallelism: layer split over stages, point-to-point exchange, and the schedules.

* :mod:`mcore.pipeline.schedules`: :func:`get_forward_backward_func`, the one selector, and the
  no-pipelining, 1F1B and interleaved 1F1B schedules;
* :mod:`mcore.pipeline.tables`: the pure micro-batch order and lock-step plan of every schedule;
* :mod:`mcore.pipeline.p2p`: batched sends and receives between adjacent stages, with deadlines;
* :mod:`mcore.pipeline.layout`: which layers each (virtual) stage holds, and building model chunks;
* :mod:`mcore.pipeline.encoder_decoder`: an encoder-decoder model (T5) split at
  ``--pipeline-model-parallel-split-rank``, and the tensors its stages exchange.

The tied word embedding's gradients (first and last stage) are summed over ``groups.embedding`` by
:func:`mcore.distributed.finalize.all_reduce_embedding_grads`, part of the ``finalize_grads_func``.
"""

from mcore.pipeline.layout import build_model_chunks, stage_layer_ranges
from mcore.pipeline.p2p import PipelineCommunicationError, PipelineStats
from mcore.pipeline.schedules import (
    ForwardBackwardArgs,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
)
from mcore.pipeline.tables import (
    check_pipeline_schedule,
    pipeline_timeline,
    schedule_table,
    theoretical_bubble_fraction,
)

__all__ = [
    "PipelineCommunicationError",
    "PipelineStats",
    "build_model_chunks",
    "check_pipeline_schedule",
    "ForwardBackwardArgs",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "get_forward_backward_func",
    "pipeline_timeline",
    "schedule_table",
    "stage_layer_ranges",
    "theoretical_bubble_fraction",
]
