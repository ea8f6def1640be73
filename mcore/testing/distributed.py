"""Run a function in N real processes (gloo on CPU by default): the harness of every distributed test.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes that rendezvous through
``torch.distributed`` (env:// on a free localhost port), runs ``fn(*args)`` in each, and returns the
list of per-rank return values. An exception on any rank is re-raised in the caller as
:class:`DistributedTestError` naming the rank and carrying its traceback; a rank that hangs past
``timeout`` is killed and reported by number.

``fn`` must be importable by name (a module-level function) because processes are started with the
``forkserver`` method: a server process imports torch once and forks each rank from it, which is fast
and safe (no OpenMP or thread state inherited from the test process).

Each rank sets one thread per process (the CI machine has 2 cores) and selects the device backend
named by ``backend`` (``MCORE_TEST_BACKEND`` overrides it, so the same tests run on a GPU machine with
``MCORE_TEST_BACKEND=cuda``).
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

# Imported once by the forkserver, so that each rank of each launch forks with them loaded instead of
# importing them again (about half a second per rank on the 2-core CI machine, for ~200 launches). No
# mcore module reads the environment or selects a backend at import time, so a rank sees the same
# state as if it imported them itself; a name that fails to import is skipped by the forkserver.
_FORKSERVER_PRELOAD = [
    "torch",
    "mcore.backend",
    "mcore.distributed.groups",
    "pytest",
    "mcore.training.pretrain",
    "mcore.training.gpt",
    "mcore.training.bert",
    "mcore.training.t5",
    "mcore.checkpoint.load",
    "mcore.checkpoint.save",
    "mcore.inference.generate",
]


class DistributedTestError(AssertionError):
    """A rank of a distributed test failed, or did not finish in time."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_backend_name(default: str = "cpu") -> str:
    """The backend tests run on: ``MCORE_TEST_BACKEND`` or ``default``."""
    return os.environ.get("MCORE_TEST_BACKEND", default)


def _function_ref(fn: Callable) -> tuple[str, str, str | None]:
    """Name a module-level function so a fresh process can import it (also from a test file
    that pytest imported by path, which a plain ``import`` in the child could not find)."""
    module = sys.modules.get(fn.__module__)
    return fn.__module__, fn.__qualname__, getattr(module, "__file__", None)


def _load_function(ref: tuple[str, str, str | None]) -> Callable:
    module_name, qualname, path = ref
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        if path is None:
            raise
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    target = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _rank_main(
    fn_ref, args, kwargs, rank, world_size, port, backend_name, results, setup_ref=None, stdio=None
) -> None:
    if stdio is not None:
        # The caller's stdout/stderr as they are now: the forkserver (and so every rank it forks)
        # kept the ones of the first run_distributed call of the process, which a later pytest
        # capture (capfd) no longer reads.
        for target, handle in zip((1, 2), stdio):
            fd = handle.detach()
            os.dup2(fd, target)
            os.close(fd)
    # The start method a freshly launched interpreter has (a torchrun or srun rank: "fork" on Linux up
    # to Python 3.13), not the forkserver this rank came from, which it inherits: a DataLoader's
    # --num-workers workers would otherwise each start through a new forkserver of this rank and
    # import torch and mcore again (~5 s per loader on the 2-core CI machine, for nothing a real
    # rank does).
    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        from mcore.plugins.manager import select_backend

        fn = _load_function(fn_ref)
        if setup_ref is not None:
            _load_function(setup_ref)()
        backend = select_backend(backend_name)
        backend.set_device(rank)
        dist.init_process_group(backend.dist_backend, rank=rank, world_size=world_size)
        try:
            value = fn(*args, **kwargs)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as err:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def skip_without_devices(world_size: int, backend_name: str | None = None) -> None:
    """Skip (pytest) a run on the accelerator that ``MCORE_TEST_BACKEND`` names when the machine has
    fewer devices than ranks: collective libraries refuse two ranks on one device. CPU runs (gloo,
    simulated devices) never skip. ``backend_name``: the run's backend (default: the test backend).
    :func:`run_distributed` calls it; a test that launches its ranks itself calls it first."""
    import torch

    backend_name = backend_name or test_backend_name()

    if backend_name == "cpu" or os.environ.get("MCORE_TEST_BACKEND") != backend_name:
        return
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return
    count = accelerator.device_count()
    if count < world_size:
        import pytest

        pytest.skip(
            f"needs {world_size} {backend_name} devices for {world_size} ranks; this machine has {count}"
        )


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    backend: str | None = None,
    timeout: float = 180.0,
    rank_setup: Callable[[], Any] | None = None,
    **kwargs,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``rank_setup``, a module-level function, runs in each rank before the backend is selected (for
    instance installing a simulated device module that a plugin's availability check needs).
    """
    backend_name = backend or test_backend_name()
    skip_without_devices(world_size, backend_name)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_FORKSERVER_PRELOAD)
    results = context.Queue()
    port = free_port()
    procs = [
        context.Process(
            target=_rank_main,
            args=(
                _function_ref(fn),
                args,
                kwargs,
                r,
                world_size,
                port,
                backend_name,
                results,
                None if rank_setup is None else _function_ref(rank_setup),
                (reduction.DupFd(1), reduction.DupFd(2)),
            ),
            # Not daemonic: a rank may start DataLoader workers (--num-workers), which daemonic
            # processes cannot; the ``finally`` below kills every rank still alive.
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise DistributedTestError(f"ranks {missing} did not finish within {timeout:.0f}s")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcomes]
                if dead and all(not procs[r].is_alive() for r in dead):
                    # Give the queue a moment: a rank that exited normally may still be flushing.
                    time.sleep(0.5)
                    if results.empty():
                        codes = {r: procs[r].exitcode for r in dead}
                        raise DistributedTestError(
                            f"ranks {dead} exited without a result (exit codes {codes})"
                        ) from None
                continue
            outcomes[rank] = (ok, payload)
            if not ok:
                break
    finally:
        for p in procs:
            p.join(timeout=0 if any(not ok for ok, _ in outcomes.values()) else 5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    failures = {r: payload for r, (ok, payload) in outcomes.items() if not ok}
    if failures:
        rank = min(failures)
        raise DistributedTestError(f"rank {rank} of {world_size} failed:\n{failures[rank]}")
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]
