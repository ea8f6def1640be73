"""CI is hermetic: nothing the tests start is looked up on PATH, where another install's ``python`` or
``torchrun`` may be found first (a fresh machine under ``env -i PATH=/usr/bin:/bin`` has no torch there).

Python launches go through ``sys.executable`` (``sys.executable -m torch.distributed.run`` for torchrun);
the example shell scripts start ``"$PYTHON" -m torch.distributed.run`` and the tests that run them set
``PYTHON`` to ``sys.executable``."""

import ast
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]

# Programs that resolve through PATH to an interpreter other than the one running the tests.
BARE_LAUNCHERS = {"python", "python3", "torchrun"}
SUBPROCESS_CALLS = {"run", "Popen", "call", "check_call", "check_output", "system", "execv", "execvp"}


def _python_files() -> list[pathlib.Path]:
    files = [*(REPO / "tests").rglob("*.py"), *(REPO / "examples").glob("*.py")]
    files += (REPO / "benchmarks").rglob("*.py")
    return sorted(files)


def _first_word(node: ast.AST) -> str | None:
    """The program an argv literal (list/tuple) or a shell string starts, when written literally."""
    if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
        first = node.elts[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value.split()[0] if first.value.split() else None
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split():
        return node.value.split()[0]
    return None


def bare_launches(source: str) -> list[str]:
    """``line: reason`` for every bare launch in one Python file:

    - an argv list/tuple literal starting with ``python``/``python3``/``torchrun``;
    - a subprocess call whose command string starts with one of those;
    - ``bash <script>`` whose enclosing function never sets ``PYTHON`` (the script's interpreter)."""
    tree = ast.parse(source)
    found = []
    parents: dict[ast.AST, ast.AST] = {}
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            parents[child] = parent
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)) and _first_word(node) in BARE_LAUNCHERS:
            found.append(f"{node.lineno}: argv starts with {_first_word(node)!r} from PATH")
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name not in SUBPROCESS_CALLS:
            continue
        command = node.args[0]
        word = _first_word(command)
        if isinstance(command, ast.Constant) and word in BARE_LAUNCHERS:
            found.append(f"{node.lineno}: command string starts with {word!r} from PATH")
        if word == "bash":
            scope = node
            while scope in parents and not isinstance(scope, (ast.FunctionDef, ast.Module)):
                scope = parents[scope]
            if "PYTHON" not in (ast.get_source_segment(source, scope) or ""):
                found.append(f"{node.lineno}: bash script launched without PYTHON=sys.executable")
    return found


def shell_bare_launches(text: str) -> list[str]:
    """``line: reason`` for every command in a shell script that starts python or torchrun from PATH."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        code = line.split("#", 1)[0].strip()
        for word in BARE_LAUNCHERS:
            if re.search(rf"(^|[;&|(]\s*|\bexec\s+){re.escape(word)}(\s|$)", code):
                found.append(f'{number}: {word!r} from PATH (use "$PYTHON" -m ...)')
    return found


def test_no_test_or_example_launches_python_or_torchrun_from_path():
    problems = []
    for path in _python_files():
        for problem in bare_launches(path.read_text(encoding="utf-8")):
            problems.append(f"{path.relative_to(REPO)}:{problem}")
    for path in sorted((REPO / "examples").glob("*.sh")):
        for problem in shell_bare_launches(path.read_text(encoding="utf-8")):
            problems.append(f"{path.relative_to(REPO)}:{problem}")
    assert not problems, "launches that depend on PATH:\n" + "\n".join(problems)


def test_example_launch_scripts_start_torchrun_through_python():
    """docs/parallelism.md's description of the launch scripts: ``"$PYTHON" -m torch.distributed.run``,
    ``PYTHON`` defaulting to ``python3``."""
    scripts = sorted((REPO / "examples").glob("pretrain_*.sh"))
    assert len(scripts) >= 4
    for script in scripts:
        text = script.read_text(encoding="utf-8")
        assert "PYTHON=${PYTHON:-python3}" in text, script.name
        assert '"$PYTHON" -m torch.distributed.run --nproc_per_node' in text, script.name


def test_the_launch_checks_catch_each_bare_form():
    """The checks above can fail: each form the fresh-clone CI run tripped on is found."""
    python_cases = {
        'subprocess.run(["python", "bench.py"])': "argv starts with 'python'",
        'train = ["torchrun", "--nproc_per_node", "2", "x.py"]': "argv starts with 'torchrun'",
        'subprocess.run("python3 x.py", shell=True)': "command string starts with 'python3'",
        'def t():\n    subprocess.run(["bash", "examples/a.sh"], env=dict(os.environ))': "without PYTHON",
    }
    for source, reason in python_cases.items():
        problems = bare_launches(source)
        assert problems and reason in problems[0], (source, problems)
    fine = 'def t():\n    env = dict(os.environ, PYTHON=sys.executable)\n    subprocess.run(["bash", "a.sh"], env=env)'
    assert bare_launches(fine) == []
    assert bare_launches("subprocess.run([sys.executable, '-m', 'torch.distributed.run', 'x.py'])") == []

    assert shell_bare_launches('torchrun --nproc_per_node "$NPROC" x.py \\') != []
    assert shell_bare_launches("exec python examples/quickstart.py") != []
    assert shell_bare_launches('"$PYTHON" -m torch.distributed.run --nproc_per_node 2 x.py') == []
    assert shell_bare_launches("# torchrun --nproc_per_node 8 x.py") == []
