"""``python -m mcore.inference.generate``: generate text from an mcore checkpoint, at any TP/PP layout.

One process::

    python -m mcore.inference.generate --load CKPT --prompt "Once upon a time" "The meaning of" \\
        --max-new-tokens 32 --greedy

Tensor / pipeline parallel (every rank loads its own shards; rank 0 prints)::

    torchrun --nproc_per_node 4 -m mcore.inference.generate --load CKPT --prompt "Hello" \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --top-k 40 --top-p 0.9 --seed 7

Sampling (``--temperature``, ``--top-k``, ``--top-p`` with Megatron's ``--top-p-decay`` and
``--top-p-bound``, ``--seed``), ``--greedy``, beam search (``--num-beams``, ``--length-penalty``), ``--stop-token-ids`` (plus the tokenizer's end-of-document
id unless ``--no-stop-at-eod``), ``--no-kv-cache``. The checkpoint may come from any layout
(:func:`mcore.checkpoint.load_logical_model_state`); its run config gives the model and tokenizer
(override the tokenizer's files with the usual ``--tokenizer-type``/``--vocab-file``/... flags).
``--prompt-ids "1 2 3"`` gives token ids directly; ``--add-BOS`` puts the tokenizer's end-of-document
id before every prompt (Megatron's ``add_BOS``). ``--output-json FILE`` writes every result, with each
generated token's log-probability (``--return-output-log-probs``) and logits (``--return-logits``).

A T5 checkpoint (encoder layers in it) generates with the whole model on every rank (any TP size,
pipeline size 1): each prompt goes through the encoder once, and the decoder starts from the
tokenizer's ``bos`` (Megatron's T5 data) or pad id (Hugging Face T5) (:mod:`mcore.inference.t5_generation`).

Settings that would be silently ignored are refused: ``--greedy`` with ``--temperature``/``--top-k``/
``--top-p``, beam search with ``--top-k``/``--top-p``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from mcore.config.cli import parse_config
from mcore.config.fields import ConfigError, check, flag
from mcore.config.parallel import ParallelConfig
from mcore.data.config import TokenizerConfig
from mcore.data.errors import DataError
from mcore.data.tokenizers import Tokenizer, build_tokenizer
from mcore.inference.generation import GenerationOutput, SamplingParams, TextGenerator
from mcore.inference.loading import (
    build_model_chunk,
    model_config_from_run_config,
    tokenizer_config_from_run_config,
)
from mcore.inference.t5_generation import T5TextGenerator
from mcore.utils.outputs import check_writable, write_text_atomic


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """What to generate from which checkpoint, and how tokens are chosen."""

    load: str | None = flag(None, "Checkpoint directory (saved at any TP/PP layout).")
    ckpt_step: int | None = flag(None, "Iteration to load (default: the latest).")
    prompt: tuple[str, ...] = flag((), "Prompt texts (one generation each, batched).", nargs="+")
    prompt_ids: tuple[str, ...] = flag((), "Prompts as whitespace-separated token ids.", nargs="+")
    max_new_tokens: int = flag(32, "Tokens to generate at most per prompt.")
    greedy: bool = flag(False, "Take the most likely token each step.")
    temperature: float = flag(1.0, "Sampling temperature.")
    top_k: int = flag(0, "Sample among the k most likely tokens (0: all).")
    top_p: float = flag(1.0, "Nucleus sampling: the smallest set with this much probability.")
    top_p_decay: float = flag(0.0, "Multiply top-p by this after each generated token (0: off).")
    top_p_bound: float = flag(0.0, "Lower bound of the decayed top-p (0: none).")
    add_bos: bool = flag(
        False,
        "Put the tokenizer's end-of-document id before each prompt.",
        name="--add-BOS",
        aliases=("--add-bos",),
    )
    return_output_log_probs: bool = flag(
        False, "Write each generated token's log-probability to --output-json (output_log_probs)."
    )
    return_logits: bool = flag(
        False, "Write the raw logits of each generated position to --output-json (logits; V floats each)."
    )
    num_beams: int = flag(1, "Beam search with this many beams.")
    length_penalty: float = flag(1.0, "Beam score = log-prob / generated_length ** length_penalty.")
    stop_token_ids: tuple[int, ...] = flag((), "Token ids that end a sequence.", nargs="+")
    stop_at_eod: bool = flag(True, "Do not stop at the end-of-document token.", name="--no-stop-at-eod")
    seed: int = flag(1234, "Sampling seed.")
    use_kv_cache: bool = flag(True, "Rerun the whole sequence every step.", name="--no-kv-cache")
    bf16: bool = flag(False, "Run the model in bfloat16.")
    fp16: bool = flag(False, "Run the model in float16.")
    output_json: str | None = flag(None, "Write prompts, ids, texts and finish reasons to this file.")

    def __post_init__(self) -> None:
        check(self.load is not None, "--load CKPT_DIR is required")
        check(bool(self.prompt or self.prompt_ids), "give --prompt TEXT ... or --prompt-ids 'ID ID ...' ...")
        check(not (self.bf16 and self.fp16), "give --bf16 or --fp16, not both")
        sampling_flags = [
            name
            for name, given in (
                ("--temperature", self.temperature != 1.0),
                ("--top-k", self.top_k != 0),
                ("--top-p", self.top_p != 1.0),
                ("--top-p-decay", self.top_p_decay != 0.0),
                ("--top-p-bound", self.top_p_bound != 0.0),
            )
            if given
        ]
        check(
            not (self.greedy and sampling_flags),
            f"--greedy takes the most likely token; {', '.join(sampling_flags)} only apply to sampling: "
            "drop one or the other",
        )
        beam_conflicts = [
            f for f in sampling_flags if f in ("--top-k", "--top-p", "--top-p-decay", "--top-p-bound")
        ]
        check(
            not (self.num_beams > 1 and beam_conflicts),
            f"--num-beams {self.num_beams} (beam search) does not sample: drop {', '.join(beam_conflicts)}",
        )
        check(
            self.greedy or self.num_beams > 1 or self.temperature > 0,
            f"--temperature {self.temperature}: must be > 0 (use --greedy for the most likely token)",
        )
        check(
            not (self.num_beams > 1 and (self.return_output_log_probs or self.return_logits)),
            "--return-output-log-probs/--return-logits: beam search reports each result's score instead",
        )

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            greedy=self.greedy,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            num_beams=self.num_beams,
            length_penalty=self.length_penalty,
            stop_token_ids=tuple(self.stop_token_ids),
            stop_at_eod=self.stop_at_eod,
            seed=self.seed,
            use_cache=self.use_kv_cache,
            top_p_decay=self.top_p_decay,
            top_p_bound=self.top_p_bound,
            return_log_probs=self.return_output_log_probs,
            return_logits=self.return_logits,
        )

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


GROUPS = {"generation": GenerateConfig, "parallel": ParallelConfig, "tokenizer": TokenizerConfig}


def load_generator(
    load: str,
    groups,
    *,
    iteration: int | None = None,
    tokenizer_config: TokenizerConfig | None = None,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> tuple[TextGenerator, Tokenizer | None]:
    """This rank's :class:`TextGenerator` (and the tokenizer) for the checkpoint in ``load``.

    A collective over all ranks: each builds its stage of the model for the current TP/PP layout and
    reads only its own shards (:func:`mcore.checkpoint.load_checkpoint` with ``--finetune``
    semantics), whatever layout the checkpoint was saved at.
    """
    from mcore.checkpoint import CheckpointConfig, CheckpointError, load_checkpoint, resolve_iteration_dir
    from mcore.checkpoint.format import no_checkpoint_message
    from mcore.checkpoint.megatron.detect import read_any_metadata

    path = resolve_iteration_dir(load, iteration)
    if path is None:
        raise CheckpointError(no_checkpoint_message(load))
    metadata = read_any_metadata(path)  # mcore's, or a Megatron-LM torch / torch_dist checkpoint
    run_config = metadata.get("run_config") or {}
    cfg = model_config_from_run_config(run_config)
    tok_config = tokenizer_config or tokenizer_config_from_run_config(run_config)
    tokenizer = build_tokenizer(tok_config) if tok_config is not None else None
    vocab_size = (metadata.get("extra") or {}).get("tokenizer_vocab_size") or (
        metadata.get("megatron") or {}
    ).get("vocab_size")
    if tokenizer is not None:
        vocab_size = tokenizer.vocab_size
    if vocab_size is None:
        raise ConfigError(
            f"{load}: the checkpoint names no tokenizer and no vocabulary size; give --tokenizer-type"
        )
    t5 = any(str(rec.get("name", "")).startswith("encoder.layers.") for rec in metadata.get("records", ()))
    if t5:  # an encoder-decoder checkpoint: the whole T5 on every rank (mcore.inference.t5_generation)
        model = build_t5_model(cfg, groups, int(vocab_size), device=device, params_dtype=params_dtype)
    else:
        model = build_model_chunk(cfg, groups, int(vocab_size), device=device, params_dtype=params_dtype)
    weights_only = CheckpointConfig(
        load=str(load), ckpt_step=int(metadata["iteration"]), no_load_optim=True, no_load_rng=True
    )
    load_checkpoint(weights_only, [model], None, None, groups)
    eod = tokenizer.eod if tokenizer is not None else None
    if t5:
        # Megatron's T5 data starts the decoder with the tokenizer's bos; Hugging Face T5 with pad (0)
        start = getattr(tokenizer, "bos", None) if tokenizer is not None else None
        pad = getattr(tokenizer, "pad", None) if tokenizer is not None else None
        generator = T5TextGenerator(
            model.eval(),
            groups,
            int(vocab_size),
            eod=eod,
            pad_id=pad,
            decoder_start_token_id=start or pad or 0,
        )
        return generator, tokenizer
    return TextGenerator(model.eval(), groups, int(vocab_size), eod=eod), tokenizer


def build_t5_model(cfg, groups, vocab_size: int, *, device=None, params_dtype=torch.float32):
    """The whole :class:`~mcore.models.t5.t5_model.T5Model` for generation (TP any size; PP 1)."""
    from mcore.models.t5.t5_model import T5Model
    from mcore.models.transformer.model_config import padded_vocab_size

    check(
        groups.pp_size == 1,
        f"T5 generation runs the whole model on every rank: use --pipeline-model-parallel-size 1 "
        f"(got {groups.pp_size})",
    )
    padded = padded_vocab_size(vocab_size, cfg.make_vocab_size_divisible_by, groups.tp_size)
    return T5Model(cfg, groups, padded, device=device, params_dtype=params_dtype).eval()


def encode_prompts(
    tokenizer: Tokenizer | None, texts: Sequence[str], ids: Sequence[str], add_bos: bool = False
) -> list[list[int]]:
    """Token ids of every prompt (``--prompt-ids`` first); ``add_bos`` puts the end-of-document id first."""
    prompts = [[int(t) for t in line.split()] for line in ids]
    if texts:
        if tokenizer is None:
            raise ConfigError("--prompt needs a tokenizer; give --prompt-ids or --tokenizer-type")
        prompts += tokenizer.tokenize_batch(list(texts))
    if add_bos:
        if tokenizer is None or tokenizer.eod is None:
            raise ConfigError("--add-BOS needs a tokenizer with an end-of-document id")
        prompts = [[tokenizer.eod, *p] for p in prompts]
    return prompts


FINISH_REASONS = {
    "stop": "ended at a stop or end-of-document token",
    "length": "reached --max-new-tokens or the model's position limit",
}


def format_results(
    tokenizer: Tokenizer | None,
    prompts: Sequence[Sequence[int]],
    texts: Sequence[str | None],
    out: GenerationOutput,
) -> list[dict]:
    results = []
    for i, (prompt, generated) in enumerate(zip(prompts, out.tokens)):
        body = generated[:-1] if out.finish_reasons[i] == "stop" else generated
        results.append(
            {
                "prompt": texts[i],
                "prompt_ids": list(prompt),
                "generated_ids": list(generated),
                "text": tokenizer.detokenize(body) if tokenizer is not None else None,
                "finish_reason": out.finish_reasons[i],
                "score": None if out.scores is None else out.scores[i],
            }
        )
        if out.log_probs is not None:
            results[-1]["output_log_probs"] = out.log_probs[i]
        if out.logits is not None:
            results[-1]["logits"] = out.logits[i]
    return results


def main(argv: Sequence[str] | None = None) -> int:
    from mcore.checkpoint import CheckpointError
    from mcore.distributed.groups import destroy_parallel, initialize_parallel
    from mcore.plugins.manager import BackendSelectionError, PluginError, select_backend
    from mcore.utils.console import configure_console

    configure_console()  # the library's lines (checkpoint loading) on the console
    configs = parse_config(GROUPS, argv, prog="python -m mcore.inference.generate")
    gen: GenerateConfig = configs["generation"]
    parallel: ParallelConfig = configs["parallel"]
    tok_override = configs["tokenizer"] if configs["tokenizer"].tokenizer_type else None
    try:
        check(
            parallel.virtual_pipeline_model_parallel_size in (None, 1)
            and parallel.num_layers_per_virtual_pipeline_stage is None,
            "generation runs one model chunk per pipeline stage: drop the virtual-pipeline flags",
        )
        check(
            parallel.context_parallel_size == 1,
            f"context_parallel_size={parallel.context_parallel_size}: generation does not run with "
            "context parallelism; use --context-parallel-size 1 (a checkpoint trained with it loads at 1)",
        )
        params = gen.sampling()
        if gen.output_json:  # found now, not after the model is loaded and the text generated
            check_writable("--output-json", gen.output_json, directory=False)
        backend = select_backend(parallel.device_backend)
        groups = initialize_parallel(replace(parallel, sequence_parallel=False), backend)
    except (ConfigError, ValueError, BackendSelectionError, PluginError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        generator, tokenizer = load_generator(
            gen.load,
            groups,
            iteration=gen.ckpt_step,
            tokenizer_config=tok_override,
            params_dtype=gen.params_dtype,
        )
        prompts = encode_prompts(tokenizer, gen.prompt, gen.prompt_ids, gen.add_bos)
        out = generator.generate(prompts, params)
    except (ConfigError, DataError, CheckpointError, ValueError, KeyError) as err:
        print(f"error (rank {groups.rank}): {err}", file=sys.stderr)
        return 2
    texts: list[str | None] = [None] * len(gen.prompt_ids) + list(gen.prompt)
    results = format_results(tokenizer, prompts, texts, out)
    if groups.rank == 0:
        for r in results:
            shown = r["prompt"] if r["prompt"] is not None else " ".join(map(str, r["prompt_ids"]))
            body = r["text"] if r["text"] is not None else " ".join(map(str, r["generated_ids"]))
            print(f"{shown!r} -> {body!r} ({FINISH_REASONS[r['finish_reason']]})", flush=True)
        if gen.output_json:
            write_text_atomic(gen.output_json, json.dumps(results, indent=2))
    del generator, groups  # they hold the group handles that destroy_parallel must free
    destroy_parallel()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
