"""A run under which no token contributes to the loss is refused at its first step, not trained for hours.

GPT with ``--eod-mask-loss`` on data of only end-of-document tokens (or any loss mask that zeroes every
position of a batch) gives a loss of exactly 0 and a gradient of exactly 0 for every parameter: every step
"succeeds", the log shows ``lm loss: 0.000000E+00 | grad norm: 0.000``, and the run exits 0 having learnt
nothing. The global gradient norm is the cheap witness: the optimizer computes it over every rank anyway
(it is the clipping norm), and it is exactly 0 only when no loss term reached any parameter. It is read
once, at the first step of a run (one wait for the device).

Left to other checks: a loss scale (fp16) whose scaled gradients underflow to 0 (the optimizer's
``LossScaleUnderflowError`` names the scale); BERT/T5 configurations where no token can be masked
(refused when the dataset is built). Not refused, because they are legitimate: ``--lr 0`` (the loss is
real, the weights stay: a measurement), ``--train-iters 0`` or ``--skip-train`` (evaluation only).
"""

from __future__ import annotations

import torch

from mcore.data.errors import DataError


def data_named(data) -> str:
    """The flag and value that gave the training data (``data``: :class:`~mcore.data.config.DataConfig`)."""
    if data.mock_data:
        return "--mock-data"
    if data.data_path:
        return f"--data-path {' '.join(data.data_path)}"
    if data.train_data_path:
        return f"--train-data-path {' '.join(data.train_data_path)}"
    return "the datasets provider's data"


def check_first_step_trains(grad_norm, cfg, iteration: int) -> None:
    """Raise :class:`DataError` when the global gradient norm of a step is exactly 0 without a loss
    scale: no token of the global batch contributed to the loss, so nothing can train.

    ``grad_norm``: the optimizer's global norm (a float, a 0-d tensor, or None when clipping is off
    and it is not computed: then nothing is checked); ``cfg``: the :class:`RunConfig`."""
    if grad_norm is None:
        return
    norm = float(grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm)
    if norm != 0.0:
        return
    data = data_named(cfg.data)
    seq = cfg.model.seq_length
    head = (
        f"iteration {iteration}: no token of the global batch contributes to the loss (the gradient of "
        "every parameter is exactly 0 on every rank), so nothing can train"
    )
    if getattr(cfg.model, "init_method_std", None) == 0.0:
        why = "--init-method-std 0 starts every weight at 0, where every gradient is 0: give it a positive value"
    elif cfg.data.eod_mask_loss:
        why = (
            f"--eod-mask-loss gives no loss to end-of-document tokens, and every input token of the "
            f"batch from {data} at --seq-length {seq} is one: is the data made of empty documents? "
            "Give data with text between the end-of-document tokens, or drop --eod-mask-loss"
        )
    else:
        why = f"every loss-mask entry of the batch from {data} at --seq-length {seq} is 0: check the data"
    raise DataError(f"{head}: {why}")
