"""The console of a run: library code logs, entry points show the records as plain lines.

Code in ``mcore/`` reports through ``logging.getLogger(__name__)`` and never prints (a library that
prints cannot be silenced, redirected or timestamped by its user). The entry points (``pretrain``,
``parse_run_config``, the ``mcore-*`` command lines) call :func:`configure_console`, which shows the
``mcore`` loggers' records the way the ``print`` s before them did: the message alone, INFO on stdout (the iteration
lines, the timers block, the checkpoint lines, the "why training stopped" line, Megatron's
``WARNING: ...`` notes of ``print_rank_0``), WARNING and above on stderr (a converter's warnings, the
one-line user errors). Which rank speaks is the caller's choice, as with Megatron's
``print_rank_0``. The streams are looked up at each record, so a redirected or captured
``sys.stdout``/``sys.stderr`` is honoured.

To add timestamps, or send the lines elsewhere, configure the ``mcore`` logger before the run (a
handler of your own on it replaces this one); ``logging.getLogger("mcore").setLevel(logging.WARNING)``
silences the progress lines. The records also reach the root logger's handlers, as usual. Details
(the dataset index cache) are DEBUG records: ``logging.getLogger("mcore.data").setLevel(logging.DEBUG)``.
"""

from __future__ import annotations

import logging
import sys

ROOT = "mcore"


class ConsoleHandler(logging.Handler):
    """Writes each record's message alone: WARNING and above to ``sys.stderr``, the rest to ``sys.stdout``,
    flushed at once (the lines interleave with other ranks' and with the launcher's)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's contract: a broken stream must not end the run
            self.handleError(record)


def configure_console(level: int = logging.INFO) -> None:
    """Show the ``mcore`` loggers' records on the console (see the module docstring). Idempotent; a
    no-op when the user gave the ``mcore`` logger a handler of their own."""
    logger = logging.getLogger(ROOT)
    if logger.handlers:
        return
    logger.addHandler(ConsoleHandler())
    if logger.level == logging.NOTSET:
        logger.setLevel(level)
