"""Library code logs, entry points show the records: ``mcore/`` prints only the command-line tools'
own results, and a run's console lines (iteration lines, errors) are ``mcore`` log records that
:func:`mcore.utils.console.configure_console` shows on the streams a Megatron user reads."""

from __future__ import annotations

import ast
import logging
import pathlib

import pytest

from mcore.utils.console import ConsoleHandler, configure_console

MCORE = pathlib.Path(__file__).resolve().parents[1] / "mcore"

# The command-line tools' own output (their results, progress and errors): printing is their job.
CLI_PRINTS = {
    ("distributed/launcher.py", "main"),  # mcore-run's one line for a failed job
    ("data/preprocess.py", "main"),
    ("data/preprocess.py", "add"),  # --log-interval progress lines of mcore-preprocess-data
    ("data/merge.py", "main"),
    ("checkpoint/inspect.py", "main"),
    ("checkpoint/inspect.py", "say"),  # mcore-inspect-checkpoint's report
    ("checkpoint/megatron/write.py", "main"),
    ("hf/export.py", "run_conversion"),  # the report or error of mcore-export-hf / mcore-import-hf
    ("hf/importer.py", "main"),
    ("inference/generate.py", "main"),
}


def _prints(path: pathlib.Path) -> list[tuple[str, int]]:
    """``(enclosing function, line)`` of every ``print(...)`` call in ``path``."""
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            name = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = child.name
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "print":
                found.append((function, child.lineno))
            visit(child, name)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_library_code_logs_instead_of_printing():
    stray = [
        f"{rel}:{line} (in {function})"
        for path in sorted(MCORE.rglob("*.py"))
        for rel in [path.relative_to(MCORE).as_posix()]
        for function, line in _prints(path)
        if (rel, function) not in CLI_PRINTS
    ]
    assert stray == [], "print() in library code (use logging.getLogger(__name__)): " + ", ".join(stray)


@pytest.fixture
def fresh_mcore_logger():
    """The ``mcore`` logger without handlers or level, restored afterwards."""
    logger = logging.getLogger("mcore")
    saved = logger.handlers[:], logger.level
    logger.handlers, logger.level = [], logging.NOTSET
    yield logger
    logger.handlers, logger.level = saved


def test_info_goes_to_stdout_and_warnings_and_errors_to_stderr(fresh_mcore_logger, capsys):
    configure_console()
    configure_console()  # idempotent: one handler
    assert [type(h) for h in fresh_mcore_logger.handlers] == [ConsoleHandler]
    logging.getLogger("mcore.training.metrics").info(" iteration        1/      10 |")
    logging.getLogger("mcore.hf.export").warning("warning: no tokenizer")
    logging.getLogger("mcore.training.pretrain").error("error: --lr is required")
    logging.getLogger("mcore.data.gpt_dataset").debug("built indices")  # a detail: not shown
    out, err = capsys.readouterr()
    assert out == " iteration        1/      10 |\n"
    assert err == "warning: no tokenizer\nerror: --lr is required\n"


def test_a_handler_of_the_user_replaces_the_console(fresh_mcore_logger, capsys):
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    fresh_mcore_logger.addHandler(Keep())
    configure_console()  # the user's choice stands
    logging.getLogger("mcore.training.metrics").info("a line")
    assert records == ["a line"] and capsys.readouterr().out == ""


def test_a_run_s_lines_are_log_records(caplog, capsys):
    """The iteration line and the "why training stopped" line of a real run reach logging (a user can
    add timestamps or a file) and, as before, stdout."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "checkpoint"))
    from ckpt_runs import train

    caplog.set_level(logging.INFO, logger="mcore")
    result = train(["--train-iters", "3", "--log-interval", "1", "--exit-interval", "2"])
    assert result["iteration"] == 2
    by_logger = {(r.name, r.getMessage().split("|")[0].strip()) for r in caplog.records}
    assert ("mcore.training.metrics", "iteration        2/       3") in by_logger, by_logger
    stopped = [r for r in caplog.records if "--exit-interval 2 reached" in r.getMessage()]
    assert stopped and stopped[0].name == "mcore.training.trainer"
    out = capsys.readouterr().out
    assert " iteration        2/       3 |" in out and stopped[0].getMessage() in out
