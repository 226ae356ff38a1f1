"""Split-mode cases (a step's outputs carry a compiled backward): every backward form run by zgraph on each
rank's slice of the global batch, and by eager PyTorch on the whole batch (``reference``).

Semantics at world W (DDP's): each rank backpropagates its own slice; parameter gradients are the average of
the ranks' gradients, so a rank's ``out.backward(gradient=g_r)`` matches eager's backward of the global output
with ``G / W``; gradients of step inputs are the rank's own (eager's with ``G``, the rank's rows).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import zgraph

ROWS = 8  # global batch


def whole(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def make_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3))  # layer norm: a tuple op
    head = nn.Sequential(nn.Linear(3, 7), nn.GELU(), nn.Linear(7, 2))
    return enc, head


def data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {k: torch.randn(ROWS, n, generator=g) for k, n in (("x", 4), ("g", 3), ("g2", 3), ("y", 2))}


def _slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    rows = t.shape[0] // world
    return t[rank * rows : (rank + 1) * rows].clone()


def _state(enc: nn.Module, extra: dict) -> dict:
    out = {f"grad:{n}": whole(p.grad) for n, p in enc.named_parameters()}
    out.update({f"param:{n}": whole(p) for n, p in enc.named_parameters()})
    out.update(extra)
    return out


def run_case(name: str, stage: int, rank: int, world: int) -> dict:
    """Run case ``name`` with zgraph at ``stage`` on this rank's rows (``world`` 0: eager on the whole batch)."""
    enc, head = make_models()
    d = data()
    eager = world == 0
    scale = 1.0
    if not eager:
        d = {k: _slice(v, rank, world) for k, v in d.items()}
    else:
        world, scale = 1, None  # eager: gradients of the global batch, scaled per case below
    config = zgraph.Config(stage=stage, param_persistence_threshold=0, **FIELDS)  # stage 3 shards every parameter
    opt = torch.optim.SGD(enc.parameters(), lr=0.1)
    head_opt = torch.optim.SGD(head.parameters(), lr=0.1)

    def encode(model, x):
        return model(x)

    def encode_two(model, x):
        h = model[2](model[1](model[0](x)))
        return h, model[3](h)

    def llm(model, o, emb, y):
        loss = ((model(emb) - y) ** 2).mean()
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.detach()

    def update(o):
        o.step()
        o.zero_grad()

    if not eager:
        encode, encode_two = zgraph.distribute(config)(encode), zgraph.distribute(config)(encode_two)
        llm, update = zgraph.distribute(config)(llm), zgraph.distribute(config)(update)
    return CASES[name](enc, head, opt, head_opt, d, scale, (encode, encode_two, llm, update))


def _gradient(enc, head, opt, head_opt, d, scale, steps):
    encode = steps[0]
    out = encode(enc, d["x"])
    assert out.grad_fn is not None
    out.backward(gradient=d["g"] if scale is not None else d["g"] / _world())
    if scale is not None:  # what the backward graph keeps from the forward (shapes), for the stage-3 check
        nodes = encode.graphs["backward"].graph.nodes
        SAVED[:] = [tuple(n.meta["val"].shape) for n in nodes if n.op == "placeholder" and n.name.startswith("saved")]
    return _state(enc, {"out": out.detach()})


def _multi(enc, head, opt, head_opt, d, scale, steps):
    h, out = steps[1](enc, d["x"])
    w = 1 if scale is not None else _world()
    torch.autograd.backward([h, out], [d["g"][:, :1].expand(-1, 5).contiguous() / w, d["g2"] / w])
    return _state(enc, {"out": out.detach(), "h": h.detach()})


def _scalar(enc, head, opt, head_opt, d, scale, steps):
    h, out = steps[1](enc, d["x"])
    loss = (out**2).mean() + h.sum() * 0.1
    if scale is None:  # eager on the global batch: the mean of the ranks' losses
        loss = sum(((o**2).mean() + hh.sum() * 0.1) for o, hh in zip(out.chunk(_world()), h.chunk(_world()))) / _world()
    loss.backward()
    return _state(enc, {"out": out.detach()})


def _accumulate(enc, head, opt, head_opt, d, scale, steps):
    encode, update = steps[0], steps[3]
    w = 1 if scale is not None else _world()
    o1 = encode(enc, d["x"])
    o2 = encode(enc, d["x"] * 0.5)
    o2.backward(gradient=d["g2"] / w)
    o1.backward(gradient=d["g"] / w)
    grads = _state(enc, {})
    update(opt)
    o3 = encode(enc, d["x"])
    o3.backward(gradient=d["g"] / w, retain_graph=True)
    o3.backward(gradient=d["g2"] / w)
    update(opt)
    return _state(enc, {f"first:{k}": v for k, v in grads.items()})


def _autograd_grad(enc, head, opt, head_opt, d, scale, steps):
    x = d["x"].clone().requires_grad_()
    out = steps[0](enc, x)
    (dx,) = torch.autograd.grad(out, [x], d["g"])
    return _state(enc, {"dx": dx, "x.grad": x.grad})


def _seeds(enc, head, opt, head_opt, d, scale, steps):
    encode, llm, update = steps[0], steps[2], steps[3]
    out = encode(enc, d["x"])
    emb = out.detach().requires_grad_()
    if scale is None:  # eager, global batch: the mean of the ranks' losses
        w = _world()
        loss = sum(((head(e) - y) ** 2).mean() for e, y in zip(emb.chunk(w), d["y"].chunk(w))) / w
        loss.backward()
        head_opt.step()
        head_opt.zero_grad()
        emb_grad = emb.grad * w  # each rank's own gradient (its loss), as the rank sees it
        out.backward(gradient=emb.grad)
    else:
        llm(head, head_opt, emb, d["y"])
        emb_grad = emb.grad.clone()
        out.backward(gradient=emb.grad)
    grads = _state(enc, {})
    update(opt)
    heads = {f"head:{n}": whole(p) for n, p in head.named_parameters()}
    return _state(enc, {"emb.grad": emb_grad, **heads, **{f"before:{k}": v for k, v in grads.items()}})


_WORLD = [1]
FIELDS: dict = {}  # more Config fields for every zgraph step (hybrid sharding's, say)
SAVED: list[tuple[int, ...]] = []


def _world() -> int:
    return _WORLD[0]


CASES = {
    "gradient": _gradient,
    "multi": _multi,
    "scalar": _scalar,
    "accumulate": _accumulate,
    "autograd_grad": _autograd_grad,
    "seeds": _seeds,
}

ROW_KEYS = ("out", "h", "dx", "emb.grad")  # per-row results: each rank holds its rows


def reference(name: str, world: int) -> dict:
    """Eager PyTorch on the whole batch, as ``world`` ranks' zgraph run should match it."""
    _WORLD[0] = world
    return run_case(name, 0, 0, 0)


def run_split_cases(
    rank: int, world: int, out_path: str, stages: list[int], names: list[str], fields: dict | None = None
) -> None:
    """Every case at every stage on this rank, ``fields`` the ``FIELDS`` of this run; rank 0 saves
    ``{(stage, name): result}`` (row results gathered)."""
    FIELDS.clear()
    FIELDS.update(fields or {})
    results = {}
    for stage in stages:
        for name in names:
            result = run_case(name, stage, rank, world)
            for key in ROW_KEYS:
                if result.get(key) is not None:
                    parts = [torch.empty_like(result[key]) for _ in range(world)]
                    dist.all_gather(parts, result[key].contiguous())
                    result[key] = torch.cat(parts)
            results[(stage, name)] = result
            if name == "gradient":
                results[(stage, "saved shapes")] = list(SAVED)
            dist.barrier()
    if rank == 0:
        torch.save(copy.deepcopy(results), out_path)
