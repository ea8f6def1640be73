"""Shared by the tensor-parallel and model tests: the test device and dtype, and error measures."""

from __future__ import annotations

import os

import torch

from mcore.backend import current_backend


def device() -> torch.device:
    """This rank's device on the test backend (``MCORE_TEST_BACKEND``; CPU by default)."""
    return current_backend().device(int(os.environ.get("LOCAL_RANK", "0")))


def test_dtype() -> torch.dtype:
    """Parameter dtype of the model tests: ``MCORE_TEST_DTYPE=bf16`` on a GPU, fp32 by default."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        os.environ.get("MCORE_TEST_DTYPE", "fp32")
    ]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected| / max |expected|`` (0 when both are zero)."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale > 0 else diff
