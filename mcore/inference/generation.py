"""Text generation with an mcore GPT at any TP/PP layout: greedy, sampling, beam search, KV cache.

:class:`TextGenerator` wraps this rank's model chunk (one pipeline stage, built with
:func:`mcore.inference.loading.build_model_chunk`). Every rank of the model-parallel group calls
:meth:`TextGenerator.generate` with the same prompts and parameters; each returns the same result.

How one step runs:

* Prompts of different lengths are **left-padded**; each sequence gets its own positions
  (``0..len-1``, padding at position 0) and a key mask that hides its padding, so a batch gives the
  same tokens as each prompt alone.
* With the cache (default) the prompt is run once, then every step feeds one new token per
  sequence: :class:`~mcore.inference.kv_cache.KVCache` holds the keys and values. Without it every
  step reruns the whole sequence (the reference the cache is tested against).
* Tensor parallel: the vocabulary-parallel logits of the last position are gathered over TP.
  Pipeline parallel: stage ``i`` sends its hidden states ``[s, b, h]`` to stage ``i+1``; the last
  stage chooses the tokens (or the beam candidates) and broadcasts them over the pipeline group.
* Logits past the tokenizer's vocabulary (padding rows) are never chosen.
* Sampling draws from a CPU generator seeded with ``seed``: the same seed gives the same tokens on
  every rank and backend (up to the logits' numerics).

Beam search keeps ``num_beams`` beams per prompt; a hypothesis's score is its summed log-probability
divided by ``generated_length ** length_penalty`` (stop token included). A prompt's search ends when
``num_beams`` hypotheses have finished (Hugging Face's ``early_stopping=True``) or at
``max_new_tokens``, when the running beams count as hypotheses; the best one is returned. With one
beam this is greedy decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mcore.distributed.groups import ProcessGroups
from mcore.inference.kv_cache import KVCache
from mcore.tensor_parallel.mappings import gather_from_tensor_model_parallel_region


@dataclass(frozen=True)
class SamplingParams:
    """How to choose tokens.

    Attributes:
        max_new_tokens: tokens to generate at most per prompt.
        greedy: take the most likely token (ignores temperature, top_k and top_p).
        temperature: divides the logits before sampling (> 0).
        top_k: sample among the k most likely tokens (0: all).
        top_p: sample from the smallest set whose probability reaches top_p (1.0: all).
        top_p_decay: after each generated token, ``top_p *= top_p_decay`` (Megatron's; 0: off).
        top_p_bound: the decayed top_p never goes below this (Megatron's; 0: no bound).
        num_beams: beam search with this many beams (> 1; ignores the sampling settings).
        length_penalty: beam score = log-prob / generated_length ** length_penalty.
        stop_token_ids: tokens that end a sequence (kept as its last token).
        stop_at_eod: the tokenizer's end-of-document id ends a sequence too.
        seed: sampling seed.
        use_cache: keep keys/values (one forward position per new token) instead of rerunning.
        return_log_probs: also return each generated token's log-probability under the model
            (``log_softmax`` of the raw fp32 logits, before temperature, top-k and top-p).
        return_logits: also return the raw fp32 logits ``[V]`` of every generated position.
    """

    max_new_tokens: int = 32
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    num_beams: int = 1
    length_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop_at_eod: bool = True
    seed: int = 1234
    use_cache: bool = True
    top_p_decay: float = 0.0
    top_p_bound: float = 0.0
    return_log_probs: bool = False
    return_logits: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 0")
        if not self.greedy and self.num_beams == 1 and self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (use greedy=True for argmax)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.num_beams < 1:
            raise ValueError(f"num_beams={self.num_beams} must be >= 1")
        if not 0.0 <= self.top_p_decay <= 1.0:
            raise ValueError(f"top_p_decay={self.top_p_decay} must be in [0, 1]")
        if not 0.0 <= self.top_p_bound <= 1.0:
            raise ValueError(f"top_p_bound={self.top_p_bound} must be in [0, 1]")
        if self.num_beams > 1 and (self.return_log_probs or self.return_logits):
            raise ValueError("beam search returns each hypothesis's score, not per-token log-probs or logits")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.top_k == 1


@dataclass
class GenerationOutput:
    """What :meth:`TextGenerator.generate` returns, one entry per prompt.

    Attributes:
        tokens: the generated ids (prompt excluded; a stop token that ended the sequence included).
        finish_reasons: ``"stop"`` (a stop token), ``"length"`` (max_new_tokens or the model's
            position limit).
        scores: beam search only: the chosen hypothesis's length-normalized log-probability.
        log_probs: with ``return_log_probs``: each generated token's log-probability.
        logits: with ``return_logits``: the raw logits ``[V]`` of each generated position.
    """

    tokens: list[list[int]]
    finish_reasons: list[str]
    scores: list[float] | None = None
    log_probs: list[list[float]] | None = None
    logits: list[list[list[float]]] | None = None


@dataclass
class _Hypotheses:
    """Finished beam hypotheses of one prompt: ``(score, tokens)``, best first."""

    size: int
    items: list[tuple[float, list[int]]] = field(default_factory=list)

    def add(self, score: float, tokens: list[int]) -> None:
        self.items.append((score, tokens))
        self.items.sort(key=lambda item: -item[0])
        del self.items[self.size :]

    @property
    def full(self) -> bool:
        return len(self.items) >= self.size


class TextGenerator:
    """Generation with one rank's model chunk (see the module docstring).

    Args:
        model: this rank's pipeline stage (a :class:`~mcore.models.gpt.gpt_model.GPTModel` chunk), eval mode.
        groups: the process groups the model was built with.
        vocab_size: the tokenizer's vocabulary size ``V`` (logit columns ``>= V`` are padding).
        eod: the end-of-document id (a stop token with ``stop_at_eod``), or None.
        pad_id: the id written into padding slots (never attended to); default ``eod`` or 0.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        groups: ProcessGroups,
        vocab_size: int,
        eod: int | None = None,
        pad_id: int | None = None,
    ):
        if groups.cp_size > 1:
            raise ValueError(
                f"context_parallel_size={groups.cp_size}: generation does not run with context parallelism; "
                "build the generator with --context-parallel-size 1 (a checkpoint trained with it loads at 1)"
            )
        self.model = model.eval()
        self.groups = groups
        self.vocab_size = vocab_size
        self.eod = eod
        self.pad_id = pad_id if pad_id is not None else (eod if eod is not None else 0)
        config = model.config
        self.hidden_size = config.hidden_size
        self.max_positions = (
            config.max_position_embeddings if config.position_embedding_type == "learned_absolute" else None
        )
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.first = groups.is_first_stage
        self.last = groups.is_last_stage

    def _new_cache(self, capacity: int) -> KVCache:
        """The key/value cache of one ``generate`` call (an encoder-decoder generator keeps more)."""
        return KVCache(capacity)

    # -- one forward step -------------------------------------------------------------------------

    def _forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
    ) -> torch.Tensor | None:
        """Logits ``[b, V]`` (fp32) of the last position on the last stage; None on the others."""
        s, b = tokens.shape[1], tokens.shape[0]
        pp_ranks = self.groups.pp_ranks
        if not self.first:
            hidden = torch.empty(s, b, self.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(hidden, pp_ranks[self.groups.pp_rank - 1], group=self.groups.pp)
            self.model.set_input_tensor(hidden)
        output = self.model(tokens if self.first else None, positions, mask, inference_context=cache)
        if not self.last:
            dist.send(output.contiguous(), pp_ranks[self.groups.pp_rank + 1], group=self.groups.pp)
            return None
        logits = output[:, -1, :]  # [b, Vp/tp]
        if self.groups.tp_size > 1:
            logits = gather_from_tensor_model_parallel_region(logits.contiguous(), self.groups.tp)
        return logits[:, : self.vocab_size].float()

    def _from_last_stage(self, tensor: torch.Tensor | None, shape, dtype) -> torch.Tensor:
        """``tensor`` from the last pipeline stage, on every stage (as a CPU tensor)."""
        if self.groups.pp_size == 1:
            return tensor.cpu()
        buffer = (
            tensor.to(self.device).contiguous()
            if self.last
            else torch.empty(shape, dtype=dtype, device=self.device)
        )
        dist.broadcast(buffer, self.groups.pp_ranks[-1], group=self.groups.pp)
        return buffer.cpu()

    # -- the batch --------------------------------------------------------------------------------

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """One clear error for an empty batch, an empty prompt, an id outside the vocabulary or a
        prompt longer than the model's positions."""
        if not prompts:
            raise ValueError("no prompts to generate from")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; give at least one token")
            bad = [t for t in prompt if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {i} has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
                )
        longest = max(len(p) for p in prompts)
        if self.max_positions is not None and longest > self.max_positions:
            raise ValueError(
                f"a prompt of {longest} tokens exceeds the model's max_position_embeddings={self.max_positions}"
            )

    def _prepare(self, prompts: Sequence[Sequence[int]], rows_per_prompt: int):
        self._check_prompts(prompts)
        lengths = [len(p) for p in prompts for _ in range(rows_per_prompt)]
        longest = max(lengths)
        tokens = torch.full((len(lengths), longest), self.pad_id, dtype=torch.long)
        valid = torch.zeros(len(lengths), longest, dtype=torch.bool)
        row = 0
        for prompt in prompts:
            for _ in range(rows_per_prompt):
                tokens[row, longest - len(prompt) :] = torch.tensor([int(t) for t in prompt])
                valid[row, longest - len(prompt) :] = True
                row += 1
        return tokens, valid

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        stops = {int(t) for t in params.stop_token_ids}
        if params.stop_at_eod and self.eod is not None:
            stops.add(int(self.eod))
        return stops

    def _budget(self, tokens: torch.Tensor, params: SamplingParams) -> int:
        steps = params.max_new_tokens
        if self.max_positions is not None:
            steps = min(steps, self.max_positions - tokens.shape[1])
        return max(steps, 0)

    @torch.no_grad()
    def _step_logits(self, state: _Batch) -> torch.Tensor | None:
        """Logits of the next position of every row (last stage), advancing the cache."""
        new, positions = state.tokens, state.positions
        if state.cache is not None and state.cache.length > 0:  # the cache holds all but the last
            new, positions = new[:, -1:], positions[:, -1:]
        mask = None
        if not bool(state.valid.all()):
            # [b, 1, 1, sk]: True hides a padding key from every query (the op adds causality).
            mask = (~state.valid)[:, None, None, :].to(self.device)
        return self._forward(new.to(self.device), positions.to(self.device), mask, state.cache)

    # -- public API -------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None
    ) -> GenerationOutput:
        """Continue each prompt (a list of token ids); see :class:`SamplingParams` and the module doc."""
        params = params or SamplingParams()
        if params.num_beams > 1:
            return self._beam_search(prompts, params)
        tokens, valid = self._prepare(prompts, 1)
        b = tokens.shape[0]
        steps = self._budget(tokens, params)
        state = _Batch(tokens, valid, self._new_cache(tokens.shape[1] + steps) if params.use_cache else None)
        stops = self._stop_ids(params)
        generator = torch.Generator().manual_seed(params.seed)
        out: list[list[int]] = [[] for _ in range(b)]
        log_probs: list[list[float]] = [[] for _ in range(b)]
        step_logits: list[list[list[float]]] = [[] for _ in range(b)]
        reasons = ["length"] * b
        done = torch.zeros(b, dtype=torch.bool)
        top_p = params.top_p
        for _ in range(steps):
            logits = self._step_logits(state)
            chosen = None if logits is None else self._choose(logits, params, generator, top_p)
            chosen = self._from_last_stage(chosen, (b,), torch.long)
            chosen = torch.where(done, torch.full_like(chosen, self.pad_id), chosen)
            if params.return_log_probs:
                lp = (
                    None if logits is None else torch.log_softmax(logits.cpu(), -1).gather(1, chosen[:, None])
                )
                lp = self._from_last_stage(lp, (b, 1), torch.float32)[:, 0].tolist()
            if params.return_logits:
                full = self._from_last_stage(logits, (b, self.vocab_size), torch.float32).tolist()
            if params.top_p_decay > 0.0:  # Megatron's decay of the nucleus after each token
                top_p = max(top_p * params.top_p_decay, params.top_p_bound)
            for i in range(b):
                if not done[i]:
                    token = int(chosen[i])
                    out[i].append(token)
                    if params.return_log_probs:
                        log_probs[i].append(lp[i])
                    if params.return_logits:
                        step_logits[i].append(full[i])
                    if token in stops:
                        done[i] = True
                        reasons[i] = "stop"
            if bool(done.all()):
                break
            state.append(chosen)
        return GenerationOutput(
            tokens=out,
            finish_reasons=reasons,
            log_probs=log_probs if params.return_log_probs else None,
            logits=step_logits if params.return_logits else None,
        )

    def _choose(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator,
        top_p: float | None = None,
    ) -> torch.Tensor:
        """Next token of each row from fp32 logits ``[b, V]`` (``top_p``: this step's, after decay)."""
        top_p = params.top_p if top_p is None else top_p
        if params.is_greedy:
            return logits.argmax(dim=-1)
        logits = logits.cpu() / params.temperature
        if params.top_k > 0 and params.top_k < logits.shape[-1]:
            kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
            drop = before >= top_p
            drop[:, 0] = False
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)

    def _beam_search(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        k = params.num_beams
        tokens, valid = self._prepare(prompts, k)
        n = len(prompts)
        steps = self._budget(tokens, params)
        state = _Batch(tokens, valid, self._new_cache(tokens.shape[1] + steps) if params.use_cache else None)
        stops = self._stop_ids(params)
        hyps = [_Hypotheses(k) for _ in range(n)]
        done = [False] * n
        scores = torch.full((n, k), float("-inf"), dtype=torch.float64)
        scores[:, 0] = 0.0  # all beams start equal: expand from the first only
        history: list[list[int]] = [[] for _ in range(n * k)]
        width = 2 * k
        for step in range(steps):
            logits = self._step_logits(state)
            cand_scores = cand_ids = None
            if logits is not None:
                logprobs = torch.log_softmax(logits.cpu().double(), dim=-1)  # [n k, V] (fp64: on the host)
                total = (logprobs + scores.view(-1, 1)).view(n, -1)
                cand_scores, cand_ids = torch.topk(total, min(width, total.shape[1]), dim=-1)
            cand_scores = self._from_last_stage(cand_scores, (n, width), torch.float64)
            cand_ids = self._from_last_stage(cand_ids, (n, width), torch.long)
            rows, next_tokens = [], []
            for i in range(n):
                if done[i]:
                    rows.extend(range(i * k, (i + 1) * k))
                    next_tokens.extend([self.pad_id] * k)
                    continue
                kept: list[tuple[int, int, float]] = []
                for rank in range(cand_ids.shape[1]):
                    beam, token = divmod(int(cand_ids[i, rank]), self.vocab_size)
                    score = float(cand_scores[i, rank])
                    if token in stops:
                        if rank < k:
                            generated = history[i * k + beam] + [token]
                            hyps[i].add(score / len(generated) ** params.length_penalty, generated)
                        continue
                    kept.append((beam, token, score))
                    if len(kept) == k:
                        break
                if hyps[i].full or not kept:
                    done[i] = True
                for j in range(k):
                    beam, token, score = kept[j] if j < len(kept) else (0, self.pad_id, float("-inf"))
                    rows.append(i * k + beam)
                    next_tokens.append(token)
                    scores[i, j] = score
            if all(done):
                break
            index = torch.tensor(rows)
            history = [history[r] + [t] for r, t in zip(rows, next_tokens)]
            state.reorder(index)
            if step + 1 < steps:
                state.append(torch.tensor(next_tokens))
        reasons = []
        best_tokens, best_scores = [], []
        for i in range(n):
            finished_by_stop = hyps[i].full
            if not finished_by_stop:
                for j in range(k):
                    if scores[i, j] > float("-inf") and history[i * k + j]:
                        generated = history[i * k + j]
                        hyps[i].add(float(scores[i, j]) / len(generated) ** params.length_penalty, generated)
            if hyps[i].items:
                score, generated = hyps[i].items[0]
            else:
                score, generated = float("-inf"), []
            best_tokens.append(generated)
            best_scores.append(score)
            reasons.append("stop" if generated and generated[-1] in stops else "length")
        return GenerationOutput(tokens=best_tokens, finish_reasons=reasons, scores=best_scores)


class _Batch:
    """Token ids, validity (False = left padding) and positions of every row, plus the cache."""

    def __init__(self, tokens: torch.Tensor, valid: torch.Tensor, cache: KVCache | None):
        self.tokens, self.valid, self.cache = tokens, valid, cache
        self.positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)

    def append(self, new_tokens: torch.Tensor) -> None:
        new_tokens = new_tokens.view(-1, 1).to(self.tokens.dtype)
        self.tokens = torch.cat([self.tokens, new_tokens], dim=1)
        self.positions = torch.cat([self.positions, self.positions[:, -1:] + 1], dim=1)
        self.valid = torch.cat([self.valid, torch.ones_like(self.valid[:, -1:])], dim=1)

    def reorder(self, index: torch.Tensor) -> None:
        self.tokens, self.positions, self.valid = self.tokens[index], self.positions[index], self.valid[index]
        if self.cache is not None:
            self.cache.reorder(index)
