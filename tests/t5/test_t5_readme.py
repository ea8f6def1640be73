"""docs/t5.md's T5 section (the README's before) runs as written: its preprocessing command on a local
corpus and vocabulary, then its pretraining command under torchrun (2 CPU processes, encoder and decoder
on separate stages)."""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def _t5_commands() -> list[list[str]]:
    text = (REPO / "docs" / "t5.md").read_text(encoding="utf-8")
    section = text.split("\n## T5 pretraining\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_readme_t5_commands_run(t5_corpus, tmp_path):
    from mcore.data.preprocess import main as preprocess_main

    preprocess, train = _t5_commands()
    # The page launches with torchrun; this test runs the same launcher as sys.executable's module.
    assert preprocess[0] == "mcore-preprocess-data" and " ".join(train).startswith(
        "torchrun --nproc_per_node 2 "
    )
    # The page takes the BERT page's corpus and vocabulary (bert/); this test writes its own there.
    (tmp_path / "bert").mkdir()
    with (tmp_path / "bert" / "corpus.jsonl").open("w", encoding="utf-8") as out:
        for doc in t5_corpus["documents"]:
            out.write(json.dumps({"text": " ".join(doc)}) + "\n")
    (tmp_path / "bert" / "vocab.txt").write_text(pathlib.Path(t5_corpus["vocab"]).read_text(encoding="utf-8"))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert preprocess_main(preprocess[1:]) in (0, None)
    finally:
        os.chdir(cwd)
    assert (tmp_path / "t5" / "corpus_text_sentence.idx").is_file()

    script = train.index("examples/pretrain_t5.py")
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *train[1:script],
        str(REPO / "examples/pretrain_t5.py"),
    ]
    proc = subprocess.run(
        [*argv, *train[script + 1 :]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [
        float(v)
        for v in re.findall(r"validation loss at the end of training \| lm loss value: (\S+)", proc.stdout)
    ]
    assert len(losses) == 1 and losses[0] < 6.0, proc.stdout[-3000:]  # ln(vocab) ~ 6.6 at the start
    assert (tmp_path / "t5" / "checkpoints" / "latest_checkpointed_iteration.txt").is_file()
