"""The core stays vendor-free: hardware is reached only through the backend object."""

import pathlib
import re

import mcore

FORBIDDEN = re.compile(r"torch\.cuda|\.cuda\(|[\"']nccl[\"']|torch_npu")


def test_core_names_no_vendor():
    root = pathlib.Path(mcore.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if FORBIDDEN.search(line):
                offenders.append(f"{path.relative_to(root.parent)}:{number}: {line.strip()}")
    assert not offenders, "vendor names in mcore/ (move them into a backend):\n" + "\n".join(offenders)


def test_the_check_would_catch_each_form():
    for line in (
        "torch.cuda.synchronize()",
        "x.cuda()",
        "backend = 'nccl'",
        'b = "nccl"',
        "import torch_npu",
    ):
        assert FORBIDDEN.search(line), line
