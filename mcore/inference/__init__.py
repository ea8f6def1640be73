"""Text generation: greedy, sampling (temperature, top-k, top-p), beam search, with a key/value cache,
at any tensor/pipeline-parallel layout.

Command: ``python -m mcore.inference.generate --load CKPT --prompt TEXT ...`` (see
:mod:`mcore.inference.generate`). Library: build this rank's model chunk with
:func:`build_model_chunk` (from a logical state, e.g. :func:`mcore.checkpoint.load_logical_model_state`),
wrap it in :class:`TextGenerator`, call :meth:`TextGenerator.generate` with token-id prompts and
:class:`SamplingParams`. A T5 checkpoint generates through :class:`T5TextGenerator` (encoder once,
decoder with :class:`EncoderDecoderCache`).
"""

from mcore.inference.generation import GenerationOutput, SamplingParams, TextGenerator
from mcore.inference.kv_cache import EncoderDecoderCache, KVCache
from mcore.inference.loading import (
    build_model_chunk,
    gather_logical_state,
    load_logical_state,
    model_config_from_run_config,
    tokenizer_config_from_run_config,
)
from mcore.inference.t5_generation import T5TextGenerator

__all__ = [
    "EncoderDecoderCache",
    "GenerationOutput",
    "KVCache",
    "SamplingParams",
    "T5TextGenerator",
    "TextGenerator",
    "build_model_chunk",
    "gather_logical_state",
    "load_logical_state",
    "model_config_from_run_config",
    "tokenizer_config_from_run_config",
]
