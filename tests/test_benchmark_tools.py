"""The trace and energy-log arithmetic of the benchmark tools (benchmarks/), on synthetic inputs."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import comm_overlap  # noqa: E402
import energy_log  # noqa: E402


def _kernel(name, ts, dur, stream):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_comm_overlap_counts_the_time_beside_compute_per_stream_class():
    trace = {
        "traceEvents": [
            _kernel("nvjet_gemm", 0, 10, 7),
            _kernel("triton_norm", 20, 10, 7),
            _kernel("nvjet_gemm", 25, 10, 9),  # overlaps the norm: the union is [20, 35)
            _kernel("ncclDevKernel_AllGather_RING_LL", 5, 10, 17),  # [5, 15): 5 us beside [0, 10)
            _kernel("ncclDevKernel_ReduceScatter_RING", 12, 6, 7),  # [12, 18): none beside
            _kernel("ncclDevKernel_AllGather_RING_LL", 30, 10, 17),  # [30, 40): 5 us beside [20, 35)
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100, "args": {}},
        ]
    }
    table = comm_overlap.overlap_table(trace, "nccl")
    assert table == {"AllGather side-stream": [2, 20.0, 10.0], "ReduceScatter main-stream": [1, 6.0, 0.0]}


def test_energy_log_gives_joules_and_watts_per_timed_step(tmp_path):
    log = tmp_path / "energy.txt"
    # 700 W: 700 mJ every millisecond... sampled every 0.1 s (70,000 mJ a sample), 1500 MHz
    log.write_text(
        "# power limit 700 W\n" + "".join(f"{100 + i / 10:.4f} {70000 * i} 700000 1500\n" for i in range(50))
    )
    run = {"peer": "x", "step_s": 0.125, "timed_unix": [100.5, 101.5], "tokens_per_s": 1.0}
    out = tmp_path / "run.json"
    out.write_text("not json\n" + json.dumps(run) + "\n")
    (row,) = energy_log.per_step(str(log), [str(out)])
    assert row["joules_per_step"] == pytest.approx(700 * 0.125)
    assert row["watts"] == pytest.approx(700)
    assert row["sm_mhz_mean"] == 1500
    late = dict(run, timed_unix=[104.0, 106.0])
    out.write_text(json.dumps(late) + "\n")
    with pytest.raises(SystemExit, match="fall outside"):
        energy_log.per_step(str(log), [str(out)])
    log.write_text(log.read_text() + "101.0 12 oops\n")
    with pytest.raises(SystemExit, match=r"energy.txt:52: not an energy sample"):
        energy_log.per_step(str(log), [str(out)])
