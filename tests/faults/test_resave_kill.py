"""A re-save of the same iteration killed between its two renames loses nothing.

A resumed run that is already finished saves its iteration again: the complete directory is renamed
aside (``iter_N.old-<token>``), the new one renamed into place, the old one removed. A process killed
between the two renames leaves the tracker naming ``iter_N``, which is missing. The loader renames the
``.old-`` copy back and loads it; the inspector names it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fault_runs import HERE  # noqa: E402

from mcore.checkpoint import CheckpointConfig, load_checkpoint  # noqa: E402
from mcore.checkpoint.format import list_old_dirs, read_tracker  # noqa: E402
from mcore.checkpoint.inspect import main as inspect_main  # noqa: E402

SAVE_TWICE_AND_DIE = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {checkpoint_tests!r})
    import torch
    from ckpt_runs import argv
    from mcore.checkpoint import CheckpointConfig, save_checkpoint
    import mcore.checkpoint.save as save_module
    from mcore.distributed.groups import ProcessGroups
    from mcore.training.run_config import parse_run_config
    from mcore.training.gpt import model_provider
    from mcore.training.pretrain import TrainState, build_model

    cfg = parse_run_config(argv("--train-iters", "20"))
    groups = ProcessGroups.single()
    model = build_model(cfg, groups, model_provider, 1024)
    config = CheckpointConfig(save={save!r})
    state = TrainState(iteration=7, consumed_train_samples=28)
    save_checkpoint(config, state, model, None, None, groups)
    torch.save([p.detach().clone() for p in model[0].parameters()], {weights!r})

    real_rename, renames = os.rename, []
    def rename_then_die(src, dst):
        renames.append(dst)
        if len(renames) == 2:  # iter_N -> iter_N.old-* is done; tmp -> iter_N is next: killed here
            os._exit(9)
        real_rename(src, dst)
    save_module.os.rename = rename_then_die
    with torch.no_grad():
        for p in model[0].parameters():
            p.add_(1.0)  # the second save holds other values: only the first copy may come back
    save_checkpoint(config, state, model, None, None, groups)
    """
)


def test_a_resave_killed_between_its_renames_is_recovered_by_the_loader(tmp_path, capsys):
    save, weights = tmp_path / "ckpt", tmp_path / "weights.pt"
    script = SAVE_TWICE_AND_DIE.format(
        checkpoint_tests=str(HERE.parent / "checkpoint"), save=str(save), weights=str(weights)
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 9, run.stdout[-2000:] + run.stderr[-2000:]
    assert read_tracker(save) == 7 and not (save / "iter_0000007").exists()
    (old,) = list_old_dirs(save, 7)

    assert inspect_main([str(save)]) == 0
    text = capsys.readouterr().out
    assert (
        f"the tracker names iteration 7, iter_0000007 is missing, and its complete copy is {old.name}" in text
    )
    assert f"== {old.name}: iteration 7" in text  # and it is described

    sys.path.insert(0, str(HERE.parent / "checkpoint"))
    from ckpt_runs import argv

    from mcore.distributed.groups import ProcessGroups
    from mcore.training.gpt import model_provider
    from mcore.training.pretrain import TrainState, build_model
    from mcore.training.run_config import parse_run_config

    cfg = parse_run_config(argv("--train-iters", "20", "--seed", "5"))
    groups = ProcessGroups.single()
    model = build_model(cfg, groups, model_provider, 1024)
    state = load_checkpoint(CheckpointConfig(load=str(save)), model, None, None, groups, state_cls=TrainState)
    assert state == TrainState(iteration=7, consumed_train_samples=28)
    assert (save / "iter_0000007" / "metadata.json").is_file() and not list_old_dirs(save, 7)
    assert "recovered iter_0000007 from " + old.name in capsys.readouterr().out
    for loaded, saved in zip(model[0].parameters(), torch.load(weights, weights_only=True)):
        assert torch.equal(loaded.detach(), saved)
