"""The backend conformance kit: what every device-backend plugin must pass, runnable in its own CI.

Subclass :class:`BackendConformance` in a test module of your plugin and name your backend::

    from mcore.testing.conformance import BackendConformance

    class TestMyChipConformance(BackendConformance):
        backend_name = "mychip"

``pytest`` then runs, against ``select_backend("mychip")``:

* **ops**: every op of the table (:data:`OP_CASES`: norms, rotary with partial/position-id angles,
  activations, attention with causal/padding/explicit masks, GQA/MQA, a KV-cache
  shape, cross-entropy, the Adam step) on the backend's device, against the pure-PyTorch
  references computed in fp32 on the CPU from the same inputs, forward and input gradients, in
  fp32 and in each of bf16/fp16 the backend claims (:data:`TOLERANCES` per dtype);
* **interface**: the :class:`~mcore.backend.DeviceBackend` attributes and methods, device placement,
  and the optional interfaces behind the capabilities it claims (``compile_layers``:
  ``compile_layer``; ``device_graphs``: ``graph``, ``graph_pool``, ``side_stream``);
* **RNG**: save/restore of the device RNG state and the tensor-parallel RNG tracker's streams;
* **memory statistics**: the keys, types and invariants of ``memory_stats()``;
* **collectives**: a 2-process run on the backend's ``dist_backend`` (all-reduce, all-gather,
  reduce-scatter, broadcast, point-to-point), through :func:`mcore.testing.distributed.run_distributed`;
* **training**: 2 steps of ``pretrain`` with tensor parallelism 2 (and sequence parallelism) of a tiny
  GPT on mock data, whose losses must equal the CPU backend's within ``training_rtol``.

The checks are plain functions too (``check_op``, ``check_rng``, ...), so a smoke script on real
hardware can call them without pytest's class machinery. A test that needs a set-up in each
spawned process (a simulated device module, say) sets :attr:`BackendConformance.rank_setup` to a
module-level function.

Modules: :mod:`.op_cases` (the op cases, as data) with :mod:`.op_inputs` (their inputs),
:mod:`.op_checks` (one checker per kind of op, and :func:`check_op`), :mod:`.compare` (tolerances
and comparisons), :mod:`.interface` (protocol, optional interfaces, RNG, memory statistics),
:mod:`.collectives`, :mod:`.training` and :mod:`.suite` (:class:`BackendConformance`). This
package's namespace is the API that backends and plugins import.
"""

from __future__ import annotations

from mcore.testing.conformance.collectives import check_collectives, collectives_rank, expected_collectives
from mcore.testing.conformance.compare import (
    DTYPES,
    TOLERANCES,
    ConformanceError,
    assert_close,
    fp8_step_close,
    fp8_values_off,
)
from mcore.testing.conformance.interface import (
    OPTIONAL_INTERFACES,
    check_interface,
    check_memory_stats,
    check_optional_interfaces,
    check_rng,
)
from mcore.testing.conformance.op_cases import OP_CASES, OpCase
from mcore.testing.conformance.op_checks import FP8_PRODUCERS, OP_CHECKS, check_op
from mcore.testing.conformance.op_inputs import rotary_freqs
from mcore.testing.conformance.suite import BackendConformance
from mcore.testing.conformance.training import (
    TRAINING_ARGV,
    check_training,
    compare_losses,
    reference_training_losses,
    training_losses,
    training_rank,
)

__all__ = [
    "DTYPES",
    "FP8_PRODUCERS",
    "OPTIONAL_INTERFACES",
    "OP_CASES",
    "OP_CHECKS",
    "TOLERANCES",
    "TRAINING_ARGV",
    "BackendConformance",
    "ConformanceError",
    "OpCase",
    "assert_close",
    "check_collectives",
    "check_interface",
    "check_memory_stats",
    "check_op",
    "check_optional_interfaces",
    "check_rng",
    "check_training",
    "collectives_rank",
    "compare_losses",
    "expected_collectives",
    "fp8_step_close",
    "fp8_values_off",
    "reference_training_losses",
    "rotary_freqs",
    "training_losses",
    "training_rank",
]
