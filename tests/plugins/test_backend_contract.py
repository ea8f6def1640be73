"""The backend contract: readable op providers, declared wrapping, per-backend set-up as methods of
the backend object, optional capability interfaces with defaults, and the built-ins' API version."""

from __future__ import annotations

import contextlib
import importlib.metadata

import pytest
import torch

from mcore.backend import CPUBackend, DeviceGraphs, LayerCompiler, current_backend, set_current_backend
from mcore.ops import reference
from mcore.ops.registry import REFERENCE, OpConflictError, OpRegistry
from mcore.plugins import hookimpl
from mcore.plugins.hookspecs import PLUGIN_API_VERSION
from mcore.plugins.manager import installed_backends, new_plugin_manager, register_plugin, select_backend
from mcore.testing.conformance import ConformanceError, check_optional_interfaces
from mcore.testing.op_trace import OpCallRecorder


def _double_rms(x, w, eps):
    return 2 * reference.rms_norm(x, w, eps)


class ChipBackend(CPUBackend):
    """A host backend that replaces ``rms_norm`` and records its set-up calls."""

    def __init__(self, name: str = "chip", pg_answer=None):
        super().__init__()
        self.name, self.priority, self.pg_answer, self.calls = name, 1, pg_answer, []

    def register_ops(self, registry):
        self.calls.append("register_ops")
        registry.override("rms_norm", _double_rms, provider=self.name)

    def on_activate(self):
        self.calls.append("on_activate")

    def configure(self, configs):
        self.calls.append(("configure", sorted(configs)))

    def process_group_options(self, axis):
        self.calls.append(("process_group_options", axis))
        return self.pg_answer

    def on_shutdown(self):
        self.calls.append("on_shutdown")


class _Module:
    """A plugin module object with an API version."""

    def __init__(self, version: str = PLUGIN_API_VERSION, **hooks):
        self.MCORE_PLUGIN_API_VERSION = version
        for name, fn in hooks.items():
            setattr(self, name, hookimpl(fn))


def _manager(*plugins):
    pm = new_plugin_manager(load_entry_points=False)
    for i, plugin in enumerate(plugins):
        register_plugin(pm, plugin, f"plugin{i}")
    return pm


@pytest.fixture(autouse=True)
def _keep_current_backend():
    previous = set_current_backend(None)
    set_current_backend(previous)
    yield
    set_current_backend(previous)


# --- the op registry ------------------------------------------------------------------------------


def test_registry_reads_provider_and_current_implementation():
    registry = OpRegistry(reference.REFERENCE_OPS)
    assert registry.provider("rms_norm") == REFERENCE and registry.current("rms_norm") is reference.rms_norm
    registry.override("rms_norm", _double_rms, provider="chip")
    assert registry.provider("rms_norm") == "chip" and registry.current("rms_norm") is _double_rms
    with pytest.raises(OpConflictError, match="unknown op 'rms_nrom'"):
        registry.current("rms_nrom")


def test_wrappers_receive_the_replacement_stack_in_order_and_never_hide_it():
    registry = OpRegistry(reference.REFERENCE_OPS)
    calls = []
    registry.wrap("rms_norm", _counting("outer-declared-first", calls), provider="tracer")
    registry.wrap("rms_norm", _counting("second", calls), provider="profiler")
    registry.override("rms_norm", _double_rms, provider="chip")  # after the wraps: still below them
    table = registry.freeze()
    x, w = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(table.rms_norm(x, w, 1e-5), _double_rms(x, w, 1e-5))
    assert calls == ["second", "outer-declared-first"]  # the last declared wrapper is outermost
    assert table.provider("rms_norm") == "chip" and table.wrappers("rms_norm") == ("tracer", "profiler")
    assert dict(table)["rms_norm"].describe() == "chip (wrapped by tracer) (wrapped by profiler)"
    assert table.provider("layer_norm") == REFERENCE and table.wrappers("layer_norm") == ()


def test_wrapping_an_unknown_op_or_returning_no_callable_is_an_error():
    registry = OpRegistry(reference.REFERENCE_OPS)
    with pytest.raises(OpConflictError, match="tracer wraps unknown op 'softmax'"):
        registry.wrap("softmax", lambda fn: fn, provider="tracer")
    registry.wrap("swiglu", lambda fn: None, provider="tracer")
    with pytest.raises(OpConflictError, match="tracer's wrapper of op 'swiglu' returned None"):
        registry.freeze()


def test_two_providers_replacing_one_op_stays_an_error_wrapping_does_not_conflict():
    def replace_too(backend, registry):
        registry.override("rms_norm", reference.rms_norm, provider="other")

    with pytest.raises(OpConflictError, match="overridden by both 'chip' and 'other'"):
        select_backend(
            "chip",
            pm=_manager(
                _Module(mcore_backends=lambda: [ChipBackend()]), _Module(mcore_register_ops=replace_too)
            ),
            activate=False,
        )


def test_a_tracing_plugin_wraps_whatever_serves_each_op_of_any_backend():
    recorder = OpCallRecorder(provider="tracer")
    pm = _manager(_Module(mcore_backends=lambda: [ChipBackend(), CPUBackend()]))
    register_plugin(pm, recorder, "tracer")
    for name, provider in (("chip", "chip"), ("cpu", REFERENCE)):
        backend = select_backend(name, pm=pm, activate=False)
        x, w = torch.randn(2, 4), torch.randn(4)
        recorder.calls.clear()
        out = backend.ops.rms_norm(x, w, 1e-6)
        expected = _double_rms(x, w, 1e-6) if name == "chip" else reference.rms_norm(x, w, 1e-6)
        torch.testing.assert_close(out, expected)
        assert recorder.calls == {"rms_norm": 1}
        assert backend.ops.provider("rms_norm") == provider and backend.ops.wrappers("swiglu") == ("tracer",)


def _counting(name, seen):
    def wrap(inner):
        def counted(*args, **kwargs):
            seen.append(name)
            return inner(*args, **kwargs)

        return counted

    return wrap


# --- per-backend set-up methods -------------------------------------------------------------------


def test_setup_methods_run_for_the_backend_given_only_and_before_the_hooks():
    mine, other = ChipBackend("mine"), ChipBackend("other")
    order = []
    pm = _manager(
        _Module(mcore_backends=lambda: [mine, other]),
        _Module(
            mcore_configure=lambda backend, configs: order.append(("hook", backend.calls[-1])),
            mcore_on_shutdown=lambda backend: order.append(("hook", backend.calls[-1])),
        ),
    )
    selected = select_backend("mine", pm=pm)
    assert selected is mine and current_backend() is mine
    pm.hook.mcore_configure(backend=mine, configs={"model": None})
    pm.hook.mcore_on_shutdown(backend=mine)
    assert mine.calls == ["register_ops", "on_activate", ("configure", ["model"]), "on_shutdown"]
    assert other.calls == []  # never asked: the methods are not broadcast
    assert order == [("hook", ("configure", ["model"])), ("hook", "on_shutdown")]  # method first


def test_backend_answer_for_process_group_options_wins_and_none_falls_through_to_plugins():
    answered, silent = ChipBackend("answered", pg_answer={"buffer": 1}), ChipBackend("silent")
    pm = _manager(
        _Module(mcore_backends=lambda: [answered, silent]),
        _Module(mcore_process_group_options=lambda backend, axis: {"plugin": axis}),
    )
    assert pm.hook.mcore_process_group_options(backend=answered, axis="tp") == {"buffer": 1}
    assert pm.hook.mcore_process_group_options(backend=silent, axis="dp") == {"plugin": "dp"}
    assert silent.calls == [("process_group_options", "dp")]


class ProtocolOnlyBackend:
    """Implements DeviceBackend without BackendBase: none of the optional methods exist."""

    name, device_type, dist_backend, priority = "bare", "cpu", "gloo", 0
    ops = None

    def is_available(self):
        return True, "bare"

    def device(self, local_rank=0):
        return torch.device("cpu")

    def set_device(self, local_rank):
        pass

    def synchronize(self):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def get_rng_state(self):
        return torch.get_rng_state()

    def set_rng_state(self, state):
        torch.set_rng_state(state)

    def memory_stats(self):
        return {"allocated": 0, "reserved": 0, "peak_allocated": 0}

    def reset_peak_memory_stats(self):
        pass

    def capabilities(self):
        return frozenset({"fp32"})

    def peak_flops(self, dtype):
        return None


def test_a_backend_without_the_setup_methods_gets_the_defaults():
    bare = ProtocolOnlyBackend()
    pm = _manager(_Module(mcore_backends=lambda: [bare]))
    assert select_backend("bare", pm=pm) is bare and bare.ops.provider("rms_norm") == REFERENCE
    pm.hook.mcore_configure(backend=bare, configs={})
    assert pm.hook.mcore_process_group_options(backend=bare, axis="tp") is None
    pm.hook.mcore_on_shutdown(backend=bare)


# --- optional capability interfaces ---------------------------------------------------------------


def test_base_defaults_of_the_optional_interfaces():
    backend = CPUBackend()
    assert isinstance(backend, LayerCompiler) and isinstance(backend, DeviceGraphs)
    with pytest.raises(NotImplementedError, match="capability 'compile_layers'"):
        backend.compile_layer(torch.nn.Linear(2, 2))
    with pytest.raises(NotImplementedError, match="capability 'device_graphs'"):
        backend.graph()
    assert backend.graph_pool() is None
    with backend.side_stream() as inside:
        assert inside is None
    check_optional_interfaces(backend)


def test_conformance_refuses_a_claimed_capability_left_at_its_default():
    class Claims(CPUBackend):
        name = "claims"
        _capabilities = frozenset({"fp32", "device_graphs"})

    with pytest.raises(
        ConformanceError, match=r"claims capability 'device_graphs' but does not implement graph\(\)"
    ):
        check_optional_interfaces(Claims())

    class Implements(Claims):
        def graph(self):
            return contextlib.nullcontext()

    check_optional_interfaces(Implements())


def test_the_cuda_backend_implements_what_it_claims():
    from mcore.backends.cuda import CUDABackend

    for method in ("compile_layer", "graph", "graph_pool", "side_stream", "register_ops"):
        assert getattr(CUDABackend, method) is not getattr(CPUBackend, method), method


# --- the default backend and the API version ------------------------------------------------------


def test_the_default_backend_is_the_cores_cpu_backend():
    set_current_backend(None)
    backend = current_backend()
    assert type(backend) is CPUBackend and type(backend).__module__ == "mcore.backend"
    assert type(installed_backends(new_plugin_manager())["cpu"]) is CPUBackend


def test_built_in_plugins_declare_the_current_api_version():
    declared = {}
    for ep in importlib.metadata.entry_points(group="mcore.backends"):
        declared[ep.name] = ep.load().MCORE_PLUGIN_API_VERSION
    assert {"cpu", "cuda", "npu"} <= set(declared)
    stale = {name: v for name, v in declared.items() if v != PLUGIN_API_VERSION}
    assert not stale, f"plugins declare {stale}, the spec is {PLUGIN_API_VERSION}"
