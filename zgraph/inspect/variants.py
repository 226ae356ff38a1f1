"""Estimates of several configs of one prepared step (``zgraph.inspect.estimate.Prepared``), as the memory planner
makes them: the leading passes the configs share — the same pass with the same options, in the same place — run
once. The pass lists form a tree; each run of passes edits a copy of the graph it starts from, a branch's graph is
kept for the runs after it, and each config's own graph is estimated as ``estimate_variant`` would estimate it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from zgraph.compile.build import pass_context
from zgraph.config import Config
from zgraph.graph_copy import copy_graph_module
from zgraph.inspect.estimate import Estimate, Prepared, estimate_variant
from zgraph.passes import Pass, PassContext, run_passes

_PLAIN = (type(None), bool, int, float, str, torch.dtype)


def estimate_variants(prepared: Prepared, configs: Sequence[Config]) -> list[Estimate]:
    """``estimate_variant(prepared, config)`` of each of ``configs``, the passes they share run once."""
    lists = [config.passes()[prepared.ran :] for config in configs]
    keys = [[_key(p) for p in passes] for passes in lists]
    ctx = pass_context(prepared.binding, split=prepared.captured.split is not None)
    finals: dict[int, fx.GraphModule] = {}
    tree = _Tree(lists, keys, ctx, finals)
    tree.run(prepared.captured.gm, 0, list(range(len(configs))), check=not prepared.ran)
    out = []
    for i, config in enumerate(configs):  # each config's transformed graph, its passes all run
        captured = dataclasses.replace(prepared.captured, gm=finals[i])
        done = dataclasses.replace(prepared, captured=captured, ran=prepared.ran + len(lists[i]))
        out.append(estimate_variant(done, config, copy=False))
    return out


@dataclasses.dataclass
class _Tree:
    lists: list[list[Pass]]
    keys: list[list[Any]]
    ctx: PassContext
    finals: dict[int, fx.GraphModule]

    def run(self, source: fx.GraphModule, done: int, members: list[int], check: bool) -> None:
        """Every config of ``members`` has its first ``done`` passes run on ``source`` (which is not edited)."""
        if len(members) == 1:
            (i,) = members
            self.finals[i] = self._passes(source, self.lists[i][done:], check)
            return
        common = done
        while all(len(self.keys[i]) > common for i in members) and len({self.keys[i][common] for i in members}) == 1:
            common += 1
        if common > done:
            source, check = self._passes(source, self.lists[members[0]][done:common], check), False
        groups: dict[Any, list[int]] = {}  # by the next pass
        for i in members:
            if len(self.keys[i]) == common:  # its passes end here
                self.finals[i] = copy_graph_module(source)
            else:
                groups.setdefault(self.keys[i][common], []).append(i)
        for group in groups.values():
            self.run(source, common, group, check)

    def _passes(self, source: fx.GraphModule, passes: list[Pass], check: bool) -> fx.GraphModule:
        gm = copy_graph_module(source)
        records = run_passes(gm, self.ctx, passes, check_input=check, keep=False)
        return records[-1].gm if records else gm


def _key(p: Pass) -> Any:
    """What makes two passes the same: name, function, ``applies`` and options (compared by value where they are
    plain values, else by identity)."""
    fn = p.fn
    if isinstance(fn, functools.partial):
        options = (fn.args, tuple(sorted(fn.keywords.items())))
        return (p.name, p.applies, fn.func, repr(options) if _plain(options) else id(fn))
    return (p.name, p.applies, fn)


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return isinstance(value, _PLAIN)
