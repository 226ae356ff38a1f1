"""Rank bodies and references of ``tests/test_host_update.py``: the optimizer update on the host
(``Config.offload_update="host"``) against the update in the graph, and the one-step-late update
(``Config.offload_overlap="one_step"``) against eager PyTorch applying each step's gradients one step late."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from dist_harness import run_named
from torch import nn

import zgraph

STEPS = 3
ROWS = 4  # per rank


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 8))


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def batches(rank: int = 0, overflow_at: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of each step's batch; with ``overflow_at``, that step's first input is inf (its gradients
    overflow: fp16 loss scaling skips the step)."""
    torch.manual_seed(1)
    out = []
    for t in range(STEPS):
        x, y = torch.randn(2 * ROWS, 16), torch.randint(0, 8, (2 * ROWS,))
        x = x[rank * ROWS : (rank + 1) * ROWS].clone()
        if t == overflow_at:
            x[0, 0] = float("inf")
        out.append((x, y[rank * ROWS : (rank + 1) * ROWS]))
    return out


def train(
    options: dict[str, Any], rank: int = 0, overflow_at: int | None = None, fused: bool | None = False
) -> dict[str, Any]:
    """``STEPS`` calls of ``plain_step`` with AdamW (``fused``: its flag) under ``options``; the losses, and the
    whole state after."""
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    config = zgraph.Config(backend="eager", measure_collectives=False, param_persistence_threshold=0, **options)
    step = zgraph.distribute(config)(plain_step)
    losses = [step(net, opt, x, y).detach().clone() for x, y in batches(rank, overflow_at)]
    params, optim = zgraph.full_state_dict(net, opt)
    return {"losses": losses, "params": params, "optim": optim["state"], "explain": step.explain()}


PARITY = {
    "stage 1, clipping": {"stage": 1, "max_grad_norm": 0.5},
    "stage 2, bf16 parameters, fp32 master": {"stage": 2, "param_dtype": torch.bfloat16},
    "stage 3, fp16 loss scaling (a step overflows), parameters offloaded too": {
        "stage": 3,
        "param_dtype": torch.float16,
        "loss_scale": "dynamic",
        "offload_params": "cpu",
    },
}


# stages 1 and 2 with the update on the host on several ranks run stage 3's layout (``zgraph.binding.host_layout``)
STAGE_3_LAYOUT = {"stage": 3, "max_reuse_distance": 10**9}


def both_places(cases: dict[str, dict], rank: int, fused: bool | None, layout: bool = False) -> dict[str, Any]:
    """Each case trained with the update in the graph and on the host (``fused``: AdamW's flag); with ``layout``,
    at stages 1 and 2 also in the graph with the layout the host's runs (``"layout"``)."""
    out = {}
    for name, options in cases.items():
        overflow = 1 if "overflow" in name else None
        places = {"device": options, "host": options}
        if layout and options["stage"] < 3:
            places["layout"] = {**options, **STAGE_3_LAYOUT}
        out[name] = {
            label: train(
                {**opts, "offload_optimizer": "cpu", "offload_update": "host" if label == "host" else "device"},
                rank,
                overflow,
                fused,
            )
            for label, opts in places.items()
        }
    return out


def parity(rank: int, world: int) -> dict[str, Any]:
    """Each case of ``PARITY`` trained with the update in the graph and on the host (rank 0's results)."""
    return both_places(PARITY, rank, False, layout=True)


FUSED = {  # the update on the host by torch's fused kernel (an AdamW without fused=False)
    "stage 2, bf16 parameters, fp32 master, clipping": {
        "stage": 2,
        "param_dtype": torch.bfloat16,
        "max_grad_norm": 0.5,
    },
    "stage 3, fp16 loss scaling (a step overflows), parameters offloaded too": {
        "stage": 3,
        "param_dtype": torch.float16,
        "loss_scale": "dynamic",
        "offload_params": "cpu",
    },
}


def fused(rank: int, world: int) -> dict[str, Any]:
    """Each case of ``FUSED`` with the update in the graph (op by op) and on the host (torch's fused kernel)."""
    return both_places(FUSED, rank, None)


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named checks; rank 0 saves ``{name: result}``."""
    run_named(rank, world, out_path, names, globals())


def late(rank: int, world: int) -> dict[str, Any]:
    """``offload_overlap="one_step"`` at stage 2 on several ranks (stage 3's layout: ``zgraph.binding.host_layout``)."""
    options = {"stage": 2, "offload_optimizer": "cpu", "offload_update": "host", "offload_overlap": "one_step"}
    return train(options, rank)


def global_batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's whole batch: the rows of ``world`` ranks."""
    per_rank = [batches(r) for r in range(world)]
    return [tuple(torch.cat(parts) for parts in zip(*step)) for step in zip(*per_rank)]


def delayed_eager(steps: int = STEPS, world: int = 1) -> dict[str, Any]:
    """Eager PyTorch on the CPU applying each step's gradients one step late: step ``t`` computes its gradients
    with the parameters its forward reads, then AdamW applies step ``t - 1``'s; the last step's is applied at the
    end (what a read of the state after the steps sees). ``world``: on the rows of that many ranks."""
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    pending, losses = None, []
    for x, y in global_batches(world)[:steps]:
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        losses.append(loss.detach())
        grads = [p.grad.clone() for p in net.parameters()]
        opt.zero_grad()
        if pending is not None:
            for p, g in zip(net.parameters(), pending):
                p.grad = g
            opt.step()
            opt.zero_grad()
        pending = grads
    for p, g in zip(net.parameters(), pending):
        p.grad = g
    opt.step()
    return {"losses": losses, "params": dict(net.state_dict()), "optim": opt.state_dict()["state"]}


def eager(fused: bool) -> dict[str, Any]:
    """Eager PyTorch on the CPU: ``STEPS`` steps of ``plain_step`` with AdamW (``fused``: torch's fused CPU kernel,
    else its for-loop step)."""
    net = model()
    opt = torch.optim.AdamW(
        net.parameters(), lr=1e-2, weight_decay=0.1, fused=fused, foreach=False if not fused else None
    )
    losses = [plain_step(net, opt, x, y).detach() for x, y in batches()]
    return {"losses": losses, "params": dict(net.state_dict()), "optim": opt.state_dict()["state"]}


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested results (tensors compared bit for bit, NaN equal to NaN)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        bits = lambda t: t.detach().contiguous().view(-1).view(torch.uint8)  # noqa: E731
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
    return a == b
