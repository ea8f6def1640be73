"""Shared pytest set-up: one thread per process (CI has 2 cores) and a clean backend per test."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _reset_backend():
    """Tests that select a backend or register plugins must not leak them into the next test."""
    from mcore.backend import set_current_backend
    from mcore.plugins import manager

    saved_manager, saved_pref = manager._state.manager, manager._state.preferred
    previous = set_current_backend(None)
    set_current_backend(previous)
    yield
    set_current_backend(previous)
    manager._state.manager, manager._state.preferred = saved_manager, saved_pref


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "interpreter_child(*args, timeout=600): the test runs its module under Triton's interpreter "
        "with these arguments (mcore.testing.interpreter); the child starts in the background after collection",
    )
    config.addinivalue_line(
        "markers",
        "exclusive: the test times something or waits on deadlines: under pytest-xdist no other test runs "
        "meanwhile (mcore.testing.exclusive)",
    )
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and config.option.basetemp:
        from mcore.testing.exclusive import WorkerLock

        # The workers' --basetemp are <session basetemp>/popen-gwN: the parent is shared by them.
        config.stash[_WORKER_LOCK] = WorkerLock(os.path.dirname(os.path.abspath(config.option.basetemp)))


# Files whose tests time something or wait on deadlines (heartbeats, torchrun's grace period, logged
# iterations before a bound): each test of them carries the ``exclusive`` mark.
_EXCLUSIVE_FILES = (
    "tests/faults/test_lost_rank.py",
    "tests/faults/test_preemption.py",
    "tests/pipeline/test_pipeline_lost_rank.py",
)
_WORKER_LOCK = pytest.StashKey()


def _exclusive(item) -> bool:
    return item is not None and item.get_closest_marker("exclusive") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, an ``exclusive`` test runs alone: it holds the workers' lock exclusively (until
    the next test of this worker is not exclusive), every other test holds it shared."""
    lock = item.config.stash.get(_WORKER_LOCK, None)
    if lock is None:
        yield
        return
    if _exclusive(item):
        lock.exclusive()
    else:
        lock.shared()
    try:
        yield
    finally:
        if not (_exclusive(item) and _exclusive(nextitem)):
            lock.release()


def pytest_unconfigure(config):
    lock = config.stash.get(_WORKER_LOCK, None)
    if lock is not None:
        lock.close()


# pytest-xdist sends whole work units to a worker: a test file, or one of these groups of files whose
# tests share a session fixture (a checkpoint trained once, a corpus built once), so that module and
# session fixtures are built once, not once per worker.
_SHARED_SESSION_GROUPS = {
    "checkpoint-runs": (
        "tests/checkpoint/test_inspect.py",
        "tests/checkpoint/test_faults.py",
        "tests/checkpoint/test_resume.py",
    ),
    "t5-corpus": ("tests/t5/",),
}


def _work_unit(nodeid: str) -> str:
    """The test file of ``nodeid`` (relative to the root), or its group of ``_SHARED_SESSION_GROUPS``."""
    relpath = nodeid.split("::", 1)[0]
    for group, prefixes in _SHARED_SESSION_GROUPS.items():
        if relpath.startswith(prefixes):
            return group
    return relpath


# Work units that each take one worker for a minute or more (on CI's 2-core machine), handed out
# first: xdist's default order (most tests first) sent these single-test files last, and the suite's
# last minutes ran on one worker while the other idled.
_LONG_FIRST = (
    "tests/ops/test_act_fp8_interpret.py",
    "tests/ops/test_fp8_cast_interpret.py",
    "tests/ops/test_norm_fp8_interpret.py",
    "tests/test_quickstart.py",
    "tests/bert/test_bert_quickstart.py",
    "tests/test_docs.py",
    "tests/test_fp8_convergence_benchmark.py",
    "tests/test_megatron_user.py",
)


def _unit_order(collection: list[str]) -> list[str]:
    """``collection`` with each work unit's tests together, the units of ``_LONG_FIRST`` first (in that
    order), then the others by decreasing number of tests (xdist's own heuristic), ties in collection
    order."""
    units: dict[str, list[str]] = {}
    for nodeid in collection:
        units.setdefault(_work_unit(nodeid), []).append(nodeid)

    def rank(item):
        position, (unit, nodeids) = item
        first = _LONG_FIRST.index(unit) if unit in _LONG_FIRST else len(_LONG_FIRST)
        return (first, -len(nodeids), position)

    ordered = sorted(enumerate(units.items()), key=rank)
    return [nodeid for _, (_, nodeids) in ordered for nodeid in nodeids]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with :func:`_work_unit` as the scope (pyproject's ``--dist loadfile``
    with the session groups added; xdist's own ``xdist_group`` marks rename node ids, which pytest 9
    no longer allows), the units handed out in :func:`_unit_order`."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.config.option.loadscopereorder = False  # the order is _unit_order's

        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

        def schedule(self) -> None:
            if self.collection is None and self.collection_is_completed:
                for node in list(self.registered_collections):  # every node the same order
                    self.registered_collections[node] = _unit_order(list(self.registered_collections[node]))
            super().schedule()

    return FileGroupScheduling(config, log)


def pytest_collection_modifyitems(session, config, items):
    """Mark the tests of ``_EXCLUSIVE_FILES`` ``exclusive``. Without xdist workers, start the
    Triton-interpreter children of the selected tests now, one at a time at the lowest priority
    (``mcore.testing.interpreter.BackgroundChildren``): the tests later take their results."""
    root = str(config.rootpath)
    for item in items:
        relpath = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        if relpath in _EXCLUSIVE_FILES:
            item.add_marker(pytest.mark.exclusive)
    from mcore.testing.interpreter import BACKGROUND, DEFAULT_TIMEOUT, HAS_TRITON

    if not HAS_TRITON or os.environ.get("MCORE_TEST_BACKEND"):
        return  # skipped without Triton; on a GPU machine the children run in the foreground
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Each worker collects every test but runs only its share: a background start here would run
        # every child once per worker. Under xdist the two workers keep both cores busy, so each
        # child runs in the foreground when its test does (the same child, arguments and checks).
        return
    runs = []
    for item in items:
        marker = item.get_closest_marker("interpreter_child")
        if marker is not None:
            runs.append((str(item.path), tuple(marker.args), marker.kwargs.get("timeout", DEFAULT_TIMEOUT)))
    BACKGROUND.start(runs)


def pytest_sessionfinish(session, exitstatus):
    from mcore.testing.interpreter import BACKGROUND

    BACKGROUND.stop()
