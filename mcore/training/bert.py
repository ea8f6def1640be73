"""The BERT pieces ``pretrain`` needs: a model provider, a forward step and the loss (Megatron's
pretrain_bert.py).

``examples/pretrain_bert.py`` wires them into :func:`mcore.training.pretrain.pretrain` with
``data_on_every_stage=True`` (every encoder layer needs the batch's padding mask, so every pipeline
stage reads the micro-batch; GPT's middle stages read nothing) and :func:`bert_flops_per_sample`.

The loss of a micro-batch (Megatron's ``loss_func``)::

    lm loss  = sum(lm_loss_per_token * loss_mask) / sum(loss_mask)     masked-LM, over the masked tokens
    sop loss = cross_entropy(binary_logits [b, 2], is_random [b])        sentence order (binary head)
    loss     = lm loss + sop loss                                        (lm loss alone without the head)

logged as ``lm loss`` and ``sop loss``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mcore.distributed.ddp import unwrap_model
from mcore.distributed.groups import ProcessGroups
from mcore.models.transformer.moe.config import refuse_moe
from mcore.models.transformer.mtp.config import refuse_mla_mtp
from mcore.training.cp_batch import refuse_context_parallel
from mcore.training.flops import bert_flops_per_sample
from mcore.training.run_config import RunConfig

__all__ = ["bert_flops_per_sample", "forward_step", "loss_func", "model_provider"]


def model_provider(
    cfg: RunConfig,
    groups: ProcessGroups,
    vocab_size: int,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    layer_offset: int = 0,
    num_layers: int | None = None,
):
    """One BERT chunk: layers ``[layer_offset, layer_offset + num_layers)`` of the encoder, with the
    embedding on the first stage and the LM head, pooler and binary head on the last.

    As Megatron's pretrain_bert.py: the binary (sentence-order) head and two token types, or, with
    ``--bert-no-binary-head``, neither."""
    from mcore.models.bert.bert_model import BertModel

    refuse_context_parallel(groups, "BERT")
    refuse_moe(cfg.model, "BERT")
    refuse_mla_mtp(cfg.model, "BERT")

    return BertModel(
        cfg.model,
        groups,
        vocab_size,
        pre_process=pre_process,
        post_process=post_process,
        layer_offset=layer_offset,
        num_layers=num_layers,
        sequence_parallel=cfg.parallel.sequence_parallel,
        params_dtype=cfg.precision.params_dtype,
        seed=cfg.training.seed,
        add_binary_head=binary_head(cfg),
        fp8=cfg.as_dict().get("fp8"),  # --fp8-format: the encoder layers' linears, as GPT's
    )


def binary_head(cfg: RunConfig) -> bool:
    """Whether the run trains the binary (sentence-order) head: not ``--bert-no-binary-head``."""
    return bool(cfg.model.bert_binary_head)


def loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output_tensor):
    """The micro-batch's loss and its logged parts (see the module docstring).

    Args:
        loss_mask: [b, s], 1 on the masked (predicted) tokens.
        sentence_order: [b] int64, the SOP label (``is_random``; -1 is ignored).
        output_tensor: the last stage's ``(lm_loss_per_token [b, s] fp32, binary_logits [b, 2] | None)``.
    """
    lm_loss_per_token, binary_logits = output_tensor
    losses = lm_loss_per_token.float()
    mask = loss_mask.to(losses.device, torch.float32)
    lm_loss = (losses * mask).sum() / mask.sum().clamp(min=1.0)
    if binary_logits is None:
        return lm_loss, {"lm loss": lm_loss.detach()}
    sop_loss = F.cross_entropy(
        binary_logits.reshape(-1, 2).float(),
        sentence_order.reshape(-1).to(binary_logits.device),
        ignore_index=-1,
    )
    return lm_loss + sop_loss, {"lm loss": lm_loss.detach(), "sop loss": sop_loss.detach()}


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _takes_token_types(model: torch.nn.Module) -> bool:
    """Whether the chunk has a token-type table (two types with the binary head; none with
    ``--bert-no-binary-head``, where Megatron passes ``tokentype_ids=None``)."""
    return getattr(unwrap_model(model), "num_tokentypes", 0) > 0


def forward_step(data_iterator, model: torch.nn.Module):
    """One micro-batch: read it (every stage does: see the module docstring), run the chunk, return
    the output and the loss closure.

    The batch is Megatron's BERT sample (:mod:`mcore.data.bert_dataset`): ``text``, ``types``,
    ``labels`` (-1 where not predicted), ``loss_mask``, ``padding_mask`` (1 = token) [b, s] and
    ``is_random`` [b].
    """
    if data_iterator is None:
        raise RuntimeError(
            "BERT's forward step needs the micro-batch on every pipeline stage (each encoder layer "
            "reads its padding mask): call pretrain(..., data_on_every_stage=True)"
        )
    batch = next(data_iterator)
    device = _model_device(model)
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    types = batch["types"].long() if _takes_token_types(model) else None
    output = model(
        batch["text"].long(),
        batch["padding_mask"].long(),
        tokentype_ids=types,
        lm_labels=batch["labels"].long(),
    )
    return output, functools.partial(loss_func, batch["loss_mask"], batch["is_random"].long())
