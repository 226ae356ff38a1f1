"""Inspection: what each pass did, as a table, and every graph as readable Python."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from zgraph.ops import REDUCE, REDUCE_SHARD, UNSHARD

if TYPE_CHECKING:
    from zgraph.step import CompiledStep

COLLECTIVE_KINDS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
_LAYOUT_KINDS = {UNSHARD: "all_gather_into_tensor", REDUCE_SHARD: "reduce_scatter_tensor", REDUCE: "all_reduce"}
_SHORT = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce"}


def collective_kind(node: fx.Node) -> str | None:
    """``all_gather_into_tensor`` / ``reduce_scatter_tensor`` / ``all_reduce`` (also their coalesced forms) for
    a functional-collective node, or for the zgraph layout operator that becomes one (``unshard``,
    ``reduce_shard``, ``reduce``); else None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if node.target in _LAYOUT_KINDS:
        return _LAYOUT_KINDS[node.target]
    if node.target.namespace != "_c10d_functional":
        return None
    name = node.target._opname
    for kind in COLLECTIVE_KINDS:
        if name.startswith(kind):
            return kind
    return None


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def collective_bytes(node: fx.Node) -> int:
    """Bytes of the full tensor a collective produces or consumes (the larger side)."""
    out = _nbytes(node.meta.get("val"))
    ins = sum(_nbytes(arg.meta.get("val")) for arg in node.all_input_nodes)
    return max(out, ins)


def collective_summary(gm: fx.GraphModule) -> dict[str, tuple[int, int]]:
    """``{kind: (count, bytes)}`` of the functional collectives in a graph."""
    counts: Counter = Counter()
    sizes: Counter = Counter()
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is not None:
            counts[kind] += 1
            sizes[kind] += collective_bytes(node)
    return {k: (counts[k], sizes[k]) for k in counts}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _cell(summary: dict[str, tuple[int, int]], kind: str) -> str:
    if kind not in summary:
        return "-"
    count, size = summary[kind]
    return f"{count} ({human_bytes(size)})"


def explain_table(compiled: CompiledStep, config: Any) -> str:
    """The pipeline as a table: one row per graph (captured, each pass, final)."""
    rows = [("captured", compiled.captured.gm, compiled.capture_seconds, "trace + functionalize")]
    rows += [(r.name, r.gm, r.seconds, r.doc) for r in compiled.records]
    rows.append(
        (f"final ({compiled.executable.backend})", compiled.final, compiled.executable.compile_seconds, "compile")
    )
    header = ("graph", "nodes", *(_SHORT[k] for k in COLLECTIVE_KINDS), "ms", "what it did")
    table = []
    for name, gm, seconds, doc in rows:
        summary = collective_summary(gm)
        nodes = sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output"))
        table.append((name, str(nodes), *(_cell(summary, k) for k in COLLECTIVE_KINDS), f"{seconds * 1e3:.1f}", doc))
    widths = [max(len(str(row[i])) for row in [header, *table]) for i in range(len(header))]
    lines = [f"zgraph step: stage {config.stage}, backend {config.backend}"]
    fmt = lambda row: "  ".join(
        str(c).ljust(w) if i in (0, len(row) - 1) else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))
    )
    lines.append(fmt(header).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    lines += [fmt(row).rstrip() for row in table]
    return "\n".join(lines)


def dump_graphs(graphs: Mapping[str, fx.GraphModule], directory: str | os.PathLike) -> list[str]:
    """Write each graph as ``NN_<name>.py`` (readable code with shapes) into ``directory``."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for i, (name, gm) in enumerate(graphs.items()):
        safe = re.sub(r"[^\w.-]+", "_", name)
        path = os.path.join(os.fspath(directory), f"{i:02d}_{safe}.py")
        code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
        with open(path, "w") as f:
            f.write(f"# zgraph graph {name!r}\n{code}\n")
        paths.append(path)
    return paths
