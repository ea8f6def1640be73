"""A plugin for any backend that records which ops of the table are called (``registry.wrap``).

Register an instance before a backend is selected; every op it resolves is then wrapped::

    recorder = OpCallRecorder()
    register_plugin(plugin_manager(), recorder, "op-recorder")
    ...  # select a backend, train
    recorder.calls  # Counter: op name -> calls

It shows which kernels a run uses, and proves that an op of the table is reached by training.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from mcore.ops.registry import OP_NAMES
from mcore.plugins import hookimpl
from mcore.plugins.hookspecs import PLUGIN_API_VERSION


class OpCallRecorder:
    """Wraps every op of every resolved table; ``calls[name]`` counts the calls of op ``name``."""

    MCORE_PLUGIN_API_VERSION = PLUGIN_API_VERSION

    def __init__(self, provider: str = "op-recorder"):
        self.provider = provider
        self.calls: Counter[str] = Counter()

    def wrapper(self, name: str) -> Callable[[Callable], Callable]:
        """The wrapper of op ``name``: counts, then calls the implementation below it."""

        def wrap(implementation: Callable) -> Callable:
            def recorded(*args, **kwargs):
                self.calls[name] += 1
                return implementation(*args, **kwargs)

            return recorded

        return wrap

    @hookimpl
    def mcore_register_ops(self, backend, registry) -> None:
        for name in OP_NAMES:
            registry.wrap(name, self.wrapper(name), provider=self.provider)
