"""The documentation runs: every code block of ``docs/writing_a_backend.md`` is executed in order
from an empty directory, its op table matches the registry, and ``docs/architecture.md``'s import
rules hold for the code."""

from __future__ import annotations

import ast
import inspect
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
import tomllib

from mcore.ops import reference
from mcore.ops.registry import OP_NAMES
from mcore.testing.distributed import free_port

REPO = pathlib.Path(__file__).resolve().parents[1]
BACKEND_DOC = REPO / "docs" / "writing_a_backend.md"
ARCHITECTURE_DOC = REPO / "docs" / "architecture.md"


def code_blocks(path: pathlib.Path) -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced block, in order."""
    return re.findall(r"^```(\w+)\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M)


def _command(line: str) -> list[str]:
    """A ``bash`` line of the doc as this test's interpreter runs it (never a bare python/torchrun)."""
    words = shlex.split(line)
    if words[0] == "torchrun":
        words = [sys.executable, "-m", "torch.distributed.run", f"--master-port={free_port()}", *words[1:]]
    elif words[0] == "python":
        words = [sys.executable, *words[1:]]
    return [str(REPO / w) if w.startswith("examples/") else w for w in words]


def test_every_code_block_of_writing_a_backend_runs(tmp_path):
    blocks = code_blocks(BACKEND_DOC)
    assert [lang for lang, _ in blocks].count("python") >= 5
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for number, (lang, code) in enumerate(blocks, 1):
        if lang == "toml":
            continue  # checked against the example plugin below
        assert lang in ("bash", "python"), f"block {number}: no runner for {lang!r}"
        commands = (
            [_command(line) for line in code.splitlines() if line.strip()]
            if lang == "bash"
            else [[sys.executable, "-c", code]]
        )
        for argv in commands:
            proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, (
                f"block {number} ({lang}) failed:\n{code}\n{proc.stdout}\n{proc.stderr}"
            )


def test_the_dependency_the_doc_gives_is_the_distribution_name():
    toml = next(code for lang, code in code_blocks(BACKEND_DOC) if lang == "toml")
    ours = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["name"]
    example = tomllib.loads(
        (REPO / "examples/third_party_backend/pyproject.toml").read_text(encoding="utf-8")
    )
    assert ours == "mcore-train"
    assert any(d.startswith(ours) for d in tomllib.loads(toml)["project"]["dependencies"])
    assert ours in example["project"]["dependencies"]


def test_the_op_table_of_the_doc_is_the_registry_with_the_references_signatures():
    rows = re.findall(r"^\| `(\w+)` \| `\((.*?)\)` \|", BACKEND_DOC.read_text(encoding="utf-8"), flags=re.M)
    assert [name for name, _ in rows] == list(OP_NAMES), "the doc's op table must list OP_NAMES in order"
    for name, signature in rows:
        expected = []
        for param in inspect.signature(reference.REFERENCE_OPS[name]).parameters.values():
            if param.kind is param.KEYWORD_ONLY and "*" not in expected:
                expected.append("*")
            expected.append(param.name)
        assert signature == ", ".join(expected), (
            f"{name}: the doc says ({signature}), the reference ({expected})"
        )


# --- docs/architecture.md: what may import what -----------------------------------------------------


def layer_ranks() -> dict[str, int]:
    """The layer table of docs/architecture.md: package -> layer number."""
    ranks = {}
    for number, packages in re.findall(
        r"^\| (\d+) \| (.*?) \|", ARCHITECTURE_DOC.read_text(encoding="utf-8"), re.M
    ):
        for package in re.findall(r"`(mcore(?:\.\w+)?)`", packages):
            ranks[package] = int(number)
    return ranks


def core_imports() -> list[tuple[str, str, str]]:
    """``(importing package, imported mcore module, where)`` for every import in ``mcore/``."""
    found = []
    for path in sorted((REPO / "mcore").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        package = ".".join(parts[:2]) if len(parts) > 2 or parts[-1] != "__init__" else "mcore"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            modules = []
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            for module in modules:
                if module == "mcore" or module.startswith("mcore."):
                    found.append((package, module, f"{path.relative_to(REPO)}:{node.lineno}"))
    return found


def test_the_core_never_imports_backends_or_adaptors():
    offenders = [
        f"{where}: {module}"
        for _, module, where in core_imports()
        if module.split(".")[1:2] in (["backends"], ["adaptors"])
    ]
    assert not offenders, "mcore/ reaches backends/adaptors only through the plugin manager:\n" + "\n".join(
        offenders
    )


def test_each_package_imports_only_lower_layers():
    ranks = layer_ranks()
    assert len(ranks) >= 15 and ranks["mcore.training"] > ranks["mcore.models"] > ranks["mcore.backend"]
    packages = {".".join(p.relative_to(REPO).with_suffix("").parts[:2]) for p in (REPO / "mcore").iterdir()}
    packages -= {"mcore.__init__", "mcore.__pycache__"}
    assert packages <= set(ranks) | {"mcore.__main__"}, (
        f"not in docs/architecture.md: {packages - set(ranks)}"
    )
    offenders = []
    for package, module, where in core_imports():
        target = ".".join(module.split(".")[:2])
        if package == "mcore" or target == package or target not in ranks:
            continue
        if ranks[target] >= ranks[package]:
            offenders.append(
                f"{where}: {package} (layer {ranks[package]}) imports {module} (layer {ranks[target]})"
            )
    assert not offenders, "imports against docs/architecture.md's layers:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    ("package", "module", "allowed"),
    [("mcore.models", "mcore.training.pretrain", False), ("mcore.training", "mcore.models.gpt", True)],
)
def test_the_layer_rule_would_catch_an_upward_import(package, module, allowed):
    ranks = layer_ranks()
    assert (ranks[".".join(module.split(".")[:2])] < ranks[package]) is allowed
