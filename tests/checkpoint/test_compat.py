"""A checkpoint of another model is refused, naming the values; vocabulary changes need a flag.

One 4-iteration run of the test model (single process) is saved once; every other configuration
then tries to continue from it through ``pretrain`` (``--load``), as a user would.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_runs import train  # noqa: E402

from mcore.checkpoint import CheckpointConfig, CheckpointError, load_checkpoint, load_logical_model_state  # noqa: E402
from mcore.checkpoint.compat import check_compatible  # noqa: E402
from mcore.distributed.groups import ProcessGroups  # noqa: E402

SAVED_VOCAB = 1001  # NullTokenizer --vocab-size 1000: ids 0..999 and EOD


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("compat") / "ckpt"
    result = train(["--train-iters", "4", "--save", str(save), "--save-interval", "4"])
    assert result["iteration"] == 4
    return save


def _continue(saved: Path, *extra: str) -> dict:
    # Two more iterations than were saved: the schedule follows the new --train-iters, as asked.
    return train(["--train-iters", "6", "--override-opt_param-scheduler", "--load", str(saved), *extra])


@pytest.mark.parametrize(
    "extra, message",
    [
        (  # same hidden size, other heads: the QKV rows would be regrouped silently
            ["--num-attention-heads", "8"],
            r"num_attention_heads: the checkpoint has 4, this run 8; kv_channels: the checkpoint has 8, this run 4",
        ),
        (
            ["--group-query-attention", "--num-query-groups", "2"],
            r"num_query_groups: the checkpoint has 4, this run 2",
        ),
        (["--kv-channels", "16"], r"kv_channels: the checkpoint has 8, this run 16"),
        (["--ffn-hidden-size", "96"], r"ffn_hidden_size: the checkpoint has 64, this run 96"),
        (["--num-layers", "2"], r"num_layers: the checkpoint has 4, this run 2"),
        (
            ["--position-embedding-type", "rope"],
            r"position_embedding_type: the checkpoint has 'learned_absolute', this run 'rope'",
        ),
        (
            ["--normalization", "RMSNorm"],
            r"normalization: the checkpoint has 'LayerNorm', this run 'RMSNorm'",
        ),
        (
            ["--vocab-size", "1200"],
            r"tokenizer vocabulary size: the checkpoint has 1001, this run 1201 .*--allow-vocab-resize",
        ),
        (
            ["--vocab-size", "1010"],  # the same padded size (1024): it used to load without a word
            r"tokenizer vocabulary size: the checkpoint has 1001, this run 1011",
        ),
    ],
    ids=[
        "heads",
        "query-groups",
        "kv-channels",
        "ffn",
        "layers",
        "position",
        "norm",
        "vocab",
        "vocab-same-padding",
    ],
)
def test_a_different_model_is_refused_naming_the_values(saved, extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:  # pretrain: one line on stderr, exit status 2
        _continue(saved, *extra)
    assert exit_info.value.code == 2
    assert re.search(rf"iter_0000004 is not compatible with this model: .*{message}", capsys.readouterr().err)


def test_swiglu_and_tokenizer_type_are_compared():
    meta = {
        "run_config": {"model": {"swiglu": True}, "tokenizer": {"tokenizer_type": "GPT2BPETokenizer"}},
        "extra": {"tokenizer_vocab_size": 50257},
    }
    from types import SimpleNamespace

    now = SimpleNamespace(
        model=SimpleNamespace(swiglu=False), tokenizer=SimpleNamespace(tokenizer_type="HuggingFaceTokenizer")
    )
    with pytest.raises(CheckpointError) as err:
        check_compatible("DIR", meta, now, tokenizer_vocab_size=50257)
    assert "swiglu: the checkpoint has True, this run False" in str(err.value)
    assert "tokenizer_type: the checkpoint has 'GPT2BPETokenizer', this run 'HuggingFaceTokenizer'" in str(
        err.value
    )
    # the flag allows the tokenizer change, never the architecture change
    with pytest.raises(CheckpointError, match="swiglu") as err:
        check_compatible("DIR", meta, now, tokenizer_vocab_size=50257, allow_vocab_resize=True)
    assert "tokenizer_type" not in str(err.value)


def test_settings_that_do_not_change_the_tensors_still_load(saved):
    result = _continue(
        saved,
        "--norm-epsilon",
        "1e-6",
        "--hidden-dropout",
        "0.1",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    )
    assert result["iteration"] == 6


@pytest.mark.parametrize("vocab", [1200, 900], ids=["grow", "shrink"])
def test_allow_vocab_resize_keeps_shared_rows_and_zeroes_the_others(saved, tmp_path, vocab):
    """Growth: ids < 1001 keep their trained rows, new ids and padding rows start at zero (weights,
    fp32 masters, Adam moments). Shrink: rows >= the new size are dropped, padding rows are zero.
    Training then continues from the checkpoint's iteration."""
    from ckpt_runs import argv

    from mcore.optimizer import build_optimizer
    from mcore.training.gpt import model_provider
    from mcore.training.pretrain import build_model
    from mcore.training.run_config import parse_run_config

    logical, _ = load_logical_model_state(saved)
    trained = logical["embedding.word_embeddings.weight"]
    cfg = parse_run_config(
        argv("--train-iters", "6", "--override-opt_param-scheduler", "--vocab-size", str(vocab))
    )
    groups = ProcessGroups.single()
    now_vocab = vocab + 1
    padded = -(-now_vocab // 128) * 128
    model = build_model(cfg, groups, model_provider, padded)
    optimizer = build_optimizer(cfg.optimizer, cfg.precision, model, groups, lr=cfg.scheduler.lr)
    kept = min(SAVED_VOCAB, now_vocab)
    config = CheckpointConfig(load=str(saved), allow_vocab_resize=True)
    state = load_checkpoint(
        config, model, optimizer, None, groups, run_config=cfg, tokenizer_vocab_size=now_vocab
    )
    assert state["iteration"] == 4
    emb = model[0].module.embedding.word_embeddings.weight.detach()
    assert emb.shape[0] == padded
    assert torch.equal(emb[:kept], trained[:kept])
    assert not emb[kept:].any()
    entry = next(e for e in optimizer.main_params if e.key == "embedding.word_embeddings.weight")
    rows = entry.state["exp_avg"].view(padded, -1)
    assert rows[:kept].abs().sum() > 0 and not rows[kept:].any()
    assert torch.equal(optimizer.master_of(entry).view(padded, -1), emb.float())

    result = _continue(saved, "--vocab-size", str(vocab), "--allow-vocab-resize")
    assert result["iteration"] == 6 and all(torch.isfinite(torch.tensor(result["losses"])))
