"""``python -m mcore.checkpoint.inspect``: iterations, layout, tensor names and shapes; ``--verify``."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys

from mcore.checkpoint.inspect import describe, main


def test_inspect_prints_iterations_layout_and_tensors(tp2pp2_run):
    save, _ = tp2pp2_run
    out = io.StringIO()
    assert describe(save, verify=True, out=out) == 0
    text = out.getvalue()
    assert "tracker (latest_checkpointed_iteration.txt): 20" in text
    assert "complete iterations: 10, 20" in text
    assert "saved with: tp=2 pp=2 dp=1 vp=1 world=4" in text
    assert "distributed optimizer=no" in text
    assert "model: num_layers=4 hidden_size=32" in text
    lines = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("  ")}
    assert lines["decoder.layers.3.mlp.linear_fc1.weight"][1:3] == ["[128,", "32]"]
    assert lines["embedding.word_embeddings.weight"][1:3] == ["[1024,", "32]"]
    assert "verification OK" in text


def test_inspect_command_line_and_a_damaged_file(tp2pp2_run, tmp_path, capsys):
    save, _ = tp2pp2_run
    ckpt = tmp_path / "ckpt"
    shutil.copytree(save, ckpt)
    (ckpt / "iter_0000010.tmp-0123abcd").mkdir()
    path = ckpt / "iter_0000010" / "optim_tp01_pp000_dp000.pt"
    path.write_bytes(path.read_bytes()[:-10])
    assert main([str(ckpt), "--iteration", "10", "--verify"]) == 1
    text = capsys.readouterr().out
    assert "incomplete save (not loadable): iter_0000010.tmp-0123abcd" in text
    assert "verification FAILED (1 problem(s))" in text and "optim_tp01_pp000_dp000.pt is truncated" in text
    assert main([str(ckpt / "iter_0000020"), "--json"]) == 0
    assert '"iteration": 20' in capsys.readouterr().out
    run = subprocess.run(
        [sys.executable, "-m", "mcore.checkpoint.inspect", str(ckpt)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "== iter_0000020: iteration 20" in run.stdout, run.stderr
