"""Measured side of the estimate accuracy tests: a real step's model state, peak and collectives.

``compare`` runs a step on the bench GPT (or the ~100M GPT) for real twice (so optimizer state and ``.grad`` exist
and caches are warm), estimates the next call with ``step.estimate`` on that state, then makes the call with every
tensor the rank holds counted by ``LiveTensorBytes`` (state and batch tracked before the call, everything the call
allocates seen by the mode) and every functional collective counted by a dispatch mode while the graph runs (not
the graph fingerprint every call exchanges before it). The garbage the earlier calls and the estimate left is not
collected first: the tracker counts only the storages it tracks, so none of it can enter the measurement (the
same numbers with or without a ``gc.collect()``, which took ~0.5 s a case). Run on 1 process or on ranks spawned
by ``tests/dist_harness.py`` (``ranks``).
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import zgraph
from zgraph.demos.models import BENCH_GPT, GPT, GPT_100M, lm_loss
from zgraph.graph import collective_kind, tensor_bytes
from zgraph.runtime.memory import LiveTensorBytes, state_bytes

LOW_PRECISION = {
    "param_dtype": torch.bfloat16,
    "master_dtype": torch.bfloat16,
    "optimizer_state_dtype": torch.bfloat16,
    "autocast_dtype": torch.bfloat16,
}
# "nvme": parameter shards and optimizer states in the offload tier's files between steps (stage 3)
OFFLOAD = {"offload_optimizer": "nvme", "offload_params": "nvme", "offload_dir": tempfile.gettempdir()}
RECIPES = {"fp32": {}, "bf16": LOW_PRECISION, "nvme": OFFLOAD}
MODELS = {"gpt-bench": BENCH_GPT, "gpt-100m": GPT_100M}


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, idx: Tensor, targets: Tensor) -> Tensor:
    """A step that leaves ``.grad`` populated (gradients kept between steps)."""
    loss = lm_loss(model(idx), targets)
    loss.backward()
    opt.step()
    return loss.detach()


class CountCollectives(TorchDispatchMode):
    """Functional collectives run under the mode: count and bytes (the larger side) per kind."""

    def __init__(self) -> None:
        super().__init__()
        self.count: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional" and not func._opname.startswith("wait"):
            kind = collective_kind(torch.fx.Graph().call_function(func, ()))
            if kind is not None:
                ins = sum(tensor_bytes(a) for a in torch.utils._pytree.tree_leaves((args, kwargs)))
                self.count[kind] = self.count.get(kind, 0) + 1
                self.bytes[kind] = self.bytes.get(kind, 0) + max(ins, tensor_bytes(out))
        return out


def _setup(stage: int, recipe: str, rank: int, batch: int, name: str = "gpt-bench") -> tuple:
    torch.manual_seed(0)
    shape = MODELS[name]
    model = GPT(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0, **RECIPES[recipe])
    step = zgraph.distribute(config)(train_step)
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, shape.vocab, (batch, shape.seq), generator=g)
    return model, opt, step, idx, idx.roll(-1, dims=1)


def _counted(run: Any, inputs: Any, counter: CountCollectives) -> Any:
    with counter:
        return run(inputs)


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def holding(model: torch.nn.Module, opt: torch.optim.Optimizer, *batch: Tensor) -> LiveTensorBytes:
    """A ``LiveTensorBytes`` already counting what the rank holds before a call: the model's parameters, buffers
    and ``.grad``, the optimizer's state and the batch (each DTensor's local shard)."""
    tracker = LiveTensorBytes()
    state = [*model.parameters(), *model.buffers(), *batch]
    state += [p.grad for p in model.parameters() if p.grad is not None]
    state += [v for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
    for t in state:
        tracker.track(_local(t))
    return tracker


def compare(
    stage: int, recipe: str, rank: int = 0, batch: int = 2, estimate: bool = True, model_name: str = "gpt-bench"
) -> dict:
    """The real step's numbers on this rank, and (``estimate``) its ``step.estimate`` made just before the measured
    call, on the same state (see the module docstring); ``model_name``: a key of ``MODELS``."""
    model, opt, step, idx, targets = _setup(stage, recipe, rank, batch, model_name)
    for _ in range(2):
        step(model, opt, idx, targets)
    estimated = step.estimate(model, opt, idx, targets).to_json() if estimate else None
    held = state_bytes(model, opt)
    tracker = holding(model, opt, idx, targets)
    counter = CountCollectives()
    executable = step._dispatch.last.executable
    graph_run = executable.run
    executable.run = lambda inputs: _counted(graph_run, inputs, counter)  # the step graph's collectives only
    with tracker:
        step(model, opt, idx, targets)
    executable.run = graph_run
    measured = {"state": held, "peak": tracker.peak, "comm_bytes": counter.bytes, "comm_count": counter.count}
    return {"model": model_name, "stage": stage, "recipe": recipe, "measured": measured, "estimated": estimated}


def ranks(rank: int, world: int, cases: list, out: str) -> None:
    """On each spawned rank: run every ``(stage, recipe)`` or ``(stage, recipe, model)`` of ``cases``; rank 0 also
    estimates and writes the results as JSON to ``out``."""
    results = []
    for stage, recipe, *model_name in cases:
        results.append(compare(stage, recipe, rank, estimate=rank == 0, model_name=(*model_name, "gpt-bench")[0]))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
