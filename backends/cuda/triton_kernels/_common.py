"""Shared helpers of the Triton kernels: device facts, block-size heuristics, dtype checks."""

from __future__ import annotations

import functools
import os

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton's CPU interpreter is active (kernels run on CPU tensors, for debugging without a GPU)."""

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small number under the interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def warps_for(elements: int, lo: int = 4, hi: int = 16) -> int:
    """Warps for a tile of ``elements``: about 16 elements a thread, between ``lo`` and ``hi`` warps."""
    warps = elements // (32 * 16)
    return int(min(hi, max(lo, next_pow2(warps) if warps > 0 else lo)))


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with a unit stride on the last dim (a view when possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


AUTOTUNE_MIN_ROWS = 4096
"""Backward kernels of a persistent grid tune their block shape and grid size at the first call
with at least this many rows (per row width and dtypes; results cached on disk by Triton); smaller
calls, and ``MCORE_TRITON_AUTOTUNE=0``, use the fixed heuristic."""

_TUNERS: dict = {}


def use_autotune(rows: int) -> bool:
    return not INTERPRET and rows >= AUTOTUNE_MIN_ROWS and os.environ.get("MCORE_TRITON_AUTOTUNE", "1") != "0"


def _as_triton_config(cfg: dict) -> triton.Config:
    kwargs = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    return triton.Config(kwargs, num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3))


_LAUNCHES: dict = {}


def cached_launch(key, build):
    """The :class:`GridLaunch` for ``key``, built once by ``build()``.

    A launch depends only on the kernel, its shapes and the device, which never change between the
    steps of a training run, and building one (the config list, the autotuner lookup, the largest
    partial-sum count over every config) costs tens of microseconds of host time: per call, that was
    a measurable part of a small model's step. ``key`` must hold everything ``build`` reads.
    """
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _LAUNCHES[key] = build()
    return launch


class GridLaunch:
    """One launch of a kernel whose grid (and partial-sum buffer) depends on its block config.

    ``grid(cfg)`` gives the launch grid and ``parts(cfg)`` the rows of partial sums that a config
    writes. With an explicit ``config`` (the benchmark's sweep) that one runs; with many rows an
    autotuner picks among ``configs`` (one tuner per kernel and ``tag``, keyed on ``key`` args);
    otherwise ``default`` runs. :attr:`max_parts` sizes the partial buffer before the launch and
    the call returns the rows the chosen config wrote.
    """

    def __init__(
        self, kernel, tag, rows: int, configs: list[dict], default: dict, key, grid, parts, config=None
    ):
        self.grid_of, self.parts_of = grid, parts
        self.tuner = None
        if config is not None:
            self.configs = [{**default, **config}]
        elif use_autotune(rows) and len(configs) > 1:
            self.configs = configs
            tkey = (kernel, tag)
            if tkey not in _TUNERS:
                _TUNERS[tkey] = triton.autotune([_as_triton_config(c) for c in configs], key=list(key))(
                    kernel
                )
            self.tuner = _TUNERS[tkey]
        else:
            self.configs = [default]
        self.kernel = kernel
        self.max_parts = max(parts(c) for c in self.configs)

    def __call__(self, *args, **constexprs) -> int:
        if self.tuner is not None:
            self.tuner[lambda meta: self.grid_of(meta)](*args, **constexprs)
            return self.parts_of(self.tuner.best_config.kwargs)
        cfg = self.configs[0]
        self.kernel[self.grid_of(cfg)](*args, **constexprs, **cfg)
        return self.parts_of(cfg)
