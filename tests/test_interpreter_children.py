"""The background runner of Triton-interpreter children (mcore.testing.interpreter): a queued child's
output reaches its test, and a child that fails or runs past its timeout fails the test as a child
run in the foreground does."""

import os
import textwrap

import pytest

from mcore.testing import interpreter
from mcore.testing.interpreter import BackgroundChildren


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_queued_child_gives_its_output_with_the_interpreter_variables_set(tmp_path, monkeypatch):
    script = _script(
        tmp_path,
        """
        import os, sys
        print("args", sys.argv[1:], os.environ["TRITON_INTERPRET"], os.environ["OMP_NUM_THREADS"], os.nice(0))
        """,
    )
    runner = BackgroundChildren()
    monkeypatch.setattr(interpreter, "BACKGROUND", runner)
    runner.start([(script, ("x",), 60.0)])
    out = interpreter.run_under_interpreter(script, "x")
    assert out.strip() == "args ['x'] 1 1 19"  # the lowest priority, the same variables
    # a run that was not queued runs in the foreground, at the caller's priority
    assert interpreter.run_under_interpreter(script, "y").strip() == f"args ['y'] 1 1 {os.nice(0)}"


@pytest.mark.parametrize("queued", [True, False])
def test_a_failing_or_hanging_child_fails_its_test(tmp_path, monkeypatch, queued):
    failing = _script(tmp_path, "import sys\nprint('checked 3')\nsys.exit('a check DIFFERS')\n")
    runner = BackgroundChildren()
    monkeypatch.setattr(interpreter, "BACKGROUND", runner)
    if queued:
        runner.start([(failing, (), 60.0)])
    with pytest.raises(pytest.fail.Exception, match=r"(?s)exited 1.*checked 3.*a check DIFFERS"):
        interpreter.run_under_interpreter(failing)
    hanging = str(tmp_path / "hang.py")
    with open(hanging, "w") as f:
        f.write("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    if queued:
        runner.start([(hanging, (), 1.0)])
    with pytest.raises(pytest.fail.Exception, match=r"(?s)ran past its 1 s.*started"):
        interpreter.run_under_interpreter(hanging, timeout=1.0)
