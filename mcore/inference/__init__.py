"""Text generation: greedy, sampling (temperature, top-k, top-p), beam search, with a key/value cache,
at any tensor/pipeline-parallel layout.

Command: ``python -m mcore.inference.generate --load CKPT --prompt TEXT ...`` (see
:mod:`mcore.inference.generate`). Library: build this rank's model chunk with
:func:`build_model_chunk` (from a logical state, e.g. :func:`mcore.checkpoint.load_logical_model_state`),
wrap it in :class:`TextGenerator`, call :meth:`TextGenerator.generate` with token-id prompts and
:class:`SamplingParams`.
"""

from mcore.inference.generation import GenerationOutput, SamplingParams, TextGenerator
from mcore.inference.kv_cache import KVCache
from mcore.inference.loading import (
    build_model_chunk,
    gather_logical_state,
    load_logical_state,
    model_config_from_run_config,
    tokenizer_config_from_run_config,
)

__all__ = [
    "GenerationOutput",
    "KVCache",
    "SamplingParams",
    "TextGenerator",
    "build_model_chunk",
    "gather_logical_state",
    "load_logical_state",
    "model_config_from_run_config",
    "tokenizer_config_from_run_config",
]
