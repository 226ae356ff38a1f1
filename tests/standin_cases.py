"""Rank bodies of the device-path tests: real zgraph steps on the stand-in accelerator (``tests/standin.py``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from standin import DEVICE, DeviceAudit
from torch import nn

import zgraph
from zgraph.ops import FLAG_TO_HOST
from zgraph.runtime import host_state

aten = torch.ops.aten


def model_on(device: torch.device | str = DEVICE) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 8)).to(device)


def config_of(options: dict[str, Any]) -> zgraph.Config:
    """A Config from JSON-able ``options`` (dtypes written as ``"torch.bfloat16"``)."""
    options = {k: getattr(torch, v[6:]) if str(v).startswith("torch.") else v for k, v in options.items()}
    fixed = {"backend": "eager", "measure_collectives": False, "param_persistence_threshold": 0}
    return zgraph.Config(**{**fixed, **options})


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def encode(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)  # returned with a grad_fn: split mode, the backward runs when the caller's does


def update(opt: torch.optim.Optimizer) -> None:
    opt.step()
    opt.zero_grad()


def host_reads_in_graphs(graphs: dict) -> list[str]:
    """The nodes of the final graphs that read a device value on the host (``_local_scalar_dense`` of a non-CPU
    value, or a copy of one to the host), but the documented ``zgraph::flag_to_host``."""
    found = []
    for name in ("final", "forward", "backward"):
        gm = graphs.get(name)
        for node in gm.graph.nodes if gm is not None else ():
            source = node.args[0].meta.get("val") if node.args and hasattr(node.args[0], "meta") else None
            on_device = isinstance(source, torch.Tensor) and source.device.type != "cpu"
            to_host = node.target is aten._to_copy.default and str(node.kwargs.get("device")) == "cpu"
            if on_device and (node.target is aten._local_scalar_dense.default or to_host):
                found.append(f"{name}: {node.format_node()}")
    return found


def _devices(tensors: list[torch.Tensor]) -> list[str]:
    return sorted({str(getattr(t, "_local_tensor", t).device) for t in tensors})


def _observe(model: nn.Module, opt: torch.optim.Optimizer, step: Any, audit: DeviceAudit) -> dict[str, Any]:
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    graphs = step.graphs
    return {
        "moved": dict(audit.moved),
        "param_devices": _devices(list(model.parameters())),
        "state_devices": _devices([v for v in states if v.dim() > 0]),
        "step_devices": _devices([v for v in states if v.dim() == 0]),
        "loss_scale_devices": _devices(list(getattr(opt, "_zgraph_loss_scale", {}).values())),
        "reads": sorted(set(audit.reads)),
        "variants": len(step._dispatch.cache),
        "graph_host_reads": host_reads_in_graphs(graphs),
        "flag_to_host": sum(1 for gm in graphs.values() for n in gm.graph.nodes if n.target is FLAG_TO_HOST),
        "explain": step.explain(),
    }


def train(
    rank: int, world: int, options: dict[str, Any], split: bool = False, checkpoint: str | None = None
) -> dict[str, Any]:
    """Three calls of a step with ``options`` under the audit (split: forward step, backward outside it, update
    step); what it saw (``moved``: what the third call copied each way). ``checkpoint``: a directory to save to
    and load from after, under an audit of its own."""
    config = config_of(options)
    model = model_on()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16, device=DEVICE)
    y = torch.zeros(4, dtype=torch.long, device=DEVICE)
    with DeviceAudit() as audit:
        if split:
            forward, step = zgraph.distribute(config)(encode), zgraph.distribute(config)(update)
            for _ in range(3):
                forward(model, x).sum().backward()
                step(opt)
            step = forward
        else:
            step = zgraph.distribute(config)(plain_step)
            for i in range(3):
                if i == 2:  # what the third step (every state made, nothing left to set up) copies each way
                    audit.moved.update(to_host=0, to_device=0)
                step(model, opt, x, y)
    seen = _observe(model, opt, step, audit)
    if checkpoint is not None:
        with DeviceAudit() as audit:
            seen["state_reads"] = read_state(model, opt, checkpoint, audit)
    return seen


def read_state(model: nn.Module, opt: torch.optim.Optimizer, path: str, audit: DeviceAudit) -> dict[str, Any]:
    """``optimizer.state_dict()``, ``zgraph.save``, ``zgraph.load`` and ``zgraph.full_state_dict`` under ``audit``:
    the devices of what the first and the last returned, and what the first three and the last copied each way."""
    states = opt.state_dict()["state"]
    tensors = [v for s in states.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    zgraph.save(path, model, opt)
    zgraph.load(path, model, opt)
    moved = dict(audit.moved)
    whole, whole_optim = zgraph.full_state_dict(model, opt)
    gathered = [*whole.values(), *(v for s in whole_optim["state"].values() for v in s.values())]
    return {
        "state_dict_devices": _devices(tensors),
        "full_state_dict_devices": _devices(gathered),
        "moved_by_state_dict_save_load": moved,
        "moved_by_full_state_dict": {k: v - moved[k] for k, v in audit.moved.items()},
    }


def cases(rank: int, world: int, out: str, runs: list[dict[str, Any]]) -> None:
    """Run each of ``runs`` (``{"options": ..., "split": ...}``); rank 0 writes their observations (or the error)
    to ``out`` as JSON."""
    results = []
    for run in runs:
        try:
            path = f"{out}.{len(results)}.ckpt" if run.get("checkpoint") else None
            results.append(train(rank, world, run["options"], run.get("split", False), path))
        except Exception as error:  # the test names the failing case
            results.append({"error": f"{type(error).__name__}: {error}"})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


@contextlib.contextmanager
def _host_memory(available: int | None) -> Iterator[None]:
    """The host memory zgraph sees as available (unchanged for None)."""
    real = host_state.available_host_bytes
    if available is not None:
        host_state.available_host_bytes = lambda: available
    try:
        yield
    finally:
        host_state.available_host_bytes = real


def refusals(rank: int, world: int, out: str) -> None:
    """Bad input on the stand-in group: each a clear error before the model changes; then a good call."""
    seen = {}
    host = {"offload_optimizer": "cpu", "offload_update": "host"}
    checks = {
        "host model on a device-only group": (model_on("cpu"), {}),
        "nvme offload of device state": (model_on(), {"stage": 1, "offload_optimizer": "nvme", "offload_dir": out}),
        "too little host memory for the update on the host": (model_on(), host),
        "an optimizer the host cannot run": (model_on(), host),
    }
    for name, (model, options) in checks.items():
        opt = (torch.optim.RMSprop if "optimizer" in name else torch.optim.AdamW)(model.parameters(), lr=1e-3)
        device = next(model.parameters()).device
        x, y = torch.randn(4, 16, device=device), torch.zeros(4, dtype=torch.long, device=device)
        before = [(type(p).__name__, str(p.device)) for p in model.parameters()]
        try:
            with DeviceAudit(), _host_memory(1024 if "too little" in name else None):
                zgraph.distribute(config_of({"stage": 3, **options}))(plain_step)(model, opt, x, y)
            seen[name] = {"error": None}
        except Exception as error:
            after = [(type(p).__name__, str(p.device)) for p in model.parameters()]
            seen[name] = {"error": f"{type(error).__name__}: {error}", "unchanged": before == after and not opt.state}
    if rank == 0:
        with open(out + "/refusals.json", "w") as f:
            json.dump(seen, f)
