"""``benchmarks.big_model``'s numbers: every rank's measurements (``big_model_worker.probe``) summed up per world,
route and phase, and the Markdown tables."""

from __future__ import annotations

import statistics

MIB = 2**20
LOAD_PEAK_TARGET = 1.10  # load peak per rank <= (model / world) x this
LOAD_TIME_TARGET = 1.20  # load time <= reading the files once x this


def phase_summary(ranks: list[dict], phase: str, model_bytes: int, world: int) -> dict:
    """One phase over ranks and repeats: time (slowest rank per repeat; min / median / max over repeats) and the
    largest peaks of any rank in any repeat."""
    repeats = len(ranks[0][phase])
    times = [max(r[phase][i]["seconds"] for r in ranks) for i in range(repeats)]
    every = [m for r in ranks for m in r[phase]]
    delta = max(m["hwm"] - m["rss_before"] for m in every)
    anon = max(m["anon_peak"] - m["anon_before"] for m in every)
    share = model_bytes / world
    return {
        "seconds": [min(times), statistics.median(times), max(times)],
        "hwm_delta": delta,
        "hwm_delta_per_rank": [max(m["hwm"] - m["rss_before"] for m in r[phase]) for r in ranks],
        "hwm_abs": max(m["hwm"] for m in every),
        "anon_delta": anon,
        "file_peak": max(m["file_peak"] for m in every),
        "anon_after": max(r[phase][-1]["anon_after"] for r in ranks),
        "anon_before_first_last": [
            max(r[phase][0]["anon_before"] for r in ranks),
            max(r[phase][-1]["anon_before"] for r in ranks),
        ],
        "of_share": delta / share,
        "anon_of_share": anon / share,
    }


def summarize(runs: list[dict], model_bytes: int) -> list[dict]:
    """A row per (world, route, phase) that ran, or per failed route; load rows with their time ratios to the
    same world's read baselines."""
    rows: list[dict] = []
    baselines: dict[int, dict[str, float]] = {}
    for run in runs:
        world, route = run["world"], run["route"]
        load = run["loadavg_before"][0], run["loadavg_after"][0]
        if run["error"] is not None:
            rows.append({"world": world, "route": route, "phase": "-", "error": run["error"], "loadavg": load})
            continue
        for phase in run["ranks"][0]:
            row = {"world": world, "route": route, "phase": phase, "loadavg": load}
            row.update(phase_summary(run["ranks"], phase, model_bytes, world))
            if phase.startswith(("read", "write")):
                baselines.setdefault(world, {})[phase] = row["seconds"][1]
            if phase == "save":
                row["saved_equal"] = run.get("saved_equal")
            rows.append(row)
    for row in rows:
        mine = baselines.get(row["world"], {})
        if row["phase"] == "load":
            for name in ("read_all", "read_part"):
                if name in mine:
                    row[f"over_{name}"] = row["seconds"][1] / mine[name]
        if row["phase"] == "save" and "write_all" in mine:
            row["over_write_all"] = row["seconds"][1] / mine["write_all"]
    return rows


def targets(rows: list[dict]) -> list[str]:
    """Whether zgraph's load holds the issue's targets, per world."""
    lines = []
    for row in rows:
        if row["route"] != "zgraph" or row["phase"] != "load":
            continue
        peak = "holds" if row["of_share"] <= LOAD_PEAK_TARGET else "misses"
        anon = "holds" if row["anon_of_share"] <= LOAD_PEAK_TARGET else "misses"
        ratio = row.get("over_read_all", float("nan"))
        time = "holds" if ratio <= LOAD_TIME_TARGET else "misses"
        lines.append(
            f"- world {row['world']}: peak {row['of_share']:.2f}x model/world by VmHWM ({peak}), "
            f"{row['anon_of_share']:.2f}x by private memory RssAnon ({anon}); time {ratio:.2f}x reading every "
            f"file ({time}), {row.get('over_read_part', float('nan')):.2f}x reading 1/world of them"
        )
    return lines


HEAD = (
    "| route | phase | s min / median / max | x baseline | x read 1/world | peak ΔVmHWM / rank MiB | ÷ model/world "
    "| peak ΔRssAnon MiB | ÷ model/world | peak RssFile MiB | VmHWM MiB | RssAnon after MiB | load avg |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _row(row: dict) -> str:
    load = f"{row['loadavg'][0]:.2f}→{row['loadavg'][1]:.2f}"
    if "error" in row:
        return f"| {row['route']} | fails: {row['error']} |" + " |" * 10 + f" {load} |"
    s = " / ".join(f"{t:.2f}" for t in row["seconds"])
    first = "over_write_all" if row["phase"] == "save" else "over_read_all"
    ratio = [f"{row[k]:.2f}" if k in row else "" for k in (first, "over_read_part")]
    phase = row["phase"] + ({True: " (files equal)", False: " (FILES DIFFER)"}.get(row.get("saved_equal"), ""))
    return (
        f"| {row['route']} | {phase} | {s} | {ratio[0]} | {ratio[1]} | {row['hwm_delta'] / MIB:.0f} | "
        f"{row['of_share']:.2f} | {row['anon_delta'] / MIB:.0f} | {row['anon_of_share']:.2f} | "
        f"{row['file_peak'] / MIB:.0f} | {row['hwm_abs'] / MIB:.0f} | {row['anon_after'] / MIB:.0f} | {load} |"
    )


def markdown(about: dict, rows: list[dict]) -> str:
    shape = ", ".join(f"{k} {v}" for k, v in about["shape"].items())
    out = [
        f"# big_model {about['date']}\n",
        f"`{about['command'].strip()}`: Llama ({shape}), {about['parameters'] / 1e9:.3f} B parameters, "
        f"{about['dtype']} on disk and in memory: model {about['model_bytes'] / MIB:.0f} MiB in {about['files']} "
        f"safetensors files; torch {about['torch']}, {about['cpus']} CPUs, gloo, one thread per rank; "
        f"{about['repeats']} loads and {about['save_repeats']} saves per route (peaks: the largest of any rank and "
        "repeat). Page cache warm for every read.\n",
    ]
    for world in dict.fromkeys(row["world"] for row in rows):
        share = about["model_bytes"] / world / MIB
        out += [f"\n## {world} rank{'s' if world > 1 else ''} (model/world = {share:.0f} MiB)\n", HEAD]
        out += [_row(row) for row in rows if row["world"] == world]
    out += ["\n## Targets (zgraph load: peak ≤ 1.10x model/world, time ≤ 1.20x reading the files once)\n"]
    out += targets(rows)
    return "\n".join(out) + "\n"
