"""Crash safety and validation: failed or killed saves, SIGTERM, damaged files, wrong models."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_runs import argv, train, train_with_failing_save  # noqa: E402

from mcore.checkpoint import (  # noqa: E402
    CheckpointConfig,
    CheckpointError,
    load_checkpoint,
    load_logical_model_state,
    save_logical_model_checkpoint,
)
from mcore.checkpoint.format import list_tmp_dirs, read_tracker  # noqa: E402
from mcore.distributed.groups import ProcessGroups  # noqa: E402
from mcore.testing.distributed import DistributedTestError, free_port, run_distributed, skip_without_devices  # noqa: E402

TP2 = ["--tensor-model-parallel-size", "2"]
HERE = Path(__file__).parent


def _copy(tp2pp2_run, tmp_path) -> Path:
    save, _ = tp2pp2_run
    dest = tmp_path / "ckpt"
    shutil.copytree(save, dest)
    return dest


def _single_process_model(*extra: str, optimizer: bool = False):
    """A TP=1/PP=1 model (and optimizer) of the test configuration in this process (no torch.distributed)."""
    from mcore.optimizer import build_optimizer
    from mcore.training.gpt import model_provider
    from mcore.training.pretrain import build_model
    from mcore.training.run_config import parse_run_config

    cfg = parse_run_config(argv("--train-iters", "20", *extra))
    groups = ProcessGroups.single()
    model = build_model(cfg, groups, model_provider, 1024)
    opt = (
        build_optimizer(cfg.optimizer, cfg.precision, model, groups, lr=cfg.scheduler.lr)
        if optimizer
        else None
    )
    return model, opt, groups


# -- failed and killed saves -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_save_failing_on_one_rank_raises_everywhere_and_keeps_the_previous_checkpoint(tmp_path, capfd):
    save = tmp_path / "ckpt"
    run = [*TP2, "--train-iters", "4", "--save", str(save), "--save-interval", "2"]
    with pytest.raises(DistributedTestError):  # every rank stops (exit status 2)
        run_distributed(train_with_failing_save, 2, run, 1, 2, "raise")
    err = capfd.readouterr().err
    # one line for the job, from a rank that saw the failure: the file and the OS's reason
    assert err.count("saving iteration 4 failed on rank 1") == 1, err
    assert "No space left on device (injected)" in err and "Traceback" not in err
    assert read_tracker(save) == 2
    assert not (save / "iter_0000004").exists()
    assert list_tmp_dirs(save) == []  # the failed save's partial files are removed
    state, meta = load_logical_model_state(save)  # the previous checkpoint is complete and valid
    assert meta["iteration"] == 2 and "decoder.layers.1.mlp.linear_fc1.weight" in state


@pytest.mark.slow
def test_a_save_killed_midway_keeps_the_previous_checkpoint_and_training_resumes(tmp_path):
    save = tmp_path / "ckpt"
    run = [*TP2, "--train-iters", "4", "--save", str(save), "--save-interval", "2"]
    # rank 1 ends with os._exit after writing one file; rank 0 then fails (or is killed) in the commit
    with pytest.raises(
        DistributedTestError,
        match="exited without a result|Connection closed by peer|Connection reset by peer",
    ):
        run_distributed(train_with_failing_save, 2, run, 1, 2, "kill")
    assert read_tracker(save) == 2 and not (save / "iter_0000004").exists()
    assert len(list_tmp_dirs(save)) == 1  # the killed save's partial files
    results = run_distributed(train, 2, [*run, "--load", str(save)])
    assert results[-1]["iteration"] == 4 and len(results[-1]["losses"]) == 2
    assert read_tracker(save) == 4 and list_tmp_dirs(save) == []  # stale partial save cleaned up


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_zero(tmp_path):
    skip_without_devices(2)  # the ranks are launched here, not by run_distributed
    save = tmp_path / "ckpt"
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "from ckpt_runs import train\n"
        "r = train(sys.argv[1:])\n"
        "print('EXIT', r['exit_reason'], r['iteration'], flush=True)\n"
    )
    run = [*TP2, "--train-iters", "2000", "--log-interval", "1", "--save", str(save), "--exit-signal-handler"]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["OMP_NUM_THREADS"] = "1"
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = []
    for r in range(2):
        with open(logs[r], "w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *run],
                    env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        deadline = time.monotonic() + 120
        while logs[1].read_text().count(" iteration ") < 3:  # the last rank logs each iteration
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                break
            time.sleep(0.1)
        progress = logs[1].read_text()
        assert progress.count(" iteration ") >= 3, logs[0].read_text()[-2000:] + progress[-2000:]
        procs[0].send_signal(signal.SIGTERM)  # one rank gets it; the handler stops every rank
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    output = "".join(log.read_text() for log in logs)
    assert codes == [0, 0], output[-3000:]
    assert "EXIT signal" in output
    iteration = read_tracker(save)
    assert isinstance(iteration, int) and 1 <= iteration < 2000
    meta = json.loads((save / f"iter_{iteration:07d}" / "metadata.json").read_text())
    assert meta["train_state"]["iteration"] == iteration


# -- damaged checkpoints ---------------------------------------------------------------------------


def test_a_truncated_shard_file_is_named(tp2pp2_run, tmp_path):
    ckpt = _copy(tp2pp2_run, tmp_path)
    path = ckpt / "iter_0000020" / "model_tp01_pp001.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model_tp01_pp001\.pt is truncated or damaged"):
        load_logical_model_state(ckpt)


def test_a_corrupted_tensor_fails_its_checksum(tp2pp2_run, tmp_path):
    ckpt = _copy(tp2pp2_run, tmp_path)
    path = ckpt / "iter_0000020" / "model_tp00_pp000.pt"
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    payload = torch.load(path, weights_only=True)[name].numpy().tobytes()
    data = bytearray(path.read_bytes())
    at = data.find(payload[:256])
    assert at > 0
    data[at + 100] ^= 0x40  # one flipped bit inside the tensor's bytes, file size unchanged
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"model_tp00_pp000\.pt: tensor '{name}' fails its checksum"):
        load_logical_model_state(ckpt)
    state, _ = load_logical_model_state(ckpt, verify=False)  # without verification it reads through
    assert name in state


def test_a_missing_shard_file_is_named(tp2pp2_run, tmp_path):
    ckpt = _copy(tp2pp2_run, tmp_path)
    (ckpt / "iter_0000020" / "model_tp01_pp000.pt").unlink()
    with pytest.raises(CheckpointError, match=r"shard file .*model_tp01_pp000\.pt is missing"):
        load_logical_model_state(ckpt)


def test_shards_missing_from_the_metadata_are_reported(tp2pp2_run, tmp_path):
    ckpt = _copy(tp2pp2_run, tmp_path)
    meta_path = ckpt / "iter_0000020" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    name = "decoder.layers.2.mlp.linear_fc2.weight"
    drop = next(r for r in meta["records"] if r["name"] == name and r["file"] == "model_tp01_pp001.pt")
    meta["records"].remove(drop)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=rf"the shards of {name} cover 1024 of the 2048 elements"):
        load_logical_model_state(ckpt)


def test_a_tracker_naming_a_missing_directory_is_an_error(tp2pp2_run, tmp_path):
    ckpt = _copy(tp2pp2_run, tmp_path)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("30\n")
    with pytest.raises(
        CheckpointError, match=r"names iteration 30, but .*iter_0000030 does not exist.*\[10, 20\]"
    ):
        load_logical_model_state(ckpt)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("thirty\n")
    with pytest.raises(CheckpointError, match="expected an iteration number or 'release'"):
        load_logical_model_state(ckpt)


def test_corrupted_metadata_and_unknown_steps_are_errors(tp2pp2_run, tmp_path):
    ckpt = _copy(tp2pp2_run, tmp_path)
    meta = ckpt / "iter_0000010" / "metadata.json"
    meta.write_text(meta.read_text()[:500])
    with pytest.raises(CheckpointError, match=r"iter_0000010/metadata\.json is corrupted or truncated"):
        load_logical_model_state(ckpt, iteration=10)
    model, _, groups = _single_process_model()
    config = CheckpointConfig(load=str(ckpt), ckpt_step=15)
    with pytest.raises(CheckpointError, match=r"iteration 15 was requested \(--ckpt-step\).*\[10, 20\]"):
        load_checkpoint(config, model, None, None, groups)


class _FullDiskFile:
    """A file with ``capacity`` bytes of room: ``write`` raises ``OSError(ENOSPC)`` beyond it."""

    def __init__(self, file, capacity: int):
        self._file, self._left = file, capacity

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self._left:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._left -= size
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)


def _full_disk(monkeypatch, capacity: int = 64) -> None:
    """``torch.save`` as it behaves on a disk with ``capacity`` bytes left (what a real tmpfs of that
    size does): to a path, torch's C++ writer fails with only "unexpected pos"; to a Python file, the
    file's write raises ``OSError(ENOSPC)``."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            Path(f).write_bytes(b"\0" * capacity)
            raise RuntimeError(f"[enforce fail at inline_container.cc:672] . unexpected pos {capacity} vs 0")
        return real_save(obj, _FullDiskFile(f, capacity), *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def test_a_full_disk_says_so_removes_the_partial_save_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    from mcore.checkpoint import save_checkpoint
    from mcore.training.pretrain import TrainState

    model, optimizer, groups = _single_process_model(optimizer=True)
    config = CheckpointConfig(save=str(tmp_path))
    save_checkpoint(config, TrainState(iteration=1), model, optimizer, None, groups)
    before, _ = load_logical_model_state(tmp_path)
    _full_disk(monkeypatch)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(config, TrainState(iteration=2), model, optimizer, None, groups)
    message = str(info.value)
    assert "saving iteration 2 failed on rank 0: cannot write" in message
    assert "model_tp00_pp000.pt: No space left on device" in message
    assert "Traceback" not in message and "unexpected pos" not in message
    assert list_tmp_dirs(tmp_path) == [] and not (tmp_path / "iter_0000002").exists()
    monkeypatch.undo()
    assert read_tracker(tmp_path) == 1
    after, meta = load_logical_model_state(tmp_path)
    assert meta["iteration"] == 1 and all(torch.equal(before[k], after[k]) for k in before)


def test_a_full_disk_during_a_model_only_save_removes_its_partial_directory(tmp_path, monkeypatch):
    _full_disk(monkeypatch)
    with pytest.raises(CheckpointError, match=r"model_tp00_pp000\.pt: No space left on device"):
        save_logical_model_checkpoint(tmp_path, {"w": torch.ones(64)}, None)
    assert list(tmp_path.iterdir()) == []


def test_a_tracker_of_binary_garbage_is_named(tp2pp2_run, tmp_path):
    ckpt = _copy(tp2pp2_run, tmp_path)
    (ckpt / "latest_checkpointed_iteration.txt").write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(
        CheckpointError,
        match=r"latest_checkpointed_iteration\.txt is damaged \(512 bytes of binary data\).*\[10, 20\]",
    ):
        load_logical_model_state(ckpt)
    model, _, groups = _single_process_model()
    with pytest.raises(CheckpointError, match=r"latest_checkpointed_iteration\.txt is damaged"):
        load_checkpoint(CheckpointConfig(load=str(ckpt)), model, None, None, groups)


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda m: m.pop("layout"), "the key 'layout' is missing"),
        (lambda m: m.pop("iteration"), "the key 'iteration' is missing"),
        (lambda m: m.pop("records"), "the key 'records' is missing"),
        (
            lambda m: m["layout"].pop("tensor_model_parallel_size"),
            "the key 'layout.tensor_model_parallel_size' is missing",
        ),
        (
            lambda m: m["records"][3].pop("global_shape"),
            r"the key 'global_shape' is missing from records\[3\]",
        ),
        (lambda m: m["records"][0].pop("file"), r"the key 'file' is missing from records\[0\]"),
    ],
    ids=["layout", "iteration", "records", "layout-tp", "record-shape", "record-file"],
)
def test_metadata_missing_a_key_names_the_file_and_the_key(tp2pp2_run, tmp_path, damage, named):
    ckpt = _copy(tp2pp2_run, tmp_path)
    meta_path = ckpt / "iter_0000020" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    damage(meta)
    meta_path.write_text(json.dumps(meta))
    model, _, groups = _single_process_model()
    for load in (
        lambda: load_logical_model_state(ckpt),
        lambda: load_checkpoint(CheckpointConfig(load=str(ckpt)), model, None, None, groups),
    ):
        with pytest.raises(CheckpointError, match=rf"iter_0000020/metadata\.json: {named}"):
            load()


# -- loading into a model ---------------------------------------------------------------------------


def test_a_different_model_gives_a_shape_mismatch_or_missing_tensor(tp2pp2_run):
    save, _ = tp2pp2_run
    config = CheckpointConfig(load=str(save), no_load_optim=True)
    model, _, groups = _single_process_model("--hidden-size", "48")
    with pytest.raises(
        CheckpointError,
        match=r"shape mismatch for embedding.word_embeddings.weight: the checkpoint has \[1024, 32\], this model has \[1024, 48\]",
    ):
        load_checkpoint(config, model, None, None, groups)
    model, _, groups = _single_process_model("--untie-embeddings-and-output-weights")
    with pytest.raises(CheckpointError, match="the checkpoint has no tensor output_layer.weight"):
        load_checkpoint(config, model, None, None, groups)


def test_single_process_load_equals_the_logical_state(tp2pp2_run):
    save, _ = tp2pp2_run
    logical, meta = load_logical_model_state(save)
    assert meta["layout"]["tensor_model_parallel_size"] == 2 and meta["iteration"] == 20
    assert meta["run_config"]["model"]["hidden_size"] == 32 and meta["extra"]["padded_vocab_size"] == 1024
    assert logical["decoder.layers.3.mlp.linear_fc1.weight"].shape == (128, 32)  # SwiGLU [gate; up]
    model, optimizer, groups = _single_process_model(optimizer=True)
    state = load_checkpoint(CheckpointConfig(load=str(save)), model, optimizer, None, groups)
    assert state == {**meta["train_state"], "iteration": 20}
    module = model[0].module
    params = dict(module.named_parameters())
    for local, spec in module.sharded_parameters().items():
        assert torch.equal(params[local].detach(), logical[spec.name]), spec.name
    exp_avg = optimizer.state_dict()["state"]["decoder.layers.3.mlp.linear_fc1.weight"]["exp_avg"]
    assert exp_avg.abs().sum() > 0 and optimizer.main_params[0].state["step"] == 20


def test_model_only_checkpoint_needs_finetune_and_pads_the_vocabulary(tp2pp2_run, tmp_path):
    save, _ = tp2pp2_run
    logical, meta = load_logical_model_state(save, iteration=10)
    logical["embedding.word_embeddings.weight"] = logical["embedding.word_embeddings.weight"][:1001].clone()
    out = save_logical_model_checkpoint(
        tmp_path / "hf", logical, meta["run_config"], metadata={"source": "test"}
    )
    assert out.name == "iter_0000000" and read_tracker(tmp_path / "hf") == 0
    model, optimizer, groups = _single_process_model(optimizer=True)
    with pytest.raises(CheckpointError, match="has no optimizer state.*--no-load-optim or --finetune"):
        load_checkpoint(CheckpointConfig(load=str(tmp_path / "hf")), model, optimizer, None, groups)
    state = load_checkpoint(
        CheckpointConfig(load=str(tmp_path / "hf"), finetune=True), model, optimizer, None, groups
    )
    assert state == {}
    emb = model[0].module.embedding.word_embeddings.weight.detach()
    assert torch.equal(emb[:1001], logical["embedding.word_embeddings.weight"])
    assert not emb[1001:].any()  # padding rows the checkpoint did not have: zero-filled
    # the fp32 masters follow the loaded weights (they are views here: fp32 parameters)
    assert torch.equal(optimizer.main_params[-1].main, optimizer.main_params[-1].model_view())


def test_no_tracker_means_a_fresh_start(tmp_path, capsys):
    model, _, groups = _single_process_model()
    assert load_checkpoint(CheckpointConfig(load=str(tmp_path)), model, None, None, groups) == {}
    assert "nothing to load" in capsys.readouterr().out


def test_rng_states_round_trip():
    import random

    import numpy as np

    from mcore.checkpoint.save import rng_state_for_save, rng_state_from_file
    from mcore.tensor_parallel.random import get_rng_tracker, model_parallel_seed, set_all_rng_states

    model_parallel_seed(7)
    saved = rng_state_for_save()

    def draws():
        with get_rng_tracker().fork():
            tp = torch.rand(3)
        return random.random(), float(np.random.rand()), torch.rand(2).tolist(), tp.tolist()

    expected = draws()
    model_parallel_seed(8)
    set_all_rng_states(rng_state_from_file(saved))
    assert draws() == expected


def test_single_process_save_without_optimizer_and_rng_state(tmp_path, capsys):
    from mcore.checkpoint import save_checkpoint
    from mcore.training.pretrain import TrainState

    model, optimizer, groups = _single_process_model(optimizer=True)
    config = CheckpointConfig(save=str(tmp_path), no_save_optim=True, no_save_rng=True)
    for _ in range(2):  # the second save of the same iteration replaces the first
        save_checkpoint(
            config, TrainState(iteration=7, consumed_train_samples=28), model, optimizer, None, groups
        )
    assert read_tracker(tmp_path) == 7 and sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000007",
        "latest_checkpointed_iteration.txt",
    ]
    assert sorted(p.name for p in (tmp_path / "iter_0000007").iterdir()) == [
        "metadata.json",
        "model_tp00_pp000.pt",
    ]
    fresh, optimizer, groups = _single_process_model("--seed", "99", optimizer=True)
    with pytest.raises(CheckpointError, match="has no optimizer state"):
        load_checkpoint(CheckpointConfig(load=str(tmp_path)), fresh, optimizer, None, groups)
    config = CheckpointConfig(load=str(tmp_path), no_load_optim=True)
    state = load_checkpoint(config, fresh, optimizer, None, groups, state_cls=TrainState)
    assert state == TrainState(iteration=7, consumed_train_samples=28)
    assert "has no RNG states" in capsys.readouterr().out
    for a, b in zip(model[0].parameters(), fresh[0].parameters()):
        assert torch.equal(a, b)
