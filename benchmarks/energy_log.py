"""Energy and power of the timed steps of benchmark runs (NVIDIA, NVML), logged from outside them.

``record`` samples the device's cumulative energy counter, power and SM clock every 10 ms into a
file until it is stopped; ``per-step`` reads that file and, for every JSON line of the given
benchmark outputs that carries ``timed_unix`` (the wall-clock bounds of its timed steps, as
``train_throughput.py`` writes them) and ``step_s``, prints joules and mean watts per step and the
mean SM clock over those steps. Both the plain reference and mcore can then be compared at equal
footing: a power-limited device runs a step in ``energy / power limit``. ::

    python benchmarks/energy_log.py record energy.txt & REC=$!
    python benchmarks/train_throughput.py ... --iters 30 > mcore.json
    kill $REC
    python benchmarks/energy_log.py per-step energy.txt mcore.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import time


def record(path: str, period_s: float = 0.01) -> None:
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    with open(path, "w") as out:
        out.write(f"# power limit {pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3:.0f} W\n")
        out.write("# unix_s energy_mJ power_mW sm_MHz\n")
        while True:
            energy = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            power = pynvml.nvmlDeviceGetPowerUsage(handle)
            clock = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
            out.write(f"{time.time():.4f} {energy} {power} {clock}\n")
            out.flush()
            time.sleep(period_s)


def per_step(log: str, outputs: list[str]) -> list[dict]:
    samples = []
    with open(log) as f:
        for number, line in enumerate(f, 1):
            if line.startswith("#") or not line.strip():
                continue
            try:
                sample = tuple(map(float, line.split()))
            except ValueError:
                sample = ()
            if len(sample) != 4:
                raise SystemExit(f"{log}:{number}: not an energy sample (unix_s energy_mJ power_mW sm_MHz)")
            samples.append(sample)
    if len(samples) < 2:
        raise SystemExit(f"{log}: fewer than two energy samples")
    times = [s[0] for s in samples]

    def energy_at(t: float) -> float:  # mJ, linear between the two samples around t
        i = min(max(bisect.bisect_left(times, t), 1), len(samples) - 1)
        (t0, e0, *_), (t1, e1, *_) = samples[i - 1], samples[i]
        return e0 + (e1 - e0) * (t - t0) / max(t1 - t0, 1e-9)

    rows = []
    for path in outputs:
        for line in open(path):
            if not line.startswith("{") or "timed_unix" not in line:
                continue
            run = json.loads(line)
            u0, u1 = run["timed_unix"]
            if not times[0] <= u0 < u1 <= times[-1]:
                raise SystemExit(f"{path}: the timed steps of {run.get('peer')!r} fall outside {log}")
            steps = max(1, round((u1 - u0) / run["step_s"]))
            joules = (energy_at(u1) - energy_at(u0)) / 1e3
            clocks = [s[3] for s in samples if u0 <= s[0] <= u1]
            rows.append(
                {
                    "peer": run.get("peer"),
                    "step_ms": run["step_s"] * 1e3,
                    "joules_per_step": joules / steps,
                    "watts": joules / (u1 - u0),
                    "sm_mhz_mean": sum(clocks) / max(1, len(clocks)),
                    "tokens_per_s": run.get("tokens_per_s"),
                }
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="sample the energy counter into FILE until stopped")
    rec.add_argument("file")
    rep = sub.add_parser("per-step", help="joules and watts per timed step of benchmark JSON lines")
    rep.add_argument("file")
    rep.add_argument("outputs", nargs="+")
    a = p.parse_args(argv)
    if a.command == "record":
        record(a.file)
        return 0
    for row in per_step(a.file, a.outputs):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
