"""Every process's RNG states in a checkpoint file (``rng_tp.._pp.._dp...pt``), in types
``torch.load(weights_only=True)`` accepts."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mcore.tensor_parallel.random import get_all_rng_states


def rng_state_for_save() -> dict[str, Any]:
    """This process's RNG states in types ``torch.load(weights_only=True)`` accepts."""
    states = get_all_rng_states()
    version, internal, gauss = states["random"]
    kind, keys, pos, has_gauss, cached = states["numpy"]
    return {
        "random": [version, list(internal), gauss],
        "numpy": [
            kind,
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
        "torch": states["torch"].clone(),
        "device": states["device"].detach().cpu().clone(),
        "tracker": {k: v.detach().cpu().clone() for k, v in states["tracker"].items()},
    }


def rng_state_from_file(saved: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`rng_state_for_save`, for :func:`mcore.tensor_parallel.random.set_all_rng_states`."""
    version, internal, gauss = saved["random"]
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    return {
        "random": (version, tuple(internal), gauss),
        "numpy": (kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached),
        "torch": saved["torch"],
        "device": saved["device"],
        "tracker": dict(saved["tracker"]),
    }
