"""Issue 45's scaling table on one machine: every configuration launched, collected, tabulated.

Each row of :mod:`scaling_configs` (DP, TP+SP, PP 1F1B and interleaved, CP, EP, one-device
baselines and the torch DDP anchor) is one ``torchrun --standalone --nproc_per_node <world>``
launch of ``train_throughput.py`` (or ``ddp_anchor.py``) with Megatron's flags. The script reads the
JSON lines each launch prints, keeps every launch's output in ``--out-dir/<row>.log``, and writes
``--out-dir/scaling.json`` (the records) and ``--out-dir/scaling.md`` (the table, from
:mod:`scaling_report`). Rows that need more devices than ``--gpus`` are skipped with the reason::

    python benchmarks/scaling_table.py --dry-run --gpus 8               # the commands of 8 GPUs
    python benchmarks/scaling_table.py --only base,dp,tp --quick        # a part, few steps
    python benchmarks/scaling_table.py --only pp --merge out/scaling.json  # add to an earlier call
    python benchmarks/scaling_table.py --small --gpus 2                 # tiny shapes, CPU gloo
    python benchmarks/scaling_table.py --only tp --profile-trace 'gpt-bf16-tp8'  # + Chrome traces

``--profile-trace PATTERN`` (shell patterns over row names, comma-separated) adds 3 profiled steps and
their Chrome traces (one a rank) to the matching rows, and the per-collective overlap with compute of
:mod:`comm_overlap` to their records.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import scaling_configs as sc  # benchmarks/, next to this file
import scaling_report

HERE = Path(__file__).resolve().parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=None, help="devices to use (default: all visible; CPU: 2)")
    p.add_argument("--device-backend", default=None, help="cuda (default), cpu with --small, or npu")
    p.add_argument("--only", default=",".join(sc.FAMILIES), help=f"families, comma-separated: {sc.FAMILIES}")
    p.add_argument("--rows", default="*", help="shell patterns over row names, comma-separated")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU plumbing runs)")
    p.add_argument("--quick", action="store_true", help="few warm-up and timed steps")
    p.add_argument("--dry-run", action="store_true", help="print each command, run nothing")
    p.add_argument("--pp-microbatches-per-stage", type=int, default=4, help="m = this x p")
    p.add_argument("--profile-trace", default="", help="rows (patterns) to profile with Chrome traces")
    p.add_argument("--extra-args", default="", help="appended to every mcore command (e.g. graphs)")
    p.add_argument("--out-dir", default="scaling_out")
    p.add_argument("--merge", nargs="*", default=[], help="earlier scaling.json files to table with")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    a = p.parse_args(argv)
    a.device_backend = a.device_backend or ("cpu" if a.small else "cuda")
    a.families = tuple(f.strip() for f in a.only.split(",") if f.strip())
    bad = [f for f in a.families if f not in sc.FAMILIES]
    if bad:
        p.error(f"--only {a.only}: unknown families {bad}; known: {', '.join(sc.FAMILIES)}")
    if a.gpus is None:
        a.gpus = visible_devices(a.device_backend)
    return a


def visible_devices(backend: str) -> int:
    if backend == "cpu":
        return 2
    import torch

    return torch.get_device_module(backend).device_count()


def steps(run: sc.Run, models: dict[str, sc.Model], quick: bool) -> tuple[int, int]:
    """Warm-up and timed steps: the model's, fewer for long steps, (2, 3) / (1, 2) with --quick."""
    if quick:
        return (1, 2) if run.big else (2, 3)
    return (2, 3) if run.family == "cp" and run.world == 1 else models[run.model].warmup_iters


def command(run: sc.Run, a: argparse.Namespace, models: dict[str, sc.Model]) -> list[str]:
    """The torchrun command line of one row."""
    warmup, iters = steps(run, models, a.quick)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(run.world),
        os.path.relpath(HERE / run.script), "--device-backend", a.device_backend, *run.args,
        "--label", run.name, "--warmup", str(warmup), "--iters", str(iters),
    ]  # fmt: skip
    if run.script == "ddp_anchor.py":
        return cmd + (["--eager"] if a.device_backend == "cpu" else [])
    cmd += ["--bf16", "--no-log-memory", *sc.PA_FLAGS]
    if run.family == "ep" and a.device_backend != "cpu":
        # the all-to-all's share of the step, from device kernels (a CPU profile has none; and CPU
        # processes with gloo, the distributed optimizer and the profiler crashed in the garbage
        # collector after their results at EP=4, torch 2.13, 2026-11-29)
        cmd += ["--profile-steps", "2"]
    if profiled(run, a):
        stem = os.path.join(a.out_dir, run.name)
        cmd += [
            "--profile-steps",
            "3",
            "--profile-trace",
            f"{stem}.trace.json",
            "--profile-out",
            f"{stem}.prof.txt",
        ]
    return cmd + shlex.split(a.extra_args)


def matches(name: str, patterns: str) -> bool:
    """``name`` matches one of the comma-separated shell patterns."""
    return any(fnmatch.fnmatch(name, p.strip()) for p in patterns.split(",") if p.strip())


def profiled(run: sc.Run, a: argparse.Namespace) -> bool:
    return run.script == "train_throughput.py" and matches(run.name, a.profile_trace)


def parse_output(name: str, stdout: str) -> dict:
    """The JSON lines a launch printed for row ``name`` (the result line, then extras), merged."""
    merged: dict = {}
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("peer") == name:
            merged.update(rec)
    return merged


def execute(run: sc.Run, cmd: list[str], a: argparse.Namespace) -> dict:
    """Launch one row; its record (``status`` ok / failed / timeout, the result fields, the command)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))  # fmt: skip
    if a.device_backend == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    record = {
        "name": run.name, "family": run.family, "model": run.model, "precision": run.precision,
        "world": run.world, "layout": run.layout, "seq": run.seq, "baseline": run.baseline,
        "microbatches": run.microbatches, "theory_bubble": run.theory_bubble,
        "anchor_tokens_per_gpu": run.anchor_tokens_per_gpu, "command": shlex.join(cmd),
        "backend": a.device_backend, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }  # fmt: skip
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, rc = _text(exc.stdout), _text(exc.stderr) + f"\n[timeout after {a.timeout:.0f} s]", None
    record["wall_s"] = round(time.monotonic() - start, 1)
    Path(a.out_dir, f"{run.name}.log").write_text(f"$ {shlex.join(cmd)}\n{out}\n--- stderr\n{err}")
    result = parse_output(run.name, out)
    record["exit_code"] = rc
    if "tokens_per_s_per_device" in result:  # complete results; a crash after them is noted, not lost
        record["status"] = "ok"
        if rc != 0:
            record["error"] = f"exit code {rc} after the results: {error_line(err)}"
    else:
        record["status"] = "timeout" if rc is None else "failed"
        record["error"] = error_line(err)
    result.pop("peer", None)
    record.update({k: v for k, v in result.items() if k not in record})
    if profiled(run, a):
        record["comm_overlap"] = trace_overlap(os.path.join(a.out_dir, run.name))
    return record


def error_line(stderr: str) -> str:
    """The line that says why a launch failed: the last ``...Error: ...`` of a rank, else torchrun's
    ``exitcode`` line of a rank killed by a signal, else the last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for pattern in (r"\w(Error|Exception): \S", r"exitcode: -?\d+\)? .*(SIG|local_rank)"):
        hits = [ln for ln in lines if re.search(pattern, ln) and "ChildFailedError" not in ln]
        if hits:
            return hits[-1][-300:]
    return lines[-1][-300:] if lines else "no output"


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def trace_overlap(stem: str) -> dict:
    """:func:`comm_overlap.overlap_table` of each rank's trace ``<stem>.trace.rank*.json``."""
    import comm_overlap

    tables = {}
    for path in sorted(glob.glob(f"{stem}.trace.rank*.json")) or glob.glob(f"{stem}.trace.json"):
        try:
            with open(path) as f:
                tables[os.path.basename(path)] = comm_overlap.overlap_table(json.load(f), "nccl")
        except (OSError, ValueError, KeyError) as err:
            tables[os.path.basename(path)] = {"error": str(err)}
    return tables


def load_merged(paths: list[str]) -> dict[str, dict]:
    records: dict[str, dict] = {}
    for path in paths:
        with open(path) as f:
            for rec in json.load(f)["records"]:
                records[rec["name"]] = rec
    return records


def main(argv=None) -> int:
    a = parse_args(argv)
    models = sc.models(a.small)
    runs, skips = sc.table(a.gpus, small=a.small, families=a.families, pp_k=a.pp_microbatches_per_stage)
    runs = [r for r in runs if matches(r.name, a.rows)]
    skips = scaling_report.condensed([s for s in skips if a.rows == "*" or matches(s.name, a.rows)])
    print(f"# {len(runs)} rows on {a.gpus} {a.device_backend} devices", file=sys.stderr)
    for s in skips:
        print(f"# skip {s.name}: {s.reason}", file=sys.stderr)
    if a.dry_run:
        for run in runs:
            print(shlex.join(command(run, a, models)))
        return 0
    os.makedirs(a.out_dir, exist_ok=True)
    records = load_merged(a.merge)
    for i, run in enumerate(runs, 1):
        rec = execute(run, command(run, a, models), a)
        records[run.name] = rec
        print(f"[{i}/{len(runs)}] {scaling_report.progress_line(rec, records)}", file=sys.stderr, flush=True)
        scaling_report.write(
            a.out_dir, records, skips, models, gpus=a.gpus
        )  # after each row: a kill loses none
    scaling_report.write(a.out_dir, records, skips, models, gpus=a.gpus)
    print(Path(a.out_dir, "scaling.md").read_text())
    return 0 if all(r["status"] == "ok" for r in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
