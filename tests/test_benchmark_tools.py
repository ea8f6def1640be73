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


def test_scaling_table_commands_for_8_gpus_parse_and_one_cpu_row_runs(tmp_path, capsys):
    """Issue 45's table: the 8-GPU dry run names every family's rows, each mcore command passes mcore's
    own validation at its world size, and one real 2-process CPU row runs through the script."""
    import types

    import scaling_report
    import scaling_table
    import train_throughput

    from mcore.training.pretrain import check_run_config

    assert scaling_table.main(["--dry-run", "--gpus", "8"]) == 0
    out, err = capsys.readouterr()
    commands = {c.split("--label ")[1].split()[0]: c for c in out.strip().splitlines()}
    for name in ("gpt-bf16-dp8", "gpt-fp8-tp8", "llama-bf16-pp8v2", "gpt-bf16-pp8v3", "llama-bf16-cp8-s131072",
                 "olmoe-bf16-ep8", "mixtral-bf16-ep8", "gpt-bf16-ddp8", "gpt-bf16-ddp1", "llama-fp8-1"):  # fmt: skip
        assert name in commands, name
    assert (
        "--nproc_per_node 8" in commands["gpt-bf16-dp8"]
        and "--overlap-param-gather" in commands["gpt-bf16-dp8"]
    )
    assert "skip llama-bf16-1-s131072: seq 131072 does not fit one H200" in err
    assert "ddp_anchor.py" in commands["gpt-bf16-ddp8"]
    cuda = types.SimpleNamespace(
        name="cuda", capabilities=lambda: frozenset({"bf16", "fp32", "fp8", "fused_adam"})
    )
    checked = 0
    for cmd in commands.values():
        world = int(cmd.split("--nproc_per_node ")[1].split()[0])
        if "train_throughput.py" in cmd and world in (1, 8):
            args = cmd.split()[cmd.split().index("--device-backend") :]
            ours, cfg = train_throughput.parse_args(args)
            check_run_config(cfg, cuda, world)  # raises ConfigError naming the flag
            checked += 1
    assert checked >= 20
    # the comparisons: a pipeline row's bubble from the phase times, EP's all-to-all share
    pp = {"name": "x-pp4", "family": "pp", "model": "gpt", "precision": "bf16", "world": 4, "microbatches": 16,
          "status": "ok", "tokens_per_s_per_device": 80.0, "baseline": "b", "phases_ms": {"forward_backward": 500.0},
          "theory_bubble": 3 / 19}  # fmt: skip
    base = {"status": "ok", "tokens_per_s_per_device": 100.0, "phases_ms": {"forward_backward": 100.0}}
    d = scaling_report.derived(pp, {"b": base})
    assert d["of_one_device"] == pytest.approx(0.8) and d["bubble"] == pytest.approx(1 - 16 * 100 / (4 * 500))
    ep = {"profile": {"wall_ms_per_step": 200.0, "collectives_ms_per_step": {"SendRecv": 50.0}}}
    assert scaling_report.a2a_share(ep) == pytest.approx(0.25)
    # the CPU memory table counts each model's parameters as mcore builds them (tiny shapes)
    import scaling_configs
    import scaling_memory

    from mcore.distributed.groups import ProcessGroups
    from mcore.models.gpt.gpt_model import GPTModel
    from mcore.models.transformer.model_config import padded_vocab_size

    for model in scaling_configs.models(small=True).values():
        cfg = scaling_memory.model_config(model)
        vocab = padded_vocab_size(model.vocab, cfg.model.make_vocab_size_divisible_by, 1)
        real = sum(p.numel() for p in GPTModel(cfg.model, ProcessGroups.single(), vocab).parameters())
        assert scaling_memory.stage_params(cfg, scaling_memory.Layout("1"), vocab)[0] == real, model.key
    # one real row: DP=2 of the tiny GPT on 2 CPU processes (gloo), against a one-device record merged in
    earlier = tmp_path / "earlier.json"
    one = {"name": "gpt-bf16-1", "family": "base", "model": "gpt", "precision": "bf16", "world": 1, "layout": "1",
           "status": "ok", "tokens_per_s_per_device": 1000.0}  # fmt: skip
    earlier.write_text(json.dumps({"records": [one]}))
    argv = ["--small", "--gpus", "2", "--quick", "--rows", "gpt-bf16-dp2", "--out-dir", str(tmp_path / "o")]
    assert scaling_table.main([*argv, "--merge", str(earlier)]) == 0, (
        tmp_path / "o" / "gpt-bf16-dp2.log"
    ).read_text()
    records = {r["name"]: r for r in json.loads((tmp_path / "o" / "scaling.json").read_text())["records"]}
    row = records["gpt-bf16-dp2"]
    assert row["status"] == "ok" and row["dp"] == 2 and row["world"] == 2
    assert row["derived"]["of_one_device"] == pytest.approx(row["tokens_per_s_per_device"] / 1000.0)
    assert "| gpt-bf16-dp2 | 2 | DP=2 | bf16 |" in (tmp_path / "o" / "scaling.md").read_text()
