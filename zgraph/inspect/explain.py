"""Inspection: what each pass did, as a table, and every graph as readable Python."""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Mapping

import torch.fx as fx

from zgraph.compile.variant import CompiledStep
from zgraph.config import Config
from zgraph.graph import (
    COLLECTIVE,
    COLLECTIVE_KINDS,
    MADE_BY,
    PHASE,
    VAL,
    ParamInfo,
    collective_bytes,
    collective_kind,
    tensor_bytes,
)
from zgraph.inspect.pipeline_view import pipeline_lines
from zgraph.ops import STASH, UNSHARD
from zgraph.runtime.cost_model import LINK_CLASSES, analytical_cost_model
from zgraph.runtime.host_update import describe as describe_host
from zgraph.runtime.offload import describe as describe_offload
from zgraph.runtime.timeline import collective_totals, estimate

_SHORT = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce"}


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


def explain_table(compiled: CompiledStep, config: Config) -> str:
    """The pass list as a table: one row per graph (captured, each pass, final)."""
    rows = [("captured", compiled.captured.gm, compiled.capture_seconds, "trace + functionalize")]
    rows += [(r.name, r.gm, r.seconds, r.doc if r.applied else f"(nothing to do) {r.doc}") for r in compiled.records]
    if compiled.split is not None:  # a split step runs two graphs cut from the joint one (zgraph.capture.joint)
        for part, exe, records in (
            ("forward", compiled.split.forward, compiled.split.forward_records),
            ("backward", compiled.split.backward, compiled.split.backward_records),
        ):
            rows.append((f"{part} ({exe.backend})", records[-1].gm, exe.compile_seconds, f"split step: the {part}"))
    elif compiled.pipeline is not None:  # this rank's stage graphs
        rows += [(name, gm, 0.0, "pipeline stage graph") for name, gm in compiled.pipeline.graphs.items()]
    else:
        rows += [
            (f"{r.name} ({compiled.executable.backend})", r.gm, r.seconds, r.doc) for r in compiled.backend_records
        ]
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
    if compiled.pipeline is None:
        lines += _bucket_lines(compiled.final)
    else:  # this rank's stages' update graphs (ZeRO >= 1 within stages)
        graphs = compiled.pipeline.graphs
        lines += [line for name, gm in graphs.items() if name.endswith(".update") for line in _bucket_lines(gm, name)]
    lines += _sharding_lines(compiled.params, config)
    lines += _reuse_lines(compiled, config)
    lines += _activation_lines(compiled, config)
    lines += _link_lines(compiled)
    lines += _timeline_lines(compiled)
    lines += pipeline_lines(compiled)
    hosted = compiled.host is not None
    lines += describe_offload(config.offload_optimizer, config.offload_params, compiled.offload, hosted)
    lines += describe_host(compiled.host, compiled.host_fallback, compiled.final, compiled.params)
    return "\n".join(lines)


def _sharding_lines(params: tuple[ParamInfo, ...], config: Config) -> list[str]:
    """Stage 3: how many parameters (and bytes) are sharded, and how many stay whole under the threshold."""
    if config.stage < 3 or not params:
        return []
    sharded = [p for p in params if p.shard is not None and not p.persistent]
    whole = [p for p in params if p.shard is None or p.persistent]
    size = lambda group: human_bytes(sum(math.prod(p.shape) * p.dtype.itemsize for p in group))
    return [
        f"parameters: {len(sharded)} sharded ({size(sharded)}), {len(whole)} whole on every rank ({size(whole)}; "
        f"param_persistence_threshold={config.param_persistence_threshold} elements)"
    ]


def _reuse_lines(compiled: CompiledStep, config: Config) -> list[str]:
    """Stage 3 with ``max_reuse_distance``: how many parameters ``shard_params`` kept gathered from one use
    region into the next."""
    record = next((r for r in compiled.records if r.name == "shard_params"), None)
    if config.stage < 3 or not config.max_reuse_distance or record is None:
        return []
    gathers = [n for n in record.gm.graph.nodes if n.target is UNSHARD and n.args[0].op == "placeholder"]
    kept = {g.args[0] for g in gathers if len(_reader_phases(g)) > 1}
    return [
        f"max_reuse_distance={config.max_reuse_distance} elements: {len(kept)} of "
        f"{len({g.args[0] for g in gathers})} sharded parameters stay gathered from one phase into the next"
    ]


def _activation_lines(compiled: CompiledStep, config: Config) -> list[str]:
    """What ``remat`` recomputed and ``offload_activations`` stashed: how many forward values, how many bytes."""
    graphs = {r.name: r.gm for r in compiled.records}
    lines = []
    if "remat" in graphs and config.remat is not None:
        made = [n for n in graphs["remat"].graph.nodes if n.meta.get(MADE_BY) == "remat"]
        policy = config.remat
        if isinstance(policy, Mapping):
            counts = Counter(policy.values())
            policy = "per block (" + ", ".join(f"{p or 'none'} on {n}" for p, n in counts.items()) + ")"
        size = human_bytes(sum(tensor_bytes(n.meta.get(VAL)) for n in made))
        lines.append(f"remat {policy}: {len(made)} forward values ({size}) recomputed in the backward")
    if "offload_activations" in graphs and config.offload_activations is not None:
        stashed = [n.args[0] for n in graphs["offload_activations"].graph.nodes if n.target is STASH]
        size = human_bytes(sum(tensor_bytes(v.meta.get(VAL)) for v in stashed if isinstance(v, fx.Node)))
        lines.append(
            f"offload_activations={config.offload_activations!r}: {len(stashed)} saved activations ({size}) stashed "
            "after their last forward use, read back ahead of the backward within prefetch_bytes"
        )
    return lines


def _reader_phases(node: fx.Node) -> set[str]:
    """The phases of ``node`` and of what reads it, through the single-input ops (views, casts) that read it."""
    phases, todo = {node.meta.get(PHASE)}, [node]
    while todo:
        for user in todo.pop().users:
            phases.add(user.meta.get(PHASE))
            if len(user.all_input_nodes) == 1:
                todo.append(user)
    return phases - {None}


def _bucket_lines(gm: fx.GraphModule, graph: str = "") -> list[str]:
    """One line per collective kind: how many collectives carry several tensors, and their sizes (``graph``: the
    graph's name, shown)."""
    buckets: dict[str, list[int]] = {}
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        info = node.meta.get(COLLECTIVE)
        if kind is not None and info is not None and isinstance(info[1], (list, tuple)):
            buckets.setdefault(_SHORT[kind], []).append(collective_bytes(node))
    return [
        f"buckets{f' of {graph}' if graph else ''}: {kind} x{len(sizes)} ({', '.join(human_bytes(b) for b in sizes)})"
        for kind, sizes in sorted(buckets.items())
    ]


def _link_lines(compiled: CompiledStep) -> list[str]:
    """Collective bytes per link class, where the step has groups besides its own (hybrid sharding, hpZ)."""
    if len(compiled.crossing) < 2:
        return []
    links = collective_totals(compiled.final, compiled.cost_model or analytical_cost_model(None), compiled.crossing)
    within, across = (human_bytes(links.link_bytes[c]) for c in LINK_CLASSES)
    return [f"collective bytes per link class: within a node {within}, across nodes {across}"]


def _timeline_lines(compiled: CompiledStep) -> list[str]:
    """What the cost model expects the ``schedule`` pass to hide behind compute."""
    cost_model = getattr(compiled, "cost_model", None)
    graphs = {r.name: r.gm for r in compiled.records}
    if cost_model is None or "lower_collectives" not in graphs:
        return []
    lines = [f"cost model ({cost_model.source}): estimated step time, collective time hidden behind compute"]
    for name in ("lower_collectives", "schedule"):
        if name in graphs:
            t = estimate(graphs[name], cost_model)
            share = t.hidden / t.communication if t.communication else 1.0
            lines.append(
                f"  after {name}: {t.total * 1e3:.1f} ms (compute {t.compute * 1e3:.1f} ms, collectives "
                f"{t.communication * 1e3:.1f} ms, {t.hidden * 1e3:.1f} ms hidden = {share:.0%})"
            )
    return lines


def made_by(gm: fx.GraphModule) -> str:
    """Comment lines naming, per pass, the nodes it added to the graph (``meta[MADE_BY]``)."""
    by_pass: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if MADE_BY in node.meta:
            by_pass.setdefault(node.meta[MADE_BY], []).append(node.name)
    lines = [f"#   {name}: {', '.join(nodes)}" for name, nodes in by_pass.items()]
    return "# nodes added by passes:\n" + "\n".join(lines) + "\n" if lines else ""


def dump_graphs(graphs: Mapping[str, fx.GraphModule], directory: str | os.PathLike) -> list[str]:
    """Write each graph as ``NN_<name>.py`` (readable code with shapes) into ``directory``."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for i, (name, gm) in enumerate(graphs.items()):
        safe = re.sub(r"[^\w.-]+", "_", name)
        path = os.path.join(os.fspath(directory), f"{i:02d}_{safe}.py")
        code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
        with open(path, "w") as f:
            f.write(f"# zgraph graph {name!r}\n{code}\n{made_by(gm)}")
        paths.append(path)
    return paths
