"""Read small device values on the host without waiting for the whole device.

``tensor.item()``, ``.tolist()``, ``float(tensor)`` and ``bool(tensor)`` on a device tensor wait until
the device has run *everything* queued so far: the host stops issuing work, and the device idles from
the moment its queue runs dry until the host has issued the next kernels (about 4 ms per such wait in a
GPT step on an H100). A training step needs a few scalars on the host (losses, the gradient norm, NaN
flags), but rarely at once. :func:`stage_to_host` queues the copy of a value to host memory behind the
work that produces it and records an event there; :meth:`HostValue.wait` later waits for that event
only, which has usually passed by then (read the value one step later, or at a log interval)::

    staged = stage_to_host(grad_norm)     # nothing waits
    ...                                   # issue the next step
    norm = staged.item()                  # waits for the event only (long passed)

Backend-neutral: the copy is ``tensor.to("cpu", non_blocking=True)`` (CUDA and PrivateUse1 devices
such as NPUs return pinned host memory for it, so the copy is asynchronous) and the event is torch's
device-generic :class:`torch.Event`, recorded on the device's current stream. CPU tensors have nothing
to wait for: the value is copied at once. A device type without events falls back to a blocking copy
(correct, but a full wait).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch


def _current_stream(device: torch.device):
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "current_stream"):
        return accelerator.current_stream(device)
    return torch.get_device_module(device.type).current_stream(device)


class HostValue:
    """A value on its way from the device to host memory (see :func:`stage_to_host`)."""

    __slots__ = ("_host", "_event", "_source")

    def __init__(self, host: torch.Tensor, event=None, source: torch.Tensor | None = None):
        self._host = host
        self._event = event
        self._source = source  # keeps the device tensor alive until the copy has run

    def ready(self) -> bool:
        """Whether the value has arrived (never waits)."""
        if self._event is None:
            return True
        if self._event.query():
            self._event = self._source = None
            return True
        return False

    def wait(self) -> torch.Tensor:
        """The value as a CPU tensor, waiting for its event only (not for the rest of the device's work)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = self._source = None
        return self._host

    def tolist(self):
        return self.wait().tolist()

    def item(self) -> float | int | bool:
        return self.wait().item()


def stage_to_host(tensor: torch.Tensor) -> HostValue:
    """Start copying ``tensor`` (small: a few scalars) to host memory; read it later with
    :meth:`HostValue.wait` / :meth:`~HostValue.tolist` / :meth:`~HostValue.item`.

    The copy is a snapshot taken in the order of the device's current stream: later in-place changes of
    ``tensor`` do not show in it.
    """
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return HostValue(tensor.clone())
    try:
        event = torch.Event(device=tensor.device)
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):
        return HostValue(tensor.to("cpu"))  # no events on this device type: a blocking copy
    host = tensor.to("cpu", non_blocking=True)
    event.record(_current_stream(tensor.device))
    return HostValue(host, event, tensor)


def host_floats(values: Sequence[float | int | torch.Tensor | HostValue | None]) -> list[float | None]:
    """Python floats of a mix of numbers, ``None``, one-element tensors and :class:`HostValue` s, with
    one copy (and one wait) per device for all the device tensors among them."""
    out: list[float | None] = [None] * len(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, value in enumerate(values):
        if value is None:
            continue
        if isinstance(value, HostValue):
            out[i] = float(value.item())
        elif isinstance(value, torch.Tensor):
            if value.device.type == "cpu":
                out[i] = float(value.item())
            else:
                by_device.setdefault(value.device, []).append(i)
        else:
            out[i] = float(value)
    for indices in by_device.values():
        dtype = functools.reduce(torch.promote_types, (values[i].dtype for i in indices))
        stacked = torch.stack([values[i].detach().reshape(()).to(dtype) for i in indices])
        for i, v in zip(indices, stacked.tolist()):
            out[i] = v
    return out
