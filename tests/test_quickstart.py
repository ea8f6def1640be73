"""The README's newcomer path, run as a sequence in a fresh clone: its install, its two commands (the
quickstart reduced with ``--quick``; ``.ci/run`` is CI itself) and the backend tour, in the README's
order, checking every artifact the quickstart promises; then the docs' next steps where they say they
run (the quickstart's output folder)."""

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

# The README's commands in its order, as this test runs them (a README edit must be reflected here).
README_SEQUENCE = [
    "pip install -e .",
    "bash examples/quickstart.sh",
    "bash .ci/run",
    "pip install -e examples/third_party_backend",
    "python -m mcore.backends",
]


def fresh_clone(dest: pathlib.Path) -> pathlib.Path:
    """What ``git clone`` of this working tree gives: the tracked and the untracked-but-not-ignored
    files (uncommitted edits included), none of the ignored ones (``.venv``, outputs, build folders)."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():  # a deleted, not yet committed file is listed too
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


# This checkout's own installs (editable mcore and the example plugin) stay out of the new environment.
OWN_INSTALLS = ("mcore_", "__editable__")


def newcomer_env(venv: pathlib.Path) -> dict[str, str]:
    """An activated virtual environment of its own (so ``pip install -e .`` installs the clone, not
    this checkout), that sees this interpreter's packages (torch, transformers...) but not its mcore
    installs, through a ``.pth`` file naming folders of links: the install needs no download. Without
    setuptools here, pip builds in isolation (online)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python*/site-packages")
    folders = []
    for i, packages in enumerate(p for p in sys.path if p.endswith("-packages") and os.path.isdir(p)):
        folder = venv / f"deps{i}"
        folder.mkdir()
        for entry in os.scandir(packages):
            if not entry.name.startswith(OWN_INSTALLS) and not entry.name.endswith(".pth"):
                (folder / entry.name).symlink_to(entry.path)
        folders.append(str(folder))
    (site / "_test_env.pth").write_text("\n".join(folders) + "\n")
    pip = {"PIP_NO_DEPS": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    if importlib.util.find_spec("setuptools") is not None:
        pip |= {"PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0"}  # "0" turns isolation off
    path = os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")])
    env = {**os.environ, **pip, "VIRTUAL_ENV": str(venv), "PATH": path, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    return env


def run_readme_command(command: str, clone: pathlib.Path, env: dict, venv: pathlib.Path):
    """One README command in the clone, as typed in the activated environment (``pip``/``python``
    are the environment's; the quickstart gets ``--quick``)."""
    words = command.split()
    if words[0] in ("pip", "python"):
        words = [str(venv / "bin" / "python"), *(["-m", "pip"] if words[0] == "pip" else []), *words[1:]]
    elif words[:2] == ["bash", "examples/quickstart.sh"]:
        words = [*words, "--quick"]
    return subprocess.run(words, cwd=clone, env=env, capture_output=True, text=True, timeout=900)


def test_readme_newcomer_path_in_a_fresh_clone(tmp_path):
    spec = importlib.util.spec_from_file_location("test_readme", REPO / "tests" / "test_readme.py")
    readme = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readme)
    assert readme.page_commands("README.md") == README_SEQUENCE, (
        "the README's commands changed: update this test"
    )
    clone = fresh_clone(tmp_path / "mcore")
    venv = tmp_path / "venv"
    env = newcomer_env(venv)
    outputs = {}
    for command in README_SEQUENCE:
        if command == "bash .ci/run":
            continue  # the whole suite: CI itself, which runs this test
        proc = run_readme_command(command, clone, env, venv)
        assert proc.returncode == 0, (command, proc.stdout[-4000:] + proc.stderr[-4000:])
        outputs[command] = proc.stdout
    # The install made the console scripts the docs name; the tour's plugin is found by its entry point.
    assert all((venv / "bin" / tool).is_file() for tool in ("mcore-export-hf", "mcore-generate", "mcore-run"))
    backends = outputs["python -m mcore.backends"]
    assert re.search(r"^backend example \(available", backends, re.M), backends
    quickstart = outputs["bash examples/quickstart.sh"]
    work = clone / "quickstart-output"

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
        "checkpoint after 20 iterations" in quickstart and "resumed and finished 40 iterations" in quickstart
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


def test_quickstart_refuses_a_foreign_directory_and_an_empty_plot(tmp_path, capsys):
    """An earlier quickstart run's outputs are removed; a non-empty directory the quickstart did not make is refused (nothing removed); a log with no
    training record gives an error, not an empty PNG; its progress checks fail on a missing iteration."""
    import pytest

    quickstart = _quickstart_module()
    # What a finished earlier run leaves behind (a checkpoint at the last iteration) is removed, said on
    # stdout: resuming from it would train nothing (the bug: progress printed over an empty log and plot).
    earlier = tmp_path / "qs"
    (earlier / "checkpoints").mkdir(parents=True)
    (earlier / quickstart.MARKER).write_text("")
    (earlier / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("40")
    quickstart.prepare_workdir(earlier)
    assert (
        f"starting clean: removing the previous quickstart run's outputs in {earlier}"
        in capsys.readouterr().out
    )
    assert [p.name for p in earlier.iterdir()] == [quickstart.MARKER]

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
