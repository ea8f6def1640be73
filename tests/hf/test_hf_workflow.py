"""The Hugging Face workflow end to end, on tiny models trained here (CPU, gloo, nothing downloaded).

One 4-process launch trains a GPT-2-style and a Llama-style model for a few iterations with
``pretrain`` and saves them at TP=2 x PP=2. Then:

* export (``python -m mcore.hf.export``): transformers' logits match mcore's within 1e-4 (fp32,
  eager and sdpa attention), the tokenizer files load with ``AutoTokenizer`` and give mcore's ids;
* transformers' greedy ``generate`` (and ``pipeline("text-generation")``) produce the same tokens as
  mcore's greedy generation at TP=2 x PP=2;
* round trip: HF -> ``python -m mcore.hf.importer`` -> ``pretrain --load --finetune`` at TP=2 (one
  step with lr 0, using the flags the importer printed) -> export gives identical weights and config;
  also for a Qwen3 and a Mistral model saved by transformers without tokenizer files.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from mcore.testing.distributed import run_distributed

sys.path.insert(0, str(Path(__file__).parent))  # hf_runs, here and in the spawned ranks (importlib mode)
from hf_runs import (  # noqa: E402
    PROMPTS,
    TRAIN,
    generate_greedy,
    make_gpt2_tokenizer,
    make_hf_tokenizer,
    pretrain_argv,
    train_models,
)

pytestmark = pytest.mark.slow
FAMILIES = ("gpt2", "llama")
ARCH = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Checkpoints of both families, trained 6 iterations at TP=2 x PP=2 (4 processes)."""
    root = tmp_path_factory.mktemp("hf_trained")
    tokenizers = {
        "gpt2": make_gpt2_tokenizer(str(root / "gpt2_tokenizer")),
        "llama": make_hf_tokenizer(str(root / "llama_tokenizer")),
    }
    parallel = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    # --data-cache-path: rank 0 builds the mock dataset's indices (~3 s of CPU), the others read them.
    cache = ["--data-cache-path", str(root / "index_cache")]
    runs = [
        pretrain_argv(
            f, tokenizers[f], *parallel, *cache, "--train-iters", "6", "--save", str(root / f"{f}_ckpt")
        )
        for f in FAMILIES
    ]
    iterations = run_distributed(train_models, 4, runs, timeout=300)
    shutil.rmtree(root / "index_cache", ignore_errors=True)
    assert iterations[0] == [6, 6]
    return {"root": root, "tokenizers": tokenizers, **{f: str(root / f"{f}_ckpt") for f in FAMILIES}}


@pytest.fixture(scope="module")
def exported(trained):
    """Each checkpoint exported with the command; returns the HF directories."""
    from mcore.hf.export import main

    out = {}
    for family in FAMILIES:
        out[family] = str(trained["root"] / f"{family}_hf")
        assert main(["--load", trained[family], "--save", out[family]]) == 0
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_export_matches_transformers_logits(trained, exported, family):
    from mcore.checkpoint import load_logical_model_state
    from mcore.hf.parity import check_logit_parity, hf_logits, mcore_logits, parity_tokens
    from mcore.inference.loading import model_config_from_run_config

    hf_dir = exported[family]
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert config["architectures"] == [ARCH[family]]
    assert sorted(os.listdir(hf_dir)) == sorted(
        [
            ".mcore-output.json",  # the marker: --overwrite replaces only an earlier export
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
        + (["vocab.json", "merges.txt"] if family == "gpt2" else [])
    )
    state, meta = load_logical_model_state(trained[family])
    cfg = model_config_from_run_config(meta["run_config"])
    vocab = config["vocab_size"]
    assert (
        vocab
        == meta["extra"].get("tokenizer_vocab_size", vocab)
        < state["embedding.word_embeddings.weight"].shape[0]
    )
    report = check_logit_parity(cfg, state, vocab, hf_dir)
    assert report.max_abs_diff < 1e-4 and report.argmax_equal, report.describe()
    print(f"{family}: {report.describe()}")
    # The same numbers by hand, so the check itself is checked.
    tokens = parity_tokens(vocab, cfg.max_position_embeddings)
    diff = (hf_logits(hf_dir, tokens) - mcore_logits(cfg, state, vocab, tokens)).abs().max().item()
    assert diff < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_tokenizer_gives_mcore_ids(trained, exported, family):
    from transformers import AutoTokenizer

    from mcore.data.tokenizers import build_tokenizer
    from mcore.inference.loading import tokenizer_config_from_run_config

    meta = json.load(open(os.path.join(trained[family], "iter_0000006", "metadata.json")))
    ours = build_tokenizer(tokenizer_config_from_run_config(meta["run_config"]))
    theirs = AutoTokenizer.from_pretrained(exported[family])
    texts = [*PROMPTS, "the lazy dog sleeps"]
    assert [theirs(t)["input_ids"] for t in texts] == ours.tokenize_batch(texts)
    assert theirs.eos_token_id == ours.eod


def test_transformers_greedy_generate_matches_mcore(trained, exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    ours = run_distributed(generate_greedy, 4, [trained[f] for f in FAMILIES], PROMPTS, NEW_TOKENS, 2, 2)[0]
    for family, mine in zip(FAMILIES, ours):
        model = AutoModelForCausalLM.from_pretrained(exported[family], dtype=torch.float32).eval()
        for prompt, tokens in zip(mine["prompts"], mine["tokens"]):
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=model.config.eos_token_id,
            )
            assert out[0, len(prompt) :].tolist() == tokens, family
        # The user-facing path: a text-generation pipeline gives the same continuation.
        tokenizer = AutoTokenizer.from_pretrained(exported[family])
        generate = pipeline("text-generation", model=model, tokenizer=tokenizer)
        text = generate(PROMPTS[0], max_new_tokens=NEW_TOKENS, do_sample=False, return_full_text=False)
        expected = mine["tokens"][0]
        if expected and expected[-1] == model.config.eos_token_id:
            expected = expected[:-1]
        assert text[0]["generated_text"] == tokenizer.decode(expected, skip_special_tokens=True)


def finetune_one_step(argvs: list[list[str]]) -> list[int]:
    """Rank function: ``pretrain`` with each argv (``--load ... --finetune``, lr 0, one step)."""
    return train_models(argvs)


def _saved_by_transformers(root: Path) -> dict[str, tuple[str, str]]:
    """Tiny Qwen3 (per-head q/k norms) and Mistral models saved by transformers without tokenizer
    files: family -> (directory, class)."""
    import transformers

    tiny = dict(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0,
    )  # fmt: skip
    out = {}
    for family, arch, config in (
        ("qwen3", "Qwen3ForCausalLM", transformers.Qwen3Config(**tiny, head_dim=16)),
        ("mistral", "MistralForCausalLM", transformers.MistralConfig(**tiny, sliding_window=None)),
    ):
        torch.manual_seed(0)
        model = getattr(transformers, arch)(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(0.1 * torch.randn_like(param))
        model.save_pretrained(root / family)
        out[family] = (str(root / family), arch)
    return out


def test_hf_to_mcore_tp2_to_hf_roundtrip_is_identical(trained, exported, tmp_path):
    """docs/model_families.md's sequence: import (Qwen3 and Mistral without tokenizer files:
    ``--no-tokenizer``), continue at TP=2 with the printed flags, export back to the same class."""
    from safetensors.torch import load_file

    from mcore.hf.export import main as export_main
    from mcore.hf.importer import import_from_hf
    from mcore.testing.distributed import test_backend_name

    sources = {f: (exported[f], ARCH[f]) for f in FAMILIES}
    sources.update(_saved_by_transformers(tmp_path))
    runs, resaved = [], {}
    for family, (hf_dir, _) in sources.items():
        imported = tmp_path / f"{family}_imported"
        with_tokenizer = family in FAMILIES
        report = import_from_hf(
            hf_dir, str(imported), tensor_model_parallel_size=2, use_tokenizer=with_tokenizer
        )
        assert report.parity.max_abs_diff < 1e-4, report.describe()
        assert "--finetune" in report.flags and "--load" in report.flags
        assert ("--qk-layernorm" in report.flags) == (family == "qwen3")
        resaved[family] = tmp_path / f"{family}_tp2"
        # Continue "training" at TP=2 with the printed flags: one step with lr 0 leaves the weights alone.
        runs.append(
            [
                "--device-backend", test_backend_name(), *report.flags, *TRAIN,
                "--lr", "0", "--train-iters", "1", "--tensor-model-parallel-size", "2",
                "--save", str(resaved[family]), "--seq-length", "32",
                "--data-cache-path", str(tmp_path / "index_cache"),  # rank 0 builds the indices
            ]
        )  # fmt: skip
    assert run_distributed(finetune_one_step, 2, runs, timeout=300)[0] == [1] * len(sources)
    shutil.rmtree(tmp_path / "index_cache", ignore_errors=True)
    for family, (hf_dir, arch) in sources.items():
        again = tmp_path / f"{family}_hf_again"
        assert (
            export_main(["--load", str(resaved[family]), "--save", str(again), "--architecture", arch]) == 0
        )
        before = load_file(os.path.join(hf_dir, "model.safetensors"))
        after = load_file(os.path.join(again, "model.safetensors"))
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(before[key], after[key]), f"{family}: {key} changed in the round trip"
        config_before = json.load(open(os.path.join(hf_dir, "config.json")))
        config_after = json.load(open(os.path.join(again, "config.json")))
        if family in FAMILIES:
            assert config_before == config_after
        else:  # transformers writes its own defaults (token ids, dtype ...); the model's fields agree
            for key in ("architectures", "hidden_size", "num_key_value_heads", "head_dim", "rms_norm_eps"):
                assert config_before[key] == config_after[key], (family, key)
