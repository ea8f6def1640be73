"""Generation with a T5 encoder-decoder: the encoder runs once, the decoder steps with a key/value cache.

:class:`T5TextGenerator` is :class:`~mcore.inference.generation.TextGenerator` (greedy, sampling
with temperature/top-k/top-p, beam search, stop tokens, the same :class:`SamplingParams`) with three
parts replaced:

* the prompts are the **encoder** inputs: right-padded, with a key mask hiding the padding (so a
  batch gives the same tokens as each prompt alone); the encoder runs once per ``generate`` call
  (once per prompt in beam search: its beams share the output);
* the decoder starts from ``decoder_start_token_id`` (Hugging Face T5: the pad id 0; Megatron's T5
  data: the tokenizer's ``bos``) and stops at ``eod`` (T5's ``</s>``) or the stop tokens;
* the cache is an :class:`~mcore.inference.kv_cache.EncoderDecoderCache`: each decoder layer appends
  its self-attention keys and values, and computes the cross-attention keys and values from the
  encoder output on the first step only. ``use_cache=False`` reruns the whole decoder each step (the
  reference the cache is tested against).

Tensor parallelism works as for GPT (the vocabulary-parallel logits are gathered over TP); pipeline
parallelism is not supported for T5 generation (the whole model runs on each TP rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore.distributed.groups import ProcessGroups
from mcore.inference.generation import TextGenerator
from mcore.inference.kv_cache import EncoderDecoderCache
from mcore.models.t5.t5_model import T5Model
from mcore.tensor_parallel.mappings import gather_from_tensor_model_parallel_region


class T5TextGenerator(TextGenerator):
    """Generation with a whole :class:`~mcore.models.t5.t5_model.T5Model` (eval mode) on each TP rank.

    Args:
        model: the T5 model (encoder and decoder, ``pre_process`` and ``post_process``).
        groups: the process groups it was built with (TP any size, PP 1).
        vocab_size: the tokenizer's vocabulary size ``V`` (logit columns ``>= V`` are padding).
        eod: the end-of-sequence id (a stop token with ``stop_at_eod``), or None.
        pad_id: the id written into the encoder prompts' padding (never attended to); default 0.
        decoder_start_token_id: the decoder's first input token (default 0, Hugging Face T5's).
    """

    def __init__(
        self,
        model: T5Model,
        groups: ProcessGroups,
        vocab_size: int,
        eod: int | None = None,
        pad_id: int | None = None,
        decoder_start_token_id: int = 0,
    ):
        if groups.pp_size > 1:
            raise ValueError(
                f"T5 generation runs the whole model on every rank; pipeline_model_parallel_size="
                f"{groups.pp_size} is not supported (use 1; tensor parallelism works)"
            )
        if not (model.add_encoder and model.add_decoder and model.pre_process and model.post_process):
            raise ValueError(
                "T5 generation needs the whole model (encoder, decoder, embedding, output layer)"
            )
        super().__init__(model, groups, vocab_size, eod=eod, pad_id=0 if pad_id is None else pad_id)
        if not 0 <= decoder_start_token_id < vocab_size:
            raise ValueError(f"decoder_start_token_id={decoder_start_token_id} is outside [0, {vocab_size})")
        self.decoder_start_token_id = decoder_start_token_id
        self._encoder_output: torch.Tensor | None = None
        self._cross_mask: torch.Tensor | None = None

    def _new_cache(self, capacity: int) -> EncoderDecoderCache:
        return EncoderDecoderCache(capacity)

    @torch.no_grad()
    def _prepare(self, prompts: Sequence[Sequence[int]], rows_per_prompt: int):
        """Run the encoder over the right-padded prompts; return the decoder's start batch."""
        self._check_prompts(prompts)
        longest = max(len(p) for p in prompts)
        tokens = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        valid = torch.zeros(len(prompts), longest, dtype=torch.bool)
        for i, prompt in enumerate(prompts):
            tokens[i, : len(prompt)] = torch.tensor([int(t) for t in prompt])
            valid[i, : len(prompt)] = True
        key_mask = None if bool(valid.all()) else (~valid)[:, None, None, :].to(self.device)  # [b, 1, 1, s_e]
        encoded = self.model.encode(tokens.to(self.device), key_mask)  # [s_e, n, h]
        # each prompt's rows (beams) share its encoder output; beam reordering stays within a prompt
        self._encoder_output = encoded.repeat_interleave(rows_per_prompt, dim=1)
        self._cross_mask = None if key_mask is None else key_mask.repeat_interleave(rows_per_prompt, dim=0)
        rows = len(prompts) * rows_per_prompt
        start = torch.full((rows, 1), self.decoder_start_token_id, dtype=torch.long)
        return start, torch.ones(rows, 1, dtype=torch.bool)

    def _forward(self, tokens, positions, mask, cache):
        """Logits ``[b, V]`` (fp32) of the decoder's last position (positions come from the cache length)."""
        hidden = self.model.decode(
            tokens.to(self.device), self._encoder_output, None, self._cross_mask, inference_context=cache
        )
        logits = self.model.lm_head(hidden, self.model.output_weight(), None)[:, -1, :]  # [b, Vp/tp]
        if self.groups.tp_size > 1:
            logits = gather_from_tensor_model_parallel_region(logits.contiguous(), self.groups.tp)
        return logits[:, : self.vocab_size].float()


__all__ = ["T5TextGenerator"]
