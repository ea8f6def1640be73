"""benchmarks/fp8_convergence.py: the statistics of the seed comparison on hand-made numbers, the
resumable results file, and one tiny CPU run of the real script (2 seeds, bf16 and FP8 delayed)."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import fp8_convergence as conv  # noqa: E402


def _run(valid, train=None):
    return {"valid_loss": valid, "final_train_loss": valid + 0.5 if train is None else train}


def test_summary_gives_means_relative_differences_and_the_bf16_seed_spread():
    runs = {
        "bf16": {"1": _run(2.0), "2": _run(2.2), "3": _run(2.1)},
        # -1%, 0%, +2% per seed
        "fp8 hybrid delayed": {"1": _run(1.98), "2": _run(2.2), "3": _run(2.142)},
        # only seeds 1 and 2: compared with bf16's mean over those two (2.1), not over all three
        "fp8 hybrid tensorwise": {"1": _run(2.2), "2": _run(2.5)},
    }
    summary = conv.summarize(runs)
    base = summary["configs"]["bf16"]["valid"]
    assert base["mean"] == pytest.approx(2.1)
    assert base["spread_rel"] == pytest.approx(0.2 / 2.1)
    assert "rel_diff_of_means" not in base
    assert summary["baseline_valid_spread_rel"] == pytest.approx(0.2 / 2.1)

    delayed = summary["configs"]["fp8 hybrid delayed"]["valid"]
    assert delayed["per_seed"] == {"1": 1.98, "2": 2.2, "3": 2.142}
    assert delayed["mean"] == pytest.approx(6.322 / 3)
    assert delayed["rel_diff_per_seed"] == pytest.approx({"1": -0.01, "2": 0.0, "3": 0.02})
    assert delayed["rel_diff_of_means"] == pytest.approx((6.322 / 3 - 2.1) / 2.1)
    assert delayed["spread_rel"] == pytest.approx((2.2 - 1.98) / (6.322 / 3))
    # the final training losses get the same treatment
    train = summary["configs"]["fp8 hybrid delayed"]["train"]
    assert train["rel_diff_per_seed"]["1"] == pytest.approx((2.48 - 2.5) / 2.5)

    tensorwise = summary["configs"]["fp8 hybrid tensorwise"]["valid"]
    assert tensorwise["paired_seeds"] == ["1", "2"]
    assert tensorwise["rel_diff_of_means"] == pytest.approx((2.35 - 2.1) / 2.1)

    verdict = summary["verdict"]
    assert verdict["fp8 hybrid delayed"]["within_target"] is True  # +0.35% of the means
    assert verdict["fp8 hybrid delayed"]["beyond_baseline_spread"] is False  # spread 9.5%
    assert verdict["fp8 hybrid tensorwise"]["within_target"] is False  # +11.9%: not within 1%...
    assert verdict["fp8 hybrid tensorwise"]["beyond_baseline_spread"] is True  # ...and beyond 9.52%
    text = conv.format_summary(summary)
    assert "-1.00% +0.00% +2.00% | +0.35%" in text
    assert (
        "fp8 hybrid tensorwise: validation mean +11.90% vs bf16: NOT within 1%; beyond bf16's seed spread 9.52%"
        in text
    )

    # one bf16 seed: no spread to judge by; a run without a validation loss is left out of it
    one = conv.summarize(
        {"bf16": {"1": _run(2.0)}, "fp8 hybrid delayed": {"1": _run(2.01), "2": _run(None, 3.0)}}
    )
    assert one["baseline_valid_spread_rel"] is None
    assert one["verdict"]["fp8 hybrid delayed"] == {
        "rel_diff_of_means": pytest.approx(0.005),
        "within_target": True,
        "beyond_baseline_spread": None,
    }
    assert one["configs"]["fp8 hybrid delayed"]["train"]["per_seed"] == {"1": 2.51, "2": 3.0}


def test_results_file_is_resumed_only_with_the_same_settings_and_skips_finished_runs(tmp_path):
    out = tmp_path / "conv.json"
    settings = {"iters": 500, "eval_iters": 20, "data_digest": "abc"}
    results = conv.load_results(out, settings)
    assert results["runs"] == {}
    assert conv.pending(results, ["bf16", "fp8 hybrid delayed"], [1, 2]) == [
        ("bf16", 1),
        ("fp8 hybrid delayed", 1),
        ("bf16", 2),
        ("fp8 hybrid delayed", 2),
    ]
    results["runs"] = {"bf16": {"1": _run(2.0), "2": _run(2.1)}, "fp8 hybrid delayed": {"2": _run(2.0)}}
    conv.write_atomic(out, results)
    assert [p.name for p in tmp_path.iterdir()] == ["conv.json"]  # the temporary name is gone

    again = conv.load_results(out, dict(settings))
    assert again["runs"] == results["runs"]
    assert conv.pending(again, ["bf16", "fp8 hybrid delayed"], [1, 2, 3]) == [
        ("fp8 hybrid delayed", 1),
        ("bf16", 3),
        ("fp8 hybrid delayed", 3),
    ]

    before = out.read_text()
    with pytest.raises(
        SystemExit, match=r"conv.json: cannot resume from it, made with other settings \(iters: 500"
    ):
        conv.load_results(out, dict(settings, iters=400))
    out.write_text(json.dumps({"title": "x", "runs": {"bf16": [[5, 7.0]]}}))  # the one-seed layout
    with pytest.raises(SystemExit, match="conv.json: cannot resume from it: not a layout-2 results file"):
        conv.load_results(out, settings)
    out.write_text(before[:-10])
    with pytest.raises(SystemExit, match="conv.json: cannot resume from it, not a results JSON"):
        conv.load_results(out, settings)
    assert out.read_text() == before[:-10]  # left as it was


def test_a_tiny_cpu_run_over_two_seeds_stores_a_validation_loss_per_run_and_resumes(tmp_path):
    out, work = tmp_path / "conv.json", tmp_path / "work"
    tiny = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
        "--micro-batch-size 2 --global-batch-size 4 --log-interval 1 --num-workers 0 --lr-warmup-iters 1"
    )
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "fp8_convergence.py"), "--device-backend", "cpu",
        "--workdir", str(work), "--out", str(out), "--iters", "3", "--eval-iters", "2", "--corpus-mb", "1",
        "--vocab-size", "300", "--seeds", "11", "12", "--runs", "bf16", "fp8 hybrid delayed",
        f"--model-args={tiny}",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    results = json.loads(out.read_text())
    assert results["layout"] == 2
    for name in ("bf16", "fp8 hybrid delayed"):
        assert sorted(results["runs"][name]) == ["11", "12"]
        for run in results["runs"][name].values():
            assert math.isfinite(run["valid_loss"]) and 3 < run["valid_loss"] < 8
            assert [it for it, _ in run["train"]] == [1, 2, 3]
            assert run["final_train_loss"] == run["train"][-1][1]
            assert run["wall_s"] > 0
    # the seed reaches the trainer: two seeds, two different runs
    assert results["runs"]["bf16"]["11"]["train"] != results["runs"]["bf16"]["12"]["train"]
    verdict = results["summary"]["verdict"]["fp8 hybrid delayed"]
    assert abs(verdict["rel_diff_of_means"]) < 0.01
    assert results["validation_split"]["sequences_read"] == 8  # --model-args override MODEL's sizes
    assert results["title"].startswith("GPT 2L h64 s64 gbs4, 3 steps")
    assert "final validation loss" in first.stdout and "fp8 hybrid delayed seed 12" in first.stdout

    # the same command again: every run is there, none is trained, the results are unchanged
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "4 of the asked runs are there already" in second.stdout and "0 runs in" in second.stdout
    assert json.loads(out.read_text())["runs"] == results["runs"]

    png = tmp_path / "conv.png"
    conv.plot(out, png)
    assert png.stat().st_size > 0
