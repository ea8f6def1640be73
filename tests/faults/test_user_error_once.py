"""A user error found before the process groups exist (a bad flag) is printed once, by rank 0, not by
every rank of a torchrun job; every rank still exits with status 2."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(("rank", "lines"), [("0", 1), ("1", 0)])
def test_a_flag_error_is_printed_by_rank_zero_only(monkeypatch, capsys, rank, lines):
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    for key, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_:
        pretrain(model_provider, forward_step, argv=["--num-layers", "2", "--hiden-size", "8"])
    assert exit_.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "hiden" in line]
    assert len(err) == lines, err
