"""What context parallelism refuses, checked once at set-up with messages naming the flags."""

from __future__ import annotations

from mcore.config.fields import ConfigError


def check_context_parallel(
    model,
    parallel,
    *,
    reset_attention_mask: bool = False,
    device_graph_impl: str = "none",
    model_name: str = "GPT",
) -> None:
    """Raise :class:`ConfigError` when ``--context-parallel-size`` > 1 meets what it does not support.

    Args:
        model: the :class:`~mcore.models.transformer.model_config.ModelConfig`.
        parallel: the :class:`~mcore.config.parallel.ParallelConfig`.
        reset_attention_mask: ``--reset-attention-mask`` (a per-document mask).
        device_graph_impl: ``--cuda-graph-impl`` (``"none"``, ``"local"``, ...).
        model_name: the model family (BERT and T5 are refused).
    """
    cp = parallel.context_parallel_size
    if cp == 1:
        return
    errors = []
    if model_name.upper() in ("BERT", "T5"):
        errors.append(f"context_parallel_size={cp}: context parallelism is not built for {model_name}")
    seq, tp = model.seq_length, parallel.tensor_model_parallel_size
    if seq is not None and seq % (2 * cp) != 0:
        errors.append(
            f"seq_length={seq} is not divisible by 2 x context_parallel_size={2 * cp} "
            "(the load-balanced layout cuts each sequence into 2*cp chunks)"
        )
    elif seq is not None and parallel.sequence_parallel and (seq // cp) % tp != 0:
        errors.append(
            f"seq_length={seq} / context_parallel_size={cp} = {seq // cp} is not divisible by "
            f"tensor_model_parallel_size={tp} (--sequence-parallel splits each CP rank's tokens over TP)"
        )
    if parallel.cp_comm_type == "a2a":
        heads = model.num_attention_heads
        if heads % (tp * cp) != 0:
            errors.append(
                f"num_attention_heads={heads} is not divisible by tensor_model_parallel_size={tp} x "
                f"context_parallel_size={cp} (--cp-comm-type a2a splits each TP rank's heads over CP)"
            )
        # GQA: key/value heads not a multiple of cp are repeated to the query heads (ulysses.py).
    if model.attention_dropout > 0.0:
        errors.append(
            f"attention_dropout={model.attention_dropout}: context parallelism needs --attention-dropout 0"
        )
    if model.position_embedding_type in ("alibi", "relative"):
        errors.append(
            f"position_embedding_type={model.position_embedding_type!r} (an additive attention bias) is not "
            f"supported with context_parallel_size={cp}; use rope or learned_absolute"
        )
    if reset_attention_mask:
        errors.append(f"--reset-attention-mask is not supported with context_parallel_size={cp}")
    if device_graph_impl not in (None, "none"):
        errors.append(
            f"--cuda-graph-impl {device_graph_impl}: device graphs cannot capture the context-parallel "
            f"attention's communication (context_parallel_size={cp})"
        )
    if errors:
        raise ConfigError("; ".join(errors))
