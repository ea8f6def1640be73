"""HCCL settings: per-group ``ProcessGroupHCCL.Options`` and the HCCL environment defaults.

Two mechanisms, as torch_npu documents them:

* **Per-communicator options** (``hccl_config``) travel as ``pg_options`` of ``init_process_group`` /
  ``new_group``; they override the environment for that group. mcore asks for them through the
  ``process_group_options(axis)`` method of the NPU backend once per parallel axis. The buffer size of an
  axis comes, first match wins, from

  1. ``MCORE_HCCL_GROUP_BUFFER`` in MindSpeed's ``--hccl-group-buffer`` syntax, e.g.
     ``"tp:300;pp:200;dp:200"`` (MB per axis; axes: world, tp, pp, dp, cp, mp, embedding);
  2. the adaptive size MindSpeed's ``--hccl-group-buffer-adaptive`` would use for the activation
     axes (tp, pp, cp): ``ceil(micro_batch * seq_length * hidden * bytes_per_element / 2**20)`` MB,
     the reference's suggested LLM value, known once ``NPUBackend.configure`` has seen the model;
  3. nothing: HCCL's own default (``HCCL_BUFFSIZE``, else 200 MB).

* **Environment variables** HCCL reads when a communicator is created. :func:`hccl_env_defaults`
  computes what to set from the run's ``--distributed-timeout-minutes``; the NPU adaptor applies
  it right before torch.distributed is initialized. Values the user exported are never changed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

GROUP_BUFFER_ENV = "MCORE_HCCL_GROUP_BUFFER"
AXES = ("world", "tp", "pp", "dp", "cp", "mp", "embedding")
ACTIVATION_AXES = ("tp", "pp", "cp")

CONNECT_TIMEOUT_RANGE = (120, 7200)  # seconds, CANN envref_07_0077
EXEC_TIMEOUT_DEFAULT = 1836  # seconds on A2/A3 (envref_07_0078)
EVENT_TIMEOUT_MARGIN = 32  # torch_npu's defaults: HCCL_EVENT_TIMEOUT 1868 = 1836 + 32


def parse_group_buffer(spec: str) -> dict[str, int]:
    """Parse ``"tp:300;dp:200"`` (MindSpeed's ``--hccl-group-buffer``) into ``{"tp": 300, "dp": 200}``.

    Raises:
        ValueError: an unknown axis, a malformed entry, or a size below 1 MB (the message names it).
    """
    sizes: dict[str, int] = {}
    for entry in filter(None, (part.strip() for part in spec.split(";"))):
        axis, sep, value = entry.partition(":")
        axis = axis.strip()
        if not sep or axis not in AXES:
            raise ValueError(
                f"{GROUP_BUFFER_ENV}: bad entry {entry!r}; expected 'axis:MB' with axis in {', '.join(AXES)}"
            )
        try:
            size = int(value)
        except ValueError:
            raise ValueError(f"{GROUP_BUFFER_ENV}: {entry!r}: the size must be an integer (MB)") from None
        if size < 1:
            raise ValueError(f"{GROUP_BUFFER_ENV}: {entry!r}: the size must be at least 1 MB")
        sizes[axis] = size
    return sizes


def activation_buffer_mb(
    micro_batch_size: int, seq_length: int, hidden_size: int, bytes_per_element: int
) -> int:
    """The reference's suggested HCCL buffer (MB) for one activation exchange of ``[s, b, h]``."""
    return max(1, math.ceil(micro_batch_size * seq_length * hidden_size * bytes_per_element / 2**20))


@dataclass
class HCCLSettings:
    """What the NPU backend learned about this run (filled by ``NPUBackend.configure``)."""

    adaptive_mb: dict[str, int] = field(default_factory=dict)

    def configure(self, configs: Mapping[str, Any]) -> None:
        """Derive the adaptive activation buffer from the model/training/precision configs, if present."""
        model, training, precision = (configs.get(k) for k in ("model", "training", "precision"))
        mbs = getattr(training, "micro_batch_size", None)
        seq = getattr(model, "seq_length", None) or getattr(training, "seq_length", None)
        hidden = getattr(model, "hidden_size", None)
        if not all(isinstance(v, int) and v > 0 for v in (mbs, seq, hidden)):
            self.adaptive_mb = {}
            return
        half = getattr(precision, "bf16", False) or getattr(precision, "fp16", False)
        size = activation_buffer_mb(mbs, seq, hidden, 2 if half else 4)
        self.adaptive_mb = dict.fromkeys(ACTIVATION_AXES, size)

    def buffer_mb(self, axis: str, environ: Mapping[str, str] = os.environ) -> int | None:
        explicit = parse_group_buffer(environ.get(GROUP_BUFFER_ENV, ""))
        return explicit.get(axis, self.adaptive_mb.get(axis))


def process_group_options(torch_npu: ModuleType, axis: str, settings: HCCLSettings) -> Any:
    """``ProcessGroupHCCL.Options`` for ``axis``, or None when HCCL's defaults apply."""
    size = settings.buffer_mb(axis)
    if size is None:
        return None
    options = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options()
    options.hccl_config = {"hccl_buffer_size": int(size)}
    return options


def hccl_env_defaults(timeout_minutes: float, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The HCCL variables to set (only those the user left unset) for a run with this timeout.

    * ``HCCL_CONNECT_TIMEOUT``: link set-up. CANN's 120 s default is what fails multi-node starts with
      ``EI0006`` and torch_npu warns below 300 s; follow the run's own timeout, clamped to CANN's
      range [120, 7200] s (the default ``--distributed-timeout-minutes 10`` gives 600 s).
    * ``HCCL_EXEC_TIMEOUT``: a collective that waits longer kills the job on the device (``EI0002``).
      When the run's timeout is longer than the 1836 s default, raise it to match, so the device does
      not abort before torch's watchdog (the timeout the user asked for). Skipped in AIV expansion mode,
      whose range ends at 1091 s.
    * ``HCCL_EVENT_TIMEOUT`` must exceed ``HCCL_EXEC_TIMEOUT`` (CANN's rule): set with the same
      32 s margin as torch_npu's defaults whenever the exec timeout is raised.

    Raises:
        ValueError: a user-set value is outside CANN's range, or the event timeout does not exceed the
            exec timeout (the message names both).
    """
    timeout_s = int(round(timeout_minutes * 60))
    updates: dict[str, str] = {}
    connect = environ.get("HCCL_CONNECT_TIMEOUT")
    low, high = CONNECT_TIMEOUT_RANGE
    if connect is None:
        updates["HCCL_CONNECT_TIMEOUT"] = str(min(max(timeout_s, low), high))
    elif not (connect.isdigit() and low <= int(connect) <= high):
        raise ValueError(f"HCCL_CONNECT_TIMEOUT={connect} must be an integer in [{low}, {high}] seconds")

    aiv = environ.get("HCCL_OP_EXPANSION_MODE", "").upper() == "AIV"
    exec_timeout = environ.get("HCCL_EXEC_TIMEOUT")
    if exec_timeout is None and not aiv and timeout_s > EXEC_TIMEOUT_DEFAULT:
        exec_timeout = updates["HCCL_EXEC_TIMEOUT"] = str(timeout_s)
        if "HCCL_EVENT_TIMEOUT" not in environ:
            updates["HCCL_EVENT_TIMEOUT"] = str(timeout_s + EVENT_TIMEOUT_MARGIN)
    event_timeout = environ.get("HCCL_EVENT_TIMEOUT", updates.get("HCCL_EVENT_TIMEOUT"))
    if exec_timeout is not None and event_timeout is not None:
        exec_s, event_s = int(exec_timeout), int(event_timeout)
        if exec_s and event_s and event_s <= exec_s:  # 0 means "never"
            raise ValueError(
                f"HCCL_EVENT_TIMEOUT={event_s} must be greater than HCCL_EXEC_TIMEOUT={exec_s} "
                "(torch_npu's event wait must outlast HCCL's execution timeout)"
            )
    return updates


def apply_hccl_env_defaults(timeout_minutes: float, environ: MutableMapping[str, str] | None = None) -> dict:
    """Set :func:`hccl_env_defaults` in ``environ`` (``os.environ``); return what was set."""
    environ = os.environ if environ is None else environ
    updates = hccl_env_defaults(timeout_minutes, environ)
    environ.update(updates)
    return updates
