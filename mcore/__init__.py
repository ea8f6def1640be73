"""mcore: Megatron-style LLM training on one hardware-agnostic core.

Where things live (each module owns one concern):

* ``mcore.config``: typed config dataclasses whose fields are Megatron's flags; the CLI generator.
* ``mcore.plugins``, ``mcore.backend``, ``mcore.ops``: the device-backend plugin API, the backend
  object and the named op table (every op has a pure-PyTorch reference).
* ``mcore.distributed``: rank arithmetic, process groups, DDP with bucketed grad reduction.
* ``mcore.tensor_parallel``: TP/SP layers, collectives, vocab-parallel cross-entropy, RNG tracker.
* ``mcore.models``: the GPT family (GPT-2/3, Llama-style) built from layer specs.
* ``mcore.pipeline``: pipeline schedules (no pipelining, 1F1B, interleaved) and p2p.
* ``mcore.optimizer``: mixed-precision Adam/SGD, loss scaling, the distributed optimizer.
* ``mcore.data``: tokenizers, Megatron ``.bin/.idx`` datasets, preprocessing, GPT datasets, blending.
* ``mcore.checkpoint``: sharded, resharding, crash-safe checkpoints.
* ``mcore.hf``, ``mcore.inference``: Hugging Face export/import and text generation.
* ``mcore.training``: ``pretrain()`` and the training loop.
* ``mcore.backends``, ``mcore.adaptors``: built-in backends (cpu, cuda, npu) and the NPU adaptor.

Importing ``mcore`` has no side effects: no device is probed and no plugin is loaded until used.
The one exception is a source checkout imported without an editable install (see
:func:`_map_source_checkout`).
"""

import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"
__all__ = ["__version__"]

_SIBLING_PACKAGES = ("backends", "adaptors")
"""Sub-packages that live beside ``mcore/`` in the repository (``setup.py`` maps them in)."""


class _SourceCheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds ``mcore.backends`` / ``mcore.adaptors`` in the repository's top-level folders.

    An editable install (``pip install -e .``) maps them through setuptools' finder, and a regular
    install copies them into ``mcore/``; but ``python -m mcore.<tool>`` run from the repository root
    imports the source ``mcore/`` (the current directory comes first on ``sys.path``), where neither
    exists. This finder, consulted after every other one, serves exactly those two names from the
    checkout; their sub-modules then resolve through the package's ``__path__`` as usual.
    """

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        package, _, sub = fullname.partition(".")
        if package != __name__ or sub not in _SIBLING_PACKAGES:
            return None
        folder = os.path.join(self.root, sub)
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )


def _map_source_checkout() -> None:
    """Install :class:`_SourceCheckoutFinder` when this ``mcore`` is a source checkout's folder
    (``backends/__init__.py`` beside it, none inside it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if os.path.isdir(os.path.join(here, "backends")):
        return  # a regular install: the sub-packages are inside
    if not all(os.path.isfile(os.path.join(root, sub, "__init__.py")) for sub in _SIBLING_PACKAGES):
        return
    if not any(isinstance(f, _SourceCheckoutFinder) for f in sys.meta_path):
        sys.meta_path.append(_SourceCheckoutFinder(root))


_map_source_checkout()
