"""The report side of ``benchmarks.gpu``: a system's ranks summarised into a ``Row``, the rows' ratios to a
reference system, the Markdown report (machine, tests, the side-by-side table, the offload case and its verdict
against ``OFFLOAD_TARGET``), the JSON result file, and what makes the command fail.

Pure formatting over the result dictionaries ``benchmarks.gpu`` builds (``--dry-run`` fills them with made-up
numbers): nothing here starts a process or touches a GPU, and nothing imports ``benchmarks.gpu``.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.compare_machine import last_lines

GIB = 2**30
OFFLOAD_TARGET = 1.5  # zgraph's tokens/s over DeepSpeed ZeRO-Offload's
TABLE_REFERENCE = "ddp"
OFFLOAD_REFERENCE = "deepspeed-offload"
LOSS_WARN = 0.02  # a first loss this far (relative) from the reference row's is flagged: not the same training
LABELS = {
    "ddp": "DDP",
    "fsdp2": "FSDP2",
    "fsdp2-compiled": "FSDP2 + torch.compile",
    "fsdp2-offload": "FSDP2 + CPUOffloadPolicy",
    "deepspeed-z3": "DeepSpeed ZeRO-3",
    "deepspeed-offload": "DeepSpeed ZeRO-Offload",
    "zgraph-eager": "zgraph ZeRO-3, eager",
    "zgraph-inductor": "zgraph ZeRO-3, inductor",
    "zgraph-offload": 'zgraph offload_optimizer="cpu", update on the device',
    "zgraph-host": "zgraph offload, update on the host",
    "zgraph-host-overlap": 'zgraph offload, host update offload_overlap="one_step"',
}
EXACT_OFFLOAD = ("zgraph-host", "zgraph-offload")  # the verdict's zgraph row: the first of these that ran


@dataclass
class Row:
    """One system of one part, summarised."""

    part: str
    system: str
    status: str = "skipped"  # ok, failed, skipped
    why: str | None = None
    world: int | None = None
    params: int | None = None
    layers: int | None = None
    precision: str | None = None
    tokens_per_step: int | None = None
    step_min_s: float | None = None
    step_median_s: float | None = None
    step_max_s: float | None = None
    tokens_per_s: float | None = None
    ratio: float | None = None
    peak_gib: float | None = None
    warmup_peak_gib: float | None = None
    host_peak_gib: float | None = None
    pcie_gib: float | None = None  # host<->device bytes of one step (profiled), both ways, in GiB
    pcie_bytes_per_param: float | None = None
    first_step_s: float | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    wall_s: float | None = None
    notes: list[str] = field(default_factory=list)
    error: str | None = None


# ------------------------------------------------------------------------------------------------ summarising
def summarize(part: str, system: str, ranks: list[dict[str, Any]], error: str | None, wall_s: float) -> Row:
    """A row from the ranks' JSON results: per timed step the slowest rank's time; peaks the largest rank's."""
    row = Row(part, system, wall_s=wall_s)
    caught = [r["error"] for r in ranks if r.get("error")]
    if error or caught or not ranks:
        row.status = "failed"
        row.error = "\n".join([*caught, error or ""]).strip() or "no rank wrote a result"
        row.why = last_lines(row.error, 1)
        return row
    steps = [max(times) for times in zip(*(r["step_s"] for r in ranks))]
    first = ranks[0]
    row.status, row.world, row.params, row.layers = "ok", first["world_size"], first["params"], first["layers"]
    row.precision, row.tokens_per_step = first["precision"], first["tokens_per_step"]
    row.step_min_s, row.step_median_s, row.step_max_s = min(steps), statistics.median(steps), max(steps)
    row.tokens_per_s = row.tokens_per_step / row.step_median_s
    row.peak_gib = max(r["peak_bytes"] for r in ranks) / GIB
    row.warmup_peak_gib = max(r["warmup_peak_bytes"] for r in ranks) / GIB
    row.host_peak_gib = max(r["peak_rss_mib"] for r in ranks) / 1024
    row.first_step_s = max(r["warmup_s"][0] for r in ranks) if first["warmup_s"] else None
    row.first_loss = statistics.fmean(r["warmup_losses"][0] for r in ranks) if first["warmup_losses"] else None
    row.last_loss = statistics.fmean(r["losses"][-1] for r in ranks)
    if first.get("pcie_bytes"):
        moved = sum(first["pcie_bytes"].values())
        row.pcie_gib, row.pcie_bytes_per_param = moved / GIB, moved / row.params
    row.notes += first.get("notes", [])
    if first.get("memory_cap_bytes"):
        row.notes.append(f"allocator capped at {first['memory_cap_bytes'] / GIB:.1f} GiB")
    return row


def add_ratios(rows: list[Row], reference: str) -> None:
    """tokens/s over the reference row's; flag a first loss far from the reference's."""
    ref = next((r for r in rows if r.system == reference and r.status == "ok"), None)
    if ref is None:
        return
    for row in rows:
        if row.status != "ok":
            continue
        row.ratio = row.tokens_per_s / ref.tokens_per_s
        if row is not ref and ref.first_loss and row.first_loss is not None:
            off = abs(row.first_loss - ref.first_loss) / abs(ref.first_loss)
            if off > LOSS_WARN:
                row.notes.append(f"first loss {off:.1%} from {LABELS[reference]}'s")


# ------------------------------------------------------------------------------------------------ output
def _cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _steps(row: Row) -> str:
    if row.step_median_s is None:
        return "—"
    return f"{row.step_min_s:.3f} / {row.step_median_s:.3f} / {row.step_max_s:.3f}"


def _notes(row: Row) -> str:
    notes = list(row.notes)
    if row.status != "ok":
        notes.insert(0, f"{row.status.upper()}: {row.why}")
    return "; ".join(n.replace("|", "\\|").replace("\n", " ") for n in notes)


def _pcie(row: Row) -> str:
    return "—" if row.pcie_gib is None else f"{row.pcie_gib:.2f} ({row.pcie_bytes_per_param:.1f})"


def markdown_table(rows: list[Row], reference: str, offload: bool = False) -> str:
    """The rows as a Markdown table; ``offload``: with the host's peak and the bytes over PCIe (the offload case)."""
    head = "| system | precision | ranks | step s min / median / max | tokens/s | vs " + LABELS[reference]
    extra = " host peak GiB | PCIe GiB per step (bytes per parameter) |" if offload else ""
    head += " | peak GiB (device) |" + extra + " 1st step s | loss 1st → last | notes |"
    lines = [head, "|---|---|---:|---|---:|---:|---:|" + ("---:|---:|" if offload else "") + "---:|---|---|"]
    for r in rows:
        loss = "—" if r.first_loss is None else f"{r.first_loss:.4f} → {r.last_loss:.4f}"
        cells = [
            LABELS.get(r.system, r.system),
            r.precision or "—",
            _cell(r.world, "d"),
            _steps(r),
            _cell(r.tokens_per_s, ",.0f"),
            _cell(r.ratio, ".2f"),
            _cell(r.peak_gib, ".2f"),
            *([_cell(r.host_peak_gib, ".1f"), _pcie(r)] if offload else []),
            _cell(r.first_step_s, ".1f"),
            loss,
            _notes(r),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def offload_verdict(rows: list[Row]) -> tuple[float | None, str]:
    """zgraph's exact update (``EXACT_OFFLOAD``'s first row that ran) over DeepSpeed ZeRO-Offload in tokens/s, and
    the line that says it against the target (and what the one-step-late overlap gives, where it ran)."""
    by = {r.system: r for r in rows if r.status == "ok"}
    ours = next((s for s in EXACT_OFFLOAD if s in by), None)
    if ours is None or OFFLOAD_REFERENCE not in by:
        missing = [LABELS[s] for s in (EXACT_OFFLOAD[0], OFFLOAD_REFERENCE) if s not in by]
        return None, f"zgraph / DeepSpeed ZeRO-Offload tokens/s: not measured ({', '.join(missing)} did not run)"
    ratio = by[ours].tokens_per_s / by[OFFLOAD_REFERENCE].tokens_per_s
    verdict = "meets" if ratio >= OFFLOAD_TARGET else "BELOW"
    line = f"{LABELS[ours]} / DeepSpeed ZeRO-Offload tokens/s: {ratio:.2f}x ({verdict} the {OFFLOAD_TARGET}x target)"
    if "zgraph-host-overlap" in by:
        overlap = by["zgraph-host-overlap"].tokens_per_s / by[OFFLOAD_REFERENCE].tokens_per_s
        line += f'; with offload_overlap="one_step": {overlap:.2f}x'
    return ratio, line


def tests_lines(tests: dict[str, Any]) -> list[str]:
    """The tests' outcome: counts, failures, the estimate's ratios."""
    if tests.get("status") == "skipped":
        return [f"tests/gpu: skipped: {tests.get('why')}"]
    lines = [f"tests/gpu: {tests.get('summary') or tests.get('why') or 'no summary'} ({tests.get('wall_s', 0):.0f} s)"]
    lines += [f"  FAILED {name}" for name in tests.get("failed", [])]
    for record in tests.get("records", []):
        if record.get("test", "").startswith("estimate["):
            lines.append(
                f"  {record['test']}: estimate / measured peak {record['ratio']:.3f} (raw {record['raw_ratio']:.3f}; "
                f"{record['estimated_mib']:.0f} vs {record['measured_mib']:.0f} MiB, {record['outside_mib']:.0f} MiB "
                "outside the step)"
            )
    return lines


def report(result: dict[str, Any]) -> str:
    """Everything as Markdown: machine, tests, both tables, what was skipped and why."""
    machine = result["machine"]
    settings = result["settings"]
    out = [
        f"## GPU check: {machine['card']} x{machine['count']}, {machine['date']}",
        "",
        f"- torch {machine['torch']} (CUDA {machine['cuda']}), DeepSpeed {machine['deepspeed']}, zgraph "
        f"{machine['zgraph']}; host: {machine['cpu_count']} CPUs ({machine['cpu']}), {machine['host_gib']:.0f} GiB",
        f"- budget {settings['budget']:.0f} s, used {result['elapsed_s']:.0f} s; {settings['warmup']} warm-up steps, "
        f"{settings['steps']} timed; precision `{settings['precision']}`",
        f"- GPU kit (benchmarks.gpu_kit): {machine.get('kit', 'not given')}",
        "",
        *tests_lines(result["tests"]),
    ]
    table = [Row(**r) for r in result["table"]["rows"]]
    if table:
        first = next((r for r in table if r.params), None)
        size = f"{first.params / 1e9:.2f} B parameters, " if first else ""
        out += [
            "",
            f"### Llama ~1B ({size}micro-batch {settings['micro_batch']} x seq {settings['seq']} per rank)",
            "",
            markdown_table(table, TABLE_REFERENCE),
        ]
    offload = [Row(**r) for r in result["offload"]["rows"]]
    if offload:
        sizing = result["offload"]["sizing"]
        out += [
            "",
            f"### One GPU, AdamW states do not fit: {sizing['text']}",
            "",
            markdown_table(offload, OFFLOAD_REFERENCE, offload=True),
            "",
            result["offload"]["verdict"],
        ]
    skipped = [r for r in [*table, *offload] if r.status == "skipped"]
    if skipped or result["tests"].get("status") == "skipped":
        out += ["", "Skipped:"]
        if result["tests"].get("status") == "skipped":
            out.append(f"- tests/gpu: {result['tests'].get('why')}")
        out += [f"- {LABELS[r.system]} ({r.part}): {r.why}" for r in skipped]
    return "\n".join(out)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "gpu"


def write_result(result: dict[str, Any], out_dir: Path) -> Path:
    """``<out_dir>/gpu-<card>-<date>.json`` (a ``-2``... suffix rather than overwrite an earlier run's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"gpu-{slug(result['machine']['card'])}-{result['machine']['date'][:10]}"
    path, n = out_dir / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = out_dir / f"{stem}-{n}.json"
    path.write_text(json.dumps(result, indent=1))
    return path


# ------------------------------------------------------------------------------------------------ exit status
def failed_checks(result: dict[str, Any]) -> list[str]:
    """What makes the command fail (exit status 1): failed tests, and zgraph rows that failed (a peer's failure, an
    uninstallable DeepSpeed say, is only reported)."""
    tests = result["tests"]
    failed = [f"tests/gpu: {tests.get('why')}"] if tests.get("status") == "failed" else []
    failed += tests.get("failed", [])
    rows = [*result["table"]["rows"], *result["offload"]["rows"]]
    return failed + [
        f"{r['part']}: {r['system']}" for r in rows if r["system"].startswith("zgraph") and r["status"] == "failed"
    ]
