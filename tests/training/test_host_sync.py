"""No host-device wait inside a training step: logs stay on the device until a log interval, the NaN
check of the gradients is read one step late (with an optimizer that skips non-finite updates on the
device), exit flags are agreed one iteration late; what is logged does not change."""

import json
import re

import pytest
import torch

import mcore.training.pretrain as pretrain_module
from mcore.optimizer import build_optimizer
from mcore.testing.distributed import test_backend_name as backend_name
from mcore.training.gpt import forward_step, model_provider
from mcore.training.pretrain import Trainer, pretrain
from mcore.utils.async_host import HostValue, host_floats, stage_to_host

# The mock dataset is Megatron's (100,000 documents): building its indices costs ~3 s of CPU a run, most
# of a tiny run. The module's runs pass one --data-cache-path (the product's index cache, keyed by the
# dataset's full description: seed, sizes, samples, split, tokenizer), so each distinct dataset is built
# once and later runs read the same arrays back; the directory goes with the module.
_INDEX_CACHE: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _mock_index_cache(tmp_path_factory):
    import shutil

    path = tmp_path_factory.mktemp("index_cache")
    _INDEX_CACHE.append(str(path))
    yield
    _INDEX_CACHE.remove(str(path))
    shutil.rmtree(path, ignore_errors=True)


def _argv(*extra, iters=6):
    return [
        "--device-backend",
        backend_name(),
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--max-position-embeddings",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        str(iters),
        "--lr",
        "1e-2",
        "--lr-warmup-iters",
        "1",
        "--clip-grad",
        "1.0",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
        "--eval-iters",
        "0",
        "--num-workers",
        "0",
        "--seed",
        "5",
        *(["--data-cache-path", _INDEX_CACHE[-1]] if _INDEX_CACHE else []),
        *extra,
    ]


class _Lazy:
    """Wraps the optimizer into the fused path's contract, whichever path the flags select:
    ``step()`` returns the gradient norm as a 0-d tensor and a non-finite gradient skips the update (as
    the fused kernels do on the device; here it reads the gradients, which is fine on the CPU);
    ``skips_nonfinite_on_device`` is True. With ``lazy=False``: the eager contract (a float norm,
    ``skips_nonfinite_on_device`` False), so the NaN check stays in ``finish_grad_sync``."""

    def __init__(self, lazy: bool = True):
        self.lazy = lazy
        self.model = None
        self.snapshots = []  # parameters after each step

    def build(self, *args, **kwargs):
        optimizer = build_optimizer(*args, **kwargs)
        self.model = args[2]
        step = optimizer.step

        def wrapped_step():
            grads = [p.main_grad for chunk in self.model for p in chunk.parameters() if p.requires_grad]
            if self.lazy and not all(bool(torch.isfinite(g).all()) for g in grads):
                norm = torch.tensor(float("nan"), dtype=torch.float64)
                ok = True  # the host does not know: the update is skipped on the device
            else:
                ok, norm, _ = step()
                if norm is not None and self.lazy and not isinstance(norm, torch.Tensor):
                    norm = torch.tensor(norm, dtype=torch.float64)
                if norm is not None and not self.lazy:
                    norm = float(norm)
            self.snapshots.append(self.parameters())
            return ok, norm, None

        optimizer.step = wrapped_step
        optimizer.skips_nonfinite_on_device = self.lazy
        return optimizer

    def parameters(self):
        return [p.detach().clone() for chunk in self.model for p in chunk.parameters()]


class _InjectNaN:
    """A forward step whose loss (and logged loss) is NaN in the given calls (iterations, with one
    micro-batch per iteration)."""

    def __init__(self, bad_calls):
        self.calls = 0
        self.bad_calls = set(bad_calls)

    def __call__(self, data_iterator, model):
        self.calls += 1
        output, loss_func = forward_step(data_iterator, model)
        if self.calls not in self.bad_calls:
            return output, loss_func

        def poisoned(out):
            loss, logs = loss_func(out)
            return loss * float("nan"), {k: v * float("nan") for k, v in logs.items()}

        return output, poisoned


_VOLATILE = re.compile(
    r"(elapsed time per iteration \(ms\)|tokens/s|TFLOP/s/device|MFU|mem alloc \(GiB\)|mem peak \(GiB\)): [^|]*\|"
)
_VOLATILE_KEYS = {
    "time",
    "iteration_time_ms",
    "tokens_per_s",
    "tflops_per_device",
    "mfu",
    "mem_allocated_gib",
    "mem_peak_gib",
}


def _run(capsys, tmp_path, name, argv, forward=forward_step):
    log = tmp_path / f"{name}.jsonl"
    result = pretrain(model_provider, forward, argv=[*argv, "--log-json", str(log)])
    lines = [
        _VOLATILE.sub("", line) for line in capsys.readouterr().out.splitlines() if " iteration " in line
    ]
    records = [
        {k: v for k, v in json.loads(line).items() if k not in _VOLATILE_KEYS}
        for line in log.read_text().splitlines()
    ]
    return result, lines, records


def test_stage_to_host_on_cpu_is_a_snapshot():
    value = torch.tensor([1.5, 2.0])
    staged = stage_to_host(value)
    value.add_(1.0)
    assert isinstance(staged, HostValue) and staged.ready()
    assert staged.tolist() == [1.5, 2.0]
    assert stage_to_host(torch.tensor(3.25)).item() == 3.25
    norm = torch.tensor(0.1, dtype=torch.float32)
    assert host_floats([None, 2, norm, stage_to_host(norm), 0.5]) == [
        None,
        2.0,
        norm.item(),
        norm.item(),
        0.5,
    ]


def test_train_step_returns_device_tensors(monkeypatch):
    """What the loop gets from a step is not read on the host (no float conversion in the step)."""
    lazy = _Lazy()
    monkeypatch.setattr(pretrain_module, "build_optimizer", lazy.build)
    seen = []
    original = Trainer.train_step

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(Trainer, "train_step", spy)
    result = pretrain(model_provider, forward_step, argv=_argv("--log-interval", "1000", iters=3))
    assert len(seen) == 3 and len(result.train_losses) == 3
    for logs, ok, grad_norm in seen:
        assert set(logs) == {"lm loss"}
        assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in logs.values())
        assert ok is True and isinstance(grad_norm, torch.Tensor)
    assert [float(logs["lm loss"]) for logs, _, _ in seen] == result.train_losses  # dp=1: same values


def test_the_loop_reads_the_logs_only_at_log_intervals(monkeypatch, capsys):
    reads = []
    original = Trainer.reduce_logs

    def spy(self, steps):
        reads.append(len(steps))
        return original(self, steps)

    monkeypatch.setattr(Trainer, "reduce_logs", spy)
    result = pretrain(model_provider, forward_step, argv=_argv("--log-interval", "3", iters=7))
    assert reads == [3, 3, 1]  # iterations 3 and 6 log; the 7th step is read at the end of training
    assert len(result.train_losses) == 7
    assert len(re.findall(r"^ iteration ", capsys.readouterr().out, re.M)) == 2


def test_lazy_grad_norm_and_deferred_nan_check_log_the_same(monkeypatch, capsys, tmp_path):
    argv = _argv("--log-interval", "2", iters=6)
    monkeypatch.setattr(pretrain_module, "build_optimizer", _Lazy(lazy=False).build)
    eager, eager_lines, eager_records = _run(capsys, tmp_path, "eager", argv)
    lazy = _Lazy()
    monkeypatch.setattr(pretrain_module, "build_optimizer", lazy.build)
    deferred, lazy_lines, lazy_records = _run(capsys, tmp_path, "lazy", argv)
    assert len(eager_lines) == 3 and "grad norm: " in eager_lines[0]
    assert lazy_lines == eager_lines

    def without_memory(records):  # device memory differs with the lazy norm's buffers on a GPU
        return [{k: v for k, v in r.items() if not k.startswith("mem_")} for r in records]

    assert without_memory(lazy_records) == without_memory(eager_records)
    assert deferred.train_losses == eager.train_losses
    assert deferred.state == eager.state


def test_log_interval_means_match_the_per_iteration_values(capsys, tmp_path):
    _, _, per_iter = _run(capsys, tmp_path, "every", _argv("--log-interval", "1", iters=6))
    _, _, per_three = _run(capsys, tmp_path, "three", _argv("--log-interval", "3", iters=6))
    assert [r["iteration"] for r in per_three] == [3, 6]
    for record in per_three:
        window = per_iter[record["iteration"] - 3 : record["iteration"]]
        assert record["lm loss"] == sum(r["lm loss"] for r in window) / 3
        assert record["grad_norm"] == window[-1]["grad_norm"]
        assert record["learning_rate"] == window[-1]["learning_rate"]


@pytest.mark.parametrize("bad_iteration, iters", [(3, 6), (4, 4)])
def test_deferred_nan_check_names_the_iteration_and_keeps_the_parameters(monkeypatch, bad_iteration, iters):
    """The NaN of iteration k is raised one step late (or at the end of training), naming k; the
    skipped update left the parameters as they were after iteration k - 1."""
    lazy = _Lazy()
    monkeypatch.setattr(pretrain_module, "build_optimizer", lazy.build)
    argv = _argv("--micro-batch-size", "4", "--log-interval", "1000", iters=iters)
    with pytest.raises(
        RuntimeError, match=rf"NaN in the local gradients of iteration {bad_iteration} on rank 0"
    ):
        pretrain(model_provider, _InjectNaN([bad_iteration]), argv=argv)
    assert len(lazy.snapshots) == bad_iteration  # no optimizer step after the NaN one
    after_good = lazy.snapshots[bad_iteration - 2]
    for now, before in zip(lazy.parameters(), after_good):
        assert torch.equal(now, before)
    assert all(torch.isfinite(p).all() for p in lazy.parameters())


def test_without_device_skipping_the_nan_check_stays_immediate(monkeypatch):
    monkeypatch.setattr(pretrain_module, "build_optimizer", _Lazy(lazy=False).build)
    argv = _argv("--micro-batch-size", "4", "--log-interval", "1000", iters=4)
    with pytest.raises(
        RuntimeError, match=r"NaN in the local gradients on rank 0 before the data-parallel reduction"
    ) as err:
        pretrain(model_provider, _InjectNaN([2]), argv=argv)
    assert "iteration" not in str(err.value)


def test_lazy_nonfinite_grad_norm_counts_as_skipped_without_the_nan_check(monkeypatch):
    lazy = _Lazy()
    monkeypatch.setattr(pretrain_module, "build_optimizer", lazy.build)
    argv = _argv(
        "--micro-batch-size", "4", "--log-interval", "1000", "--no-check-for-nan-in-loss-and-grad", iters=4
    )
    result = pretrain(model_provider, _InjectNaN([2]), argv=argv)
    assert result.state.skipped_iterations == 1
    assert result.state.nan_iterations == 1
    assert torch.isnan(torch.tensor(result.train_losses[1]))
    assert all(torch.isfinite(p).all() for p in lazy.parameters())


def test_exit_duration_is_agreed_one_iteration_later():
    result = pretrain(model_provider, forward_step, argv=_argv("--exit-duration-in-mins", "0", iters=6))
    assert result.exit_reason == "exit-duration"
    assert result.state.iteration == 2
