"""Tiny tokenizers, model flags and rank functions for the Hugging Face tests (imported by spawned ranks).

Two model families, both small enough to train a few iterations on 2 CPU cores:

* ``gpt2``: learned positions, LayerNorm, exact GeLU, biases, tied embeddings, a GPT-2 BPE
  (``vocab.json``/``merges.txt``) trained here;
* ``llama``: RoPE (base 5000), RMSNorm (eps 1e-6), SwiGLU, GQA (8 heads, 2 groups), no biases,
  untied output layer, a ``tokenizer.json`` tokenizer with ``<s>``/``</s>`` trained here.
"""

from __future__ import annotations

import json
import os

from mcore.testing.distributed import test_backend_name

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a journey of a thousand miles begins with a single step",
    "to be or not to be that is the question",
    "all that glitters is not gold",
    "the early bird catches the worm while the night owl sleeps",
    "one two three four five six seven eight nine ten",
] * 20

MODELS = {
    "gpt2": [
        "--num-layers", "2",
        "--hidden-size", "64",
        "--num-attention-heads", "4",
        "--seq-length", "32",
        "--max-position-embeddings", "64",
    ],
    "llama": [
        "--num-layers", "2",
        "--hidden-size", "64",
        "--num-attention-heads", "8",
        "--group-query-attention",
        "--num-query-groups", "2",
        "--ffn-hidden-size", "96",
        "--seq-length", "32",
        "--max-position-embeddings", "64",
        "--position-embedding-type", "rope",
        "--rotary-base", "5000",
        "--normalization", "RMSNorm",
        "--norm-epsilon", "1e-6",
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
    ],
}  # fmt: skip

TRAIN = [
    "--micro-batch-size", "2",
    "--global-batch-size", "4",
    "--lr", "3e-3",
    "--mock-data",
    "--eval-iters", "0",
    "--log-interval", "1000",
    "--num-workers", "0",
]  # fmt: skip

PROMPTS = ["the quick brown", "to be or", "one two three four"]


def make_gpt2_tokenizer(folder: str) -> list[str]:
    """A GPT-2 byte-level BPE (``vocab.json``/``merges.txt``); returns its tokenizer flags."""
    from mcore.data.tokenizers import train_bpe_tokenizer

    vocab, merges = train_bpe_tokenizer(CORPUS, 300, folder)
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]


def make_hf_tokenizer(folder: str) -> list[str]:
    """A ``tokenizer.json`` BPE with ``<s>``/``</s>`` and its ``tokenizer_config.json``; returns its flags."""
    import tokenizers as tk

    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}, f)
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder]


def pretrain_argv(family: str, tokenizer_flags: list[str], *extra: str) -> list[str]:
    return ["--device-backend", test_backend_name(), *MODELS[family], *TRAIN, *tokenizer_flags, *extra]


def train_models(runs: list[list[str]]) -> list[int]:
    """Rank function: one ``pretrain`` per argv (each saves its checkpoint); returns the iterations."""
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    return [pretrain(model_provider, forward_step, argv=argv).state.iteration for argv in runs]


def generate_greedy(ckpt_dirs: list[str], prompts: list[str], max_new_tokens: int, tp: int, pp: int) -> list:
    """Rank function: greedy generation from each checkpoint at TP x PP; returns prompt and new ids."""
    from mcore.config.parallel import ParallelConfig
    from mcore.distributed.groups import initialize_parallel
    from mcore.inference.generate import load_generator
    from mcore.inference.generation import SamplingParams

    groups = initialize_parallel(
        ParallelConfig(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, device_backend=test_backend_name()
        )
    )
    results = []
    for ckpt in ckpt_dirs:
        generator, tokenizer = load_generator(ckpt, groups)
        ids = tokenizer.tokenize_batch(prompts)
        out = generator.generate(ids, SamplingParams(max_new_tokens=max_new_tokens, greedy=True))
        results.append({"prompts": ids, "tokens": out.tokens, "reasons": out.finish_reasons})
    return results
