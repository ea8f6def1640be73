"""Shared helpers of the Triton kernels: device facts, block-size heuristics, dtype checks."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton's CPU interpreter is active (kernels run on CPU tensors, for debugging without a GPU)."""

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fix_interpreter_index() -> None:
    """Let the interpreter use run-time scalars as ``range`` bounds under NumPy >= 2.4.

    The interpreter holds a scalar as a one-element 1-d array and converts it for ``range`` with
    ``int(array)``, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted"): every
    kernel that loops up to a program id or a kernel argument failed under ``TRITON_INTERPRET=1``.
    Wraps the interpreter's tensor patching so that ``__index__`` reads the single element instead.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - layout of another Triton version
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_mcore_index_fix", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._mcore_index_fix = True
    interpreter._patch_lang_tensor = patched


if INTERPRET:
    _fix_interpreter_index()


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
            # The first call tunes (or finds Triton's cached choice for) this launch's shape; later
            # calls launch that config directly: the autotuner's per-call bookkeeping costs host time
            # on every step, and a launch object serves one shape.
            self.tuner[lambda meta: self.grid_of(meta)](*args, **constexprs)
            best = self.tuner.best_config
            self.configs = [{**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}]
            self.tuner = None
            self.max_parts = self.parts_of(best.kwargs)
            return self.max_parts
        cfg = self.configs[0]
        self.kernel[self.grid_of(cfg)](*args, **constexprs, **cfg)
        return self.parts_of(cfg)


# --- persistent grids and partial sums ------------------------------------------------------------


def balanced_programs(blocks: int, cap: int) -> int:
    """Programs for ``blocks`` units of work, at most ``cap``, each doing the same number of steps.

    ``min(blocks, cap)`` programs leave a ragged last step (8192 rows over 264 programs: 8 programs
    take a 32nd row while 256 wait), which costs a whole step at a fraction of the bandwidth; the
    fewest programs that need no more steps than ``cap`` does (256 here) split the work evenly.
    """
    rounds = triton.cdiv(blocks, max(1, cap))
    return max(1, triton.cdiv(blocks, rounds))


@triton.jit
def row_range(pid, nprog, M, BLOCK_M: tl.constexpr, STRIDED: tl.constexpr):
    """Rows of program ``pid`` of ``nprog``, as ``range(lo, hi, step)`` over ``BLOCK_M``-row blocks.

    ``STRIDED``: blocks ``pid, pid + nprog, ...`` (all programs move through the rows together);
    else a contiguous share (+-1 block) of the rows.
    """
    if STRIDED:
        lo = pid * BLOCK_M
        hi = (pid * 0 + M).to(tl.int32)  # M may be a constexpr (Triton specialises M == 1)
        step = nprog * BLOCK_M
    else:
        pid = pid.to(tl.int64)
        nprog = nprog.to(tl.int64)
        blocks = (M + BLOCK_M - 1) // BLOCK_M
        lo = ((pid * blocks // nprog) * BLOCK_M).to(tl.int32)
        hi = tl.minimum((pid + 1) * blocks // nprog * BLOCK_M, M).to(tl.int32)
        step = BLOCK_M
    return lo, hi, step


@triton.jit
def _sum_partials_kernel(PART, OUT0, OUT1, P, N, stride_set, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """``OUT{k}[cols] = sum(PART[k, :P, cols])`` in fp32, stored in ``OUT{k}``'s dtype (k = axis 1)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    which = tl.program_id(1)
    base = PART + which.to(tl.int64) * stride_set
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):  # one step when P <= BLOCK_P: all loads in flight at once
        r = p0 + tl.arange(0, BLOCK_P)
        mask = (r < P)[:, None] & cmask[None, :]
        acc += tl.load(base + r[:, None] * N + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if which == 0:
        tl.store(OUT0 + cols, total.to(OUT0.dtype.element_ty), mask=cmask)
    else:
        tl.store(OUT1 + cols, total.to(OUT1.dtype.element_ty), mask=cmask)


SUM_BLOCK_N = 16
"""Columns a program of :func:`sum_partials` sums (64-byte row segments)."""


def sum_partials(part: torch.Tensor, parts: int, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Finish persistent column sums: ``part[k, :parts].sum(0)`` as ``dtypes[k]``, one small launch.

    ``part`` is ``[sets, rows, N]`` fp32 (contiguous; ``sets`` = ``len(dtypes)``, 1 or 2: e.g. the
    weight and bias gradients), of which the first ``parts`` rows of each set were written. The
    rows are summed in a fixed order (deterministic) and each result is cast in the same kernel,
    so a backward's parameter gradients cost one launch whatever their count and dtypes. The
    partials were just written (in L2): each program loads all its ``[parts, 16]`` column slice at
    once (up to 512 rows a step), so the launch costs about one L2 round trip.
    """
    sets, _, n = part.shape
    outs = [torch.empty((n,), dtype=dt, device=part.device) for dt in dtypes]
    block_n = SUM_BLOCK_N
    block_p = min(512, next_pow2(parts))
    grid = (triton.cdiv(n, block_n), sets)
    _sum_partials_kernel[grid](
        part, outs[0], outs[-1], parts, n, part.stride(0), BLOCK_P=block_p, BLOCK_N=block_n,
        num_warps=max(1, min(8, block_p * block_n // 1024)),
    )  # fmt: skip
    return outs


def tile_config(n: int, config: dict | None, max_n: int = 2048, elements: int = 2048) -> dict:
    """Tiles of an element-wise kernel over ``[M, n]`` rows: ``BLOCK_N`` along the row (at most
    ``max_n``), ``BLOCK_M`` rows to make ``elements``, warps by size; ``config`` overrides."""
    # Measured on H100 (benchmarks/kernels --sweep): 2048-element tiles along the row, 8 warps.
    block_n = min(next_pow2(n), max_n)
    cfg = {"BLOCK_N": block_n, "BLOCK_M": max(1, elements // block_n)}
    cfg.update(config or {})
    cfg.setdefault("num_warps", int(min(8, max(1, cfg["BLOCK_M"] * cfg["BLOCK_N"] // 256))))
    return cfg
