"""Every command in the code blocks of the README and of the docs pages its sections moved to (every
``docs/*.md`` but the two whose blocks other tests run as a sequence, and the performance summary of
``benchmarks/README.md``) is run by a test (or by CI itself), and the launch scripts they name run,
scaled down, under torchrun."""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# command pattern -> (file that exercises it, text that file must contain)
EXERCISED = {
    r"^bash examples/quickstart\.sh": ("tests/test_quickstart.py", "quickstart"),
    r"^bash \.ci/run": (".ci/run", "pytest"),
    r"^pip install -e \.$": (".ci/run", 'pip install -q -e ".[test]"'),
    r"^pip install -e examples/third_party_backend": (
        ".ci/run",
        "pip install -q -e examples/third_party_backend",
    ),
    r"^mcore-preprocess-data ": ("tests/data/test_data_preprocess.py", "preprocess_main"),
    r"^mcore-merge-datasets ": ("tests/data/test_data_preprocess.py", "merge_main"),
    r"^torchrun .*examples/pretrain_gpt\.py": ("tests/training/test_pretrain.py", "pretrain_gpt3_tp_pp.sh"),
    r"^torchrun .*examples/pretrain_t5\.py": ("tests/t5/test_t5_readme.py", "pretrain_t5.py"),
    r"^bash examples/pretrain_gpt3_tp_pp\.sh": ("tests/training/test_pretrain.py", "pretrain_gpt3_tp_pp.sh"),
    r"^bash examples/pretrain_gpt2_codeparrot\.sh": ("tests/test_readme.py", "pretrain_gpt2_codeparrot.sh"),
    r"^bash examples/pretrain_llama\.sh": ("tests/test_readme.py", "pretrain_llama.sh"),
    r"^bash examples/pretrain_gpt_npu\.sh": ("tests/test_readme.py", "pretrain_gpt_npu.sh"),
    r"^mcore-inspect-checkpoint ": ("tests/checkpoint/test_inspect.py", "main"),
    r"^mcore-export-hf ": ("tests/hf/test_hf_errors.py", "export_main"),
    r"^mcore-export-megatron ": ("tests/checkpoint/test_megatron_interop.py", "EXPORT_MEGATRON"),
    r"^mcore-import-hf ": ("tests/hf/test_hf_errors.py", "import_main"),
    r"^mcore-generate ": ("tests/inference/test_generation_parallel.py", "main"),
    r"^python examples/npu_smoke\.py": ("tests/npu/test_simulated_npu_adaptor.py", "npu_smoke.py"),
    r"^python -m mcore\.backends": ("tests/plugins/test_backends_cli.py", '"mcore.backends"'),
    r"^python benchmarks/train_throughput\.py": ("tests/test_readme.py", "train_throughput.py"),
    # BERT
    r"^python examples/train_wordpiece_vocab\.py": ("tests/bert/test_bert_quickstart.py", "PROGRAMS"),
    r"^torchrun .*examples/pretrain_bert\.py": ("tests/bert/test_bert_quickstart.py", "PROGRAMS"),
    r"^python examples/fill_mask\.py": ("tests/bert/test_bert_quickstart.py", "PROGRAMS"),
}


# Pages whose ``bash`` blocks another test runs as a sequence, in a scratch directory.
RUN_ELSEWHERE = {
    "docs/writing_a_backend.md": "tests/test_docs.py runs every block in order",
    "docs/hf_workflow.md": "tests/hf/test_hf_workflow.py walks the same sequence",
}
# Pages of which only a section shows user commands (the rest are dated measurement logs).
SECTIONS = {"benchmarks/README.md": "## Performance summary"}


def command_pages() -> list[str]:
    """README.md, every docs page but those of RUN_ELSEWHERE, and the pages of SECTIONS."""
    docs = sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))
    return ["README.md", *(p for p in docs if p not in RUN_ELSEWHERE), *SECTIONS]


def page_text(page: str) -> str:
    text = (REPO / page).read_text(encoding="utf-8")
    if page in SECTIONS:
        heading = SECTIONS[page]
        assert f"\n{heading}\n" in text, f"{page} has no {heading!r} section"
        level = heading.split(" ")[0]
        text = text.split(f"\n{heading}\n", 1)[1].split(f"\n{level} ", 1)[0]
    return text


def readme_commands() -> list[str]:
    commands = []
    for page in command_pages():
        commands += page_commands(page)
    return commands


def page_commands(page: str) -> list[str]:
    text = page_text(page)
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(re.sub(r"\s+", " ", line))
    return commands


def test_every_readme_command_is_exercised():
    """Every README command has a test (or CI step) that runs it: that file invokes the command's
    program in code (an import of the console script's function, the module or script named in a
    string: not a comment or docstring), and each flag of the command is passed by that test (or by
    the launch script it runs) or, where only a GPU can run it, accepted by the program's parser."""
    import ast
    import contextlib
    import importlib
    import io
    import sys

    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]

    def code_of(path: str) -> tuple[list[str], set[str]]:
        """String literals (docstrings excluded) and ``module:name`` imports of a Python file; the
        non-comment lines of any other file."""
        text = (REPO / path).read_text(encoding="utf-8")
        if not path.endswith(".py"):
            return [line for line in text.splitlines() if not line.lstrip().startswith("#")], set()
        tree = ast.parse(text)
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        strings = [
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
        ]
        imports = {
            f"{node.module}:{alias.name}"
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names
        }
        return strings, imports

    def program_of(words: list[str]) -> tuple[str, str, list[str]]:
        """(kind, target, the program's own arguments) of a command line."""
        if words[0] == "bash":
            return "file", words[1], words[2:]
        if words[0] == "torchrun":
            index = next(i for i, w in enumerate(words) if w.endswith(".py"))
            return "file", words[index], words[index + 1 :]
        if words[0] == "python":
            return ("module", words[2], words[3:]) if words[1] == "-m" else ("file", words[1], words[2:])
        if words[0] == "pip":
            return "install", words[-1], []
        assert words[0] in scripts, f"README command {words[0]!r} is no console script of pyproject.toml"
        return "entry", scripts[words[0]], words[1:]

    child_help: dict[str, str] = {}

    def help_text(kind: str, target: str) -> str:
        """The program's ``--help``: in this process for console scripts; for scripts and modules, in
        one child process for all of them (they import the training stack once, not once each)."""
        if kind == "entry":
            module, function = target.split(":")
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                getattr(importlib.import_module(module), function)(["--help"])
            return out.getvalue()
        if not child_help:
            programs = {program_of(c.split())[:2] for c in commands if c.split()[0] in {"python", "torchrun"}}
            wanted = sorted(
                (k, t if k == "module" else str(REPO / t))
                for k, t in programs
                if k == "module" or t.endswith(".py")
            )
            proc = subprocess.run(
                [sys.executable, "-c", HELP_OF_EACH, json.dumps(wanted)],
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            child_help.update(json.loads(proc.stdout.splitlines()[-1]))
        return child_help.get(target if kind == "module" else str(REPO / target), "")

    commands = readme_commands()
    assert len(commands) >= 10
    # The README keeps its two commands (.ci/run is "the README's test command").
    readme = page_commands("README.md")
    assert {"bash examples/quickstart.sh", "bash .ci/run"} <= set(readme), readme
    unmatched, problems = [], []
    for command in commands:
        rule = next((r for r in EXERCISED if re.search(r, command)), None)
        if rule is None:
            unmatched.append(command)
            continue
        path, _ = EXERCISED[rule]
        strings, imports = code_of(path)
        words = command.split()
        kind, target, args = program_of(words)
        # The program exists.
        if kind in ("file", "install"):
            assert (REPO / target).exists(), f"README command {command!r}: no {target} in the repository"
        elif kind == "module":
            assert importlib.util.find_spec(target) is not None, f"{command!r}: no module {target}"
        # The exercising file invokes it, in code.
        name = pathlib.PurePath(target).name
        launchers = [s for s in strings if s.endswith(".sh") and (REPO / "examples" / s).is_file()]
        launched = "\n".join((REPO / "examples" / s).read_text(encoding="utf-8") for s in launchers)
        if kind == "entry":
            invoked = target in imports or words[0] in strings
        elif kind == "module":
            invoked = target in strings
        elif kind == "install" or path == target:
            invoked = any(command.split()[0] in line and target in line for line in strings) or path == target
        else:
            invoked = any(s.endswith(name) for s in strings) or (name in launched)
            if not invoked and target.endswith(".sh"):  # the test runs what the script runs
                body = "\n".join(code_of(target)[0])
                invoked = any(s.endswith(".py") and pathlib.PurePath(s).name in body for s in strings)
        if not invoked:
            problems.append(f"{path} does not invoke {target} in code, for {command!r}")
            continue
        # Each flag is passed by the test (or its launch script), else accepted by the program.
        flags = [w for w in args if w.startswith("--")]
        passed = {w for s in strings for w in re.findall(r"(?<![\w-])--[\w-]+", s)}
        passed |= set(re.findall(r"(?<![\w-])--[\w-]+", launched))
        unexercised = [f for f in flags if f not in passed]
        if unexercised:
            accepted = help_text(kind, target)
            missing = [
                f for f in unexercised if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", accepted)
            ]
            if missing:
                problems.append(f"{command!r}: {missing} neither passed by {path} nor accepted by {target}")
    assert not unmatched, "README commands no test runs:\n" + "\n".join(unmatched)
    assert not problems, "\n".join(problems)


# Runs in a child process: the ``--help`` of each (kind, path or module) of argv[1], as JSON on the last line.
HELP_OF_EACH = """
import contextlib, io, json, os, runpy, sys
out = {}
for kind, target in json.loads(sys.argv[1]):
    buf = io.StringIO()
    sys.argv = [target, "--help"]
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(target))  # as `python script.py` puts its folder first
            runpy.run_path(target, run_name="__main__")
            sys.path.pop(0)
    out[target] = buf.getvalue()
print(json.dumps(out))
"""


TINY = {
    "NPROC": "2",
    "NUM_LAYERS": "2",
    "HIDDEN": "64",
    "HEADS": "4",
    "SEQ": "32",
    "MBS": "2",
    "GBS": "4",
    "TRAIN_ITERS": "2",
    "WARMUP": "1",
    "EVAL_ITERS": "1",
    "NUM_WORKERS": "0",
    "DEVICE_BACKEND": "cpu",
    "OMP_NUM_THREADS": "1",
    "SAVE_INTERVAL": "1000",
    "LOG_INTERVAL": "1",
}


@pytest.mark.parametrize(
    ("script", "extra"),
    [
        ("pretrain_gpt2_codeparrot.sh", {"NPROC": "1", "PRECISION": " "}),  # its default TP=1, one rank
        ("pretrain_llama.sh", {"TP": "2", "GROUPS": "2", "FFN": "96", "PRECISION": " "}),
        ("pretrain_gpt_npu.sh", {"TP": "2", "PRECISION": " ", "MCORE_SIMULATED_NPU": "1"}),
    ],
)
def test_example_launch_scripts_run_scaled_down(tmp_path, script, extra):
    # PYTHON: the scripts launch `$PYTHON -m torch.distributed.run`; this interpreter, not PATH's.
    env = {**os.environ, **TINY, **extra, "OUTPUT_DIR": str(tmp_path / "out"), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(REPO / "examples" / script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "iteration        2/       2" in proc.stdout


TINY_GPT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --vocab-size 100 --warmup 1 --iters 1"
).split()


def _throughput(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "train_throughput.py"),
            "--device-backend",
            "cpu",
            *TINY_GPT,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_throughput_benchmark_times_the_plain_reference_in_the_same_process():
    """The benchmark runs on CPU (its own line) and times the plain reference in the same process."""
    proc = _throughput("--reference", "plain-eager")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    reference, ours = lines[0], lines[1]
    assert reference["peer"] == "plain-eager" and reference["tokens_per_s"] > 0
    assert math.isfinite(reference["lm_loss"])
    assert (
        ours["tokens_per_s"] > 0 and ours["of_reference"] == ours["tokens_per_s"] / reference["tokens_per_s"]
    )


def test_throughput_reference_refuses_a_model_it_does_not_model(capsys, monkeypatch):
    """In this process (the refusal comes before any model is built)."""
    import importlib.util

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # its sibling modules, as `python benchmarks/...`
    spec = importlib.util.spec_from_file_location(
        "train_throughput", REPO / "benchmarks" / "train_throughput.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit, match="this run differs in --swiglu"):
        bench.main(["--device-backend", "cpu", *TINY_GPT, "--reference", "plain", "--swiglu"])
    assert '"tokens_per_s"' not in capsys.readouterr().out
    import torch.distributed as dist

    assert not dist.is_initialized()  # nothing of the benchmark's run is left in this process
