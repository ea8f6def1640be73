"""The README's first command, reduced (``--quick``), end to end, checking every artifact it promises."""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_quickstart_quick_mode_produces_every_artifact(tmp_path):
    work = tmp_path / "qs"
    # What a finished earlier run leaves behind: a checkpoint at the last iteration. Resuming from it
    # would train nothing (the bug: a second run printed progress over an empty log and plot).
    (work / "checkpoints").mkdir(parents=True)
    (work / ".mcore-quickstart").write_text("")
    (work / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("40")
    (work / "train_log.jsonl").write_text("")
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "quickstart.py"), "--quick", "--workdir", str(work)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"starting clean: removing the previous quickstart run's outputs in {work}" in proc.stdout

    # data: Megatron .bin/.idx and the trained tokenizer
    assert (work / "data" / "stdlib_text_document.bin").stat().st_size > 0
    assert (work / "data" / "stdlib_text_document.idx").read_bytes()[:9] == b"MMIDIDX\x00\x00"
    assert (work / "tokenizer" / "vocab.json").exists() and (work / "tokenizer" / "merges.txt").exists()

    # training stopped halfway (checkpoint), resumed, finished: the log shows both halves
    assert (work / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "40"
    records = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["iteration"] for r in train] == [10, 20, 30, 40]
    assert train[-1]["lm loss"] < train[0]["lm loss"]
    assert (
        "checkpoint after 20 iterations" in proc.stdout
        and "resumed and finished 40 iterations" in proc.stdout
    )

    # Hugging Face directory loadable by transformers; both generators agree (greedy)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(work / "hf_model")
    assert type(model).__name__ == "GPT2LMHeadModel"
    hf_text = (work / "generation_transformers.txt").read_text(encoding="utf-8")
    assert hf_text.startswith("def hello_world():") and len(hf_text) > len("def hello_world():")
    (mcore_out,) = json.loads((work / "generation_mcore.json").read_text())
    assert mcore_out["prompt"] + mcore_out["text"] == hf_text, (mcore_out, hf_text)

    # TensorBoard scalars were written (one event file per run: the first half and the resumed half)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted((work / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 2
    tags = EventAccumulator(str(events[-1])).Reload().Tags()["scalars"]
    assert "lm loss" in tags and "learning-rate" in tags and "lm loss validation" in tags

    # the loss curve
    assert (work / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The docs' next steps, as written, where they say they run (the quickstart's output folder).
    for page, heading in (
        ("docs/hugging_face.md", "## The commands"),
        ("docs/megatron_checkpoints.md", "(run in `quickstart-output/`"),
    ):
        for command in doc_commands(REPO / page, heading):
            assert run_in(work, command) == 0, (page, command)
    assert (work / "my_hf_model" / "model.safetensors").is_file() and (work / "imported").is_dir()


def doc_commands(page, after: str) -> list[list[str]]:
    """The commands of the first ``bash`` block after the text ``after`` (continuation lines joined)."""
    import shlex

    text = page.read_text()
    block = text[text.index("```bash", text.index(after)) + len("```bash") :]
    block = block[: block.index("```")].replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def run_in(folder, command: list[str]) -> int:
    """``command`` (an ``mcore-*`` console script) in-process, in ``folder``."""
    from mcore.checkpoint.megatron.write import main as export_megatron
    from mcore.hf.export import main as export_hf
    from mcore.hf.importer import main as import_hf
    from mcore.inference.generate import main as generate

    mains = {"mcore-export-hf": export_hf, "mcore-import-hf": import_hf, "mcore-generate": generate,
             "mcore-export-megatron": export_megatron}  # fmt: skip
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        return mains[command[0]](command[1:])
    finally:
        os.chdir(cwd)


def _quickstart_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("quickstart", REPO / "examples" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_refuses_a_foreign_directory_and_an_empty_plot(tmp_path):
    """A non-empty directory the quickstart did not make is refused (nothing removed); a log with no
    training record gives an error, not an empty PNG; its progress checks fail on a missing iteration."""
    import pytest

    quickstart = _quickstart_module()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit, match="not empty and was not made by the quickstart"):
        quickstart.prepare_workdir(foreign)
    assert (foreign / "notes.txt").read_text() == "keep"

    log = tmp_path / "train_log.jsonl"
    log.write_text("")
    with pytest.raises(SystemExit, match="holds no training record"):
        quickstart.plot_losses(log, tmp_path / "loss.png")
    assert not (tmp_path / "loss.png").exists()

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("40")
    with pytest.raises(SystemExit, match="no training record of iteration 40"):
        quickstart.expect_trained(tmp_path / "ckpt", log, 40)
