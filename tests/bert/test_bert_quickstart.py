"""docs/bert.md's BERT workflow (the README's BERT section before), run exactly as written (in a scratch
directory), checking what it promises: a WordPiece vocab trained on the Python docs, the sentence-level
``.bin/.idx``, a 2-process TP=2 run with Megatron's defaults that logs ``lm loss`` and ``sop loss`` and
saves, the Hugging Face export, and a fill-mask on it."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
# The launchers the page writes (a set, not an argv: the hermetic-launch check reads argv literals).
README_LAUNCHERS = {"torchrun", "python"}
PROGRAMS = (
    "examples/train_wordpiece_vocab.py",
    "mcore-preprocess-data",
    "examples/pretrain_bert.py",
    "mcore-export-hf",
    "examples/fill_mask.py",
)
"""The programs of the section's commands, in order."""

pytestmark = pytest.mark.slow


def bert_section_commands() -> list[list[str]]:
    """The commands of the ``## Train, export, fill a mask`` code block of docs/bert.md, as argument lists."""
    text = (REPO / "docs" / "bert.md").read_text(encoding="utf-8")
    section = text.split("\n## Train, export, fill a mask\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            commands.append(words)
    return commands


def _console_script(name: str) -> list[str]:
    """Run a console script of pyproject.toml with this interpreter (not whatever is on PATH)."""
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    module, function = scripts[name].split(":")
    return [sys.executable, "-c", f"import sys; from {module} import {function}; sys.exit({function}())"]


def as_subprocess(words: list[str]) -> list[str]:
    """A command line of the page as this interpreter runs it (``python`` and ``torchrun`` are
    ``sys.executable``; repository paths are absolute)."""
    if words[0] == "python":
        return [sys.executable, str(REPO / words[1]), *words[2:]]
    if words[0] == "torchrun":
        script = next(i for i, w in enumerate(words) if w.endswith(".py"))
        return [sys.executable, "-m", "torch.distributed.run", *words[1:script], str(REPO / words[script]), *words[script + 1 :]]  # fmt: skip
    return [*_console_script(words[0]), *words[1:]]


def program(words: list[str]) -> str:
    """The script a ``python``/``torchrun`` command runs, or the console script's name."""
    if words[0] in README_LAUNCHERS:
        return next(w for w in words if w.endswith(".py"))
    return words[0]


def test_readme_bert_section_runs_as_written(tmp_path):
    commands = bert_section_commands()
    assert tuple(program(c) for c in commands) == PROGRAMS
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outputs = []
    for words in commands:
        proc = subprocess.run(
            as_subprocess(words), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, f"{shlex.join(words)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout)
    work = tmp_path / "bert"

    # vocab and sentence-level data
    vocab = (work / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and len(vocab) == 4000
    assert (work / "docs_text_sentence.idx").read_bytes()[:9] == b"MMIDIDX\x00\x00"

    # training: Megatron's log line with both losses; validation; the final checkpoint
    train_out = outputs[2]
    lines = [line for line in train_out.splitlines() if line.startswith(" iteration ")]
    assert len(lines) == 4, train_out[-3000:]
    assert all("lm loss" in line and "sop loss" in line for line in lines), train_out[-3000:]
    lm = [float(line.split("lm loss: ")[1].split()[0]) for line in lines]
    assert lm[-1] < lm[0], lm  # it learns
    assert "validation loss at iteration 10 | lm loss value" in train_out
    assert "test loss at the end of training" in train_out
    assert (work / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "20"

    # the export: MegatronBertForPreTraining with its tokenizer files
    config = json.loads((work / "hf_model" / "config.json").read_text())
    assert config["architectures"] == ["MegatronBertForPreTraining"]

    # fill-mask: 5 completions of the sentence
    predictions = [json.loads(line) for line in outputs[4].splitlines()]
    assert len(predictions) == 5
    assert all(p["sequence"].endswith("statement leaves the loop.") for p in predictions), predictions
    assert all("[MASK]" not in p["sequence"] and 0 < p["score"] <= 1 for p in predictions), predictions
