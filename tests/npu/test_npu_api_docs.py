"""The simulated torch_npu takes exactly the real API: every simulated op has the real op's parameter
names, in the real order, keyword-only where the real one is, and the NPU backend calls ops by those
names. A call that passes the simulator with a parameter the real op lacks would pass CI and fail on
every real NPU.

The reference is the real wheel, read offline from ``.ci/wheels`` (``.ci/run`` downloads it): the
documented signature in ``torch_npu/_op_plugin_docs.py``, else (an op the docs leave out) the registered
schema in ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``. Where the schema registers more
than the docs state (``npu_fusion_attention``'s ``sink``/``dropout_mask``/``seed``/``offset``, documented
for ``npu_fusion_attention_v2`` only), the docs decide: the simulator accepts only what is documented.
Every ``npu_*`` op of the simulated module is held to it, the MoE and context-parallel ones to come too.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WHEEL_GLOB = "torch_npu-2.13.0-*.whl"
DOCS = "torch_npu/_op_plugin_docs.py"
SCHEMAS = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"


@pytest.fixture(scope="module")
def real_api() -> dict[str, str]:
    wheels = sorted((REPO / ".ci" / "wheels").glob(WHEEL_GLOB))
    if not wheels:
        if os.environ.get("MCORE_SKIP_NPU_API_DOCS") == "1":
            pytest.skip("the torch_npu wheel is missing and MCORE_SKIP_NPU_API_DOCS=1 (a non-CI run)")
        pytest.fail(
            f".ci/wheels/{WHEEL_GLOB} is missing: .ci/run downloads it (pip download torch-npu==2.13.0 "
            "--no-deps -d .ci/wheels); set MCORE_SKIP_NPU_API_DOCS=1 to skip this test outside CI"
        )
    with zipfile.ZipFile(wheels[-1]) as zf:
        return {"docs": zf.read(DOCS).decode("utf-8"), "schemas": zf.read(SCHEMAS).decode("utf-8")}


def _split(params: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in params:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in [*out, cur] if p.strip()]


def _parse(params: str) -> list[tuple[str, bool]]:
    """``[(name, keyword_only)]`` of ``"Tensor x, int? y=None, *, z=0"`` (typed or untyped)."""
    parsed, keyword_only = [], False
    for p in _split(params):
        if p == "*":
            keyword_only = True
            continue
        parsed.append((p.split("=")[0].split()[-1], keyword_only))
    return parsed


def real_signature(api: dict[str, str], op: str) -> tuple[str, list[tuple[str, bool]]] | None:
    documented = re.search(rf"^(?:torch_npu\.)?{op}\((.*)\)\s*->", api["docs"], re.M)
    if documented:
        return DOCS, _parse(documented.group(1))
    registered = re.search(rf"^\s*-?\s*func: {op}\((.*)\)\s*->", api["schemas"], re.M)
    if registered:
        return SCHEMAS, _parse(registered.group(1))
    return None


def simulated_ops() -> dict:
    """Every ``npu_*`` op the simulated ``torch_npu`` module offers (whichever module defines it)."""
    from backends.npu.simulated import simulated_torch_npu

    with simulated_torch_npu() as torch_npu:
        return {name: getattr(torch_npu, name) for name in dir(torch_npu) if name.startswith("npu_")}


def test_every_simulated_op_has_the_real_signature(real_api):
    problems = []
    ops = simulated_ops()
    assert "npu_fusion_attention" in ops and "npu_rms_norm" in ops
    for op, fn in sorted(ops.items()):
        real = real_signature(real_api, op)
        if real is None:
            problems.append(f"{op}: neither documented nor registered in the real torch_npu")
            continue
        source, expected = real
        params = inspect.signature(fn).parameters.values()
        simulated = [(p.name, p.kind == p.KEYWORD_ONLY) for p in params]
        if simulated != expected:
            problems.append(f"{op}: simulated {simulated}\n    real ({source}) {expected}")
    assert not problems, "\n".join(problems)


def test_the_backend_calls_ops_by_their_real_parameter_names(real_api):
    problems = []
    for path in sorted((REPO / "backends" / "npu").rglob("*.py")):
        if "simulated" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            op = node.func.attr
            if not op.startswith("npu_") or not isinstance(node.func.value, ast.Name):
                continue
            real = real_signature(real_api, op)
            if real is None:
                problems.append(f"{path.name}:{node.lineno}: {op} is not a real torch_npu op")
                continue
            names = [name for name, _ in real[1]]
            for kw in node.keywords:
                if kw.arg is not None and kw.arg not in names:
                    problems.append(
                        f"{path.name}:{node.lineno}: {op}({kw.arg}=...): the real op has no {kw.arg}"
                    )
            if len(node.args) > sum(1 for _, kw_only in real[1] if not kw_only):
                problems.append(
                    f"{path.name}:{node.lineno}: {op}: more positional arguments than the real op"
                )
    assert not problems, "\n".join(problems)


def test_the_reference_is_read_and_strict(real_api):
    """The parser reads both sources (a signature that parsed to nothing would pass everything)."""
    assert real_signature(real_api, "npu_rms_norm") == (
        DOCS,
        [("self", False), ("gamma", False), ("epsilon", False)],
    )
    source, fusion = real_signature(real_api, "npu_fusion_attention")
    assert source == DOCS and "sink" not in dict(fusion) and fusion[:2] == [("query", False), ("key", False)]
    assert real_signature(real_api, "npu_gelu") == (SCHEMAS, [("self", False), ("approximate", True)])
