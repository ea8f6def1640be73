"""The core stays vendor-free: hardware is reached only through the backend object.

The check reads every module of the source ``mcore/`` folder as Python syntax (``ast``), not as
text, so a comment or a docstring that names a vendor passes and code that reaches one fails:

* no import of a vendor library: ``triton``, ``torch_npu``, ``apex``, ``transformer_engine``,
  ``flash_attn`` (``import``, ``from ... import``, ``importlib.import_module("...")``,
  ``__import__("...")``);
* no vendor device module or method: ``torch.cuda``, ``torch.npu``, ``x.cuda()``, ``x.npu()``;
* no string literal that is a vendor device or collective library: ``"cuda"``, ``"npu"``,
  ``"nccl"``, ``"hccl"`` (also ``"cuda:0"``); the backend object carries these names.

Flag spellings that Megatron users know (``--cuda-graph-impl``) are not device names and pass.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

CORE = pathlib.Path(__file__).resolve().parents[1] / "mcore"

VENDOR_LIBRARIES = frozenset({"triton", "torch_npu", "apex", "transformer_engine", "flash_attn"})
VENDOR_DEVICE_ATTRIBUTES = frozenset({"cuda", "npu"})
VENDOR_LITERAL = re.compile(r"(cuda|npu)(:\d+)?|nccl|hccl", re.IGNORECASE)


def _imported_module(node: ast.AST) -> list[str]:
    """Top-level module names a node imports."""
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module.split(".")[0]]
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
            return [node.args[0].value.split(".")[0]]
    return []


def vendor_uses(source: str, filename: str = "<string>") -> list[str]:
    """``"line: what"`` for every vendor reference in ``source`` (Python code)."""
    tree = ast.parse(source, filename)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        for module in _imported_module(node):
            if module in VENDOR_LIBRARIES:
                found.append(f"{line}: imports {module}")
        if isinstance(node, ast.Attribute) and node.attr in VENDOR_DEVICE_ATTRIBUTES:
            if isinstance(node.value, ast.Name) and node.value.id == "torch":
                found.append(f"{line}: torch.{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in VENDOR_DEVICE_ATTRIBUTES:
                found.append(f"{line}: .{node.func.attr}() moves a tensor to a vendor device")
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if VENDOR_LITERAL.fullmatch(node.value.strip()):
                found.append(f"{line}: the literal {node.value!r}")
    return found


def core_modules() -> list[pathlib.Path]:
    return sorted(CORE.rglob("*.py"))


def test_core_names_no_vendor():
    assert len(core_modules()) > 50
    offenders = []
    for path in core_modules():
        for use in vendor_uses(path.read_text(encoding="utf-8"), str(path)):
            offenders.append(f"{path.relative_to(CORE.parent)}:{use}")
    assert not offenders, "vendor names in mcore/ (move them into a backend):\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "code",
    [
        "import triton",
        "import triton.language as tl",
        "from torch_npu.contrib import transfer_to_npu",
        "import apex.optimizers",
        "from transformer_engine.pytorch import Linear",
        "from flash_attn import flash_attn_func",
        "importlib.import_module('torch_npu')",
        "__import__('flash_attn')",
        "torch.cuda.synchronize()",
        "stream = torch.npu.current_stream()",
        "x = x.cuda()",
        "x.npu(non_blocking=True)",
        "backend = 'nccl'",
        'b = "HCCL"',
        "if device.type == 'cuda': pass",
        "torch.device('cuda:0')",
        "def f(kind='npu'): pass",
    ],
)
def test_the_check_catches_each_form(code):
    assert vendor_uses(code), code


@pytest.mark.parametrize(
    "code",
    [
        '"""Docstring naming torch.cuda, NCCL and torch_npu: prose is allowed."""',
        "# a comment: x.cuda(), import triton",
        "flag = '--cuda-graph-impl'",
        "message = f'--cuda-graph-impl local needs {what}'",
        "from mcore.backend import current_backend",
        "caps = backend.capabilities()",
        "device_type = backend.device_type",
    ],
)
def test_the_check_lets_prose_flags_and_the_backend_object_pass(code):
    assert not vendor_uses(code), code
