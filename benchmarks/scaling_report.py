"""The scaling table's arithmetic and markdown, from the records of :mod:`scaling_table`.

Per row: tokens/s per device over its one-device baseline (same model, precision, sequence); for
pipeline rows the measured bubble, ``1 - m * t_fb(1) / (p * t_fb(PP))`` with ``t_fb`` the
forward+backward phase of a step (``--phases``: the one-device run's is one micro-batch's), against
the schedule's ``(p-1)/(m+p-1)`` (1F1B) or ``(p-1)/(v*m+p-1)`` (interleaved); for TP rows the share of
DP at the same size; for EP rows the all-to-all's (NCCL SendRecv kernels') share of the profiled
step; for CP rows the share of torchtitan's published tokens/s per H100; for DP rows the share of
the torch DDP anchor at the same size.
"""

from __future__ import annotations

import json
import os


def condensed(skips: list) -> list:
    """Rows skipped for the same reason in one entry (``a, b, c: reason``), in first-seen order."""
    by_reason: dict[str, list[str]] = {}
    for s in skips:
        by_reason.setdefault(s.reason, []).append(s.name)
    return [type(skips[0])(", ".join(names), reason) for reason, names in by_reason.items()] if skips else []


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def tps(rec: dict | None) -> float | None:
    return rec.get("tokens_per_s_per_device") if rec and rec.get("status") == "ok" else None


def measured_bubble(rec: dict, base: dict | None) -> float | None:
    """``1 - m * t_fb(one device, one micro-batch) / (p * t_fb(PP))`` from the phase times."""
    try:
        fb1 = base["phases_ms"]["forward_backward"]
        fbp = rec["phases_ms"]["forward_backward"]
    except (KeyError, TypeError):
        return None
    return 1.0 - rec["microbatches"] * fb1 / (rec["world"] * fbp)


def a2a_share(rec: dict) -> float | None:
    """The all-to-all's (SendRecv kernels') device time over the profiled step's wall time."""
    prof = rec.get("profile") or {}
    wall = prof.get("wall_ms_per_step")
    send = (prof.get("collectives_ms_per_step") or {}).get("SendRecv")
    return send / wall if wall and send is not None else None


def derived(rec: dict, records: dict[str, dict]) -> dict:
    """The comparisons of one row (see the module doc); None where an input is missing."""
    base = records.get(rec.get("baseline") or "")
    out = {"of_one_device": ratio(tps(rec), tps(base))}
    fam, name = rec["family"], rec["name"]
    if fam == "pp":
        out["bubble"] = measured_bubble(rec, base)
        out["theory_bubble"] = rec.get("theory_bubble")
    if fam == "tp":
        out["of_dp_same_size"] = ratio(tps(rec), tps(records.get(name.replace("-tp", "-dp"))))
    if fam == "dp" and rec["precision"] == "bf16" and rec["model"] == "gpt":
        out["of_torch_ddp"] = ratio(tps(rec), tps(records.get(f"gpt-bf16-ddp{rec['world']}")))
    if fam == "ep":
        out["a2a_share"] = a2a_share(rec)
    if fam == "cp" and rec.get("anchor_tokens_per_gpu"):
        out["of_torchtitan"] = ratio(tps(rec), rec["anchor_tokens_per_gpu"])
    return out


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def notes(rec: dict, d: dict) -> str:
    parts = []
    if rec.get("status") != "ok" or rec.get("error"):
        parts.append(f"{rec.get('status')}: {rec.get('error', '')}")
    if d.get("theory_bubble") is not None:
        parts.append(f"bubble {_pct(d.get('bubble')) or '?'} (schedule {_pct(d['theory_bubble'])})")
    for key, label in (("of_dp_same_size", "of DP same size"), ("of_torch_ddp", "of torch DDP"),
                       ("a2a_share", "all-to-all share of step"), ("of_torchtitan", "of torchtitan/H100")):  # fmt: skip
        if d.get(key) is not None:
            parts.append(f"{_pct(d[key])} {label}")
    if rec.get("comm_overlap"):
        parts.append("traces profiled")
    return "; ".join(parts)


def markdown(records: dict[str, dict], skips, models, gpus: int) -> str:
    """One table per model, rows in launch order, then the skipped rows with their reasons."""
    lines = [f"Scaling table on {gpus} devices (`benchmarks/scaling_table.py`), tokens/s per device.", ""]
    for key, model in models.items():
        rows = [r for r in records.values() if r["model"] == key]
        if not rows:
            continue
        lines += [f"### {model.title}", "",
                  "| row | devices | layout | precision | tokens/s per device | of 1 device | MFU | peak GiB | notes |",
                  "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
        for r in rows:
            d = derived(r, records)
            t, mfu, mem = tps(r), r.get("mfu"), r.get("peak_mem_gib")
            lines.append(
                f"| {r['name']} | {r['world']} | {r['layout']} | {r['precision']} | "
                f"{'' if t is None else f'{t:,.0f}'} | {_pct(d['of_one_device'])} | {_pct(mfu)} | "
                f"{'' if mem is None else f'{mem:.1f}'} | {notes(r, d)} |"
            )
        lines.append("")
    if skips:
        lines += ["Skipped:", ""] + [f"* {s.name}: {s.reason}" for s in skips] + [""]
    return "\n".join(lines)


def write(out_dir: str, records: dict[str, dict], skips, models, gpus: int) -> None:
    """``scaling.json`` (records with their comparisons) and ``scaling.md`` under ``out_dir``."""
    full = {name: {**r, "derived": derived(r, records)} for name, r in records.items()}
    with open(os.path.join(out_dir, "scaling.json"), "w") as f:
        json.dump({"gpus": gpus, "records": list(full.values()),
                   "skipped": [{"name": s.name, "reason": s.reason} for s in skips]}, f, indent=1)  # fmt: skip
    with open(os.path.join(out_dir, "scaling.md"), "w") as f:
        f.write(markdown(records, skips, models, gpus))


def progress_line(rec: dict, records: dict[str, dict]) -> str:
    d = derived(rec, records)
    t = tps(rec)
    speed = "" if t is None else f" {t:,.0f} tokens/s per device"
    rel = "" if d["of_one_device"] is None else f" ({_pct(d['of_one_device'])} of 1 device)"
    return f"{rec['name']}: {rec['status']}{speed}{rel}, {rec['wall_s']} s {notes(rec, d)}"
