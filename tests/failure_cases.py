"""Spawned-rank bodies of test_failures.py: one rank fails, catches, or calls once more; every rank must end
with an error that names the cause within ``Config.collective_timeout``, never hang. Each rank saves what it
raised and how long that took."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from parity import train_step
from torch import nn

import zgraph

# Config.collective_timeout of these tests, seconds: short, so that a test ends soon, but longer than the skew of
# two ranks' first capture on a loaded 2-core machine (each case starts the ranks together: ``_start_together``)
TIMEOUT = 8.0


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


_step = train_step


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


def _start_together() -> None:
    """A barrier on the default group (the harness's long timeout) before zgraph's first call: the spawned
    ranks start and import at different speeds under load, and that skew is not what the timeout measures."""
    dist.barrier()


def _attempt(fn, *args) -> dict:
    """What ``fn(*args)`` raised (type and message) and after how many seconds."""
    start = time.monotonic()
    try:
        fn(*args)
        error = None
    except Exception as e:  # noqa: BLE001 - the test inspects whatever was raised
        error = (type(e).__name__, str(e))
    return {"error": error, "seconds": time.monotonic() - start}


def _explode(x: torch.Tensor) -> torch.Tensor:
    if dist.get_rank() == 1 and getattr(_explode, "armed", False):
        raise RuntimeError("boom on rank 1")
    return x


def _fail_mid_graph(gm: fx.GraphModule, ctx: object) -> fx.GraphModule:
    """A user pass: after the first collective's result is used, call ``_explode`` (raises on rank 1 once
    armed), so rank 1 fails between collectives while rank 0 goes on to the next one."""
    waits = [n for n in gm.graph.nodes if n.op == "call_function" and "wait_tensor" in str(n.target)]
    with gm.graph.inserting_after(waits[0]):
        boom = gm.graph.call_function(_explode, (waits[0],))
    waits[0].replace_all_uses_with(boom, delete_user_cb=lambda user: user is not boom)
    gm.recompile()
    return gm


def _save(out: str, rank: int, record: dict) -> None:
    torch.save(record, f"{out}.{rank}")


def mid_graph_failure(rank: int, world: int, out: str) -> None:
    """Rank 1 raises inside the graph, between collectives, catches it and calls the step again."""
    model = _mlp()
    config = zgraph.Config(
        stage=3,
        backend="eager",
        param_persistence_threshold=0,
        collective_timeout=TIMEOUT,
        extra_passes=[_fail_mid_graph],
    )
    step = zgraph.distribute(config)(_step)
    opt = torch.optim.AdamW(model.parameters())
    _start_together()
    step(model, opt, *_batch(rank))
    _explode.armed = True
    record = {"first": _attempt(step, model, opt, *_batch(rank))}
    if rank == 1:
        record["again"] = _attempt(step, model, opt, *_batch(rank))  # caught its error and went on
    _save(out, rank, record)


def pipeline_stage_failure(rank: int, world: int, out: str) -> None:
    """Pipeline parallelism (1F1B, a stage per rank): the last rank raises in its first backward of the second
    call, while rank 0 waits to receive that backward's gradient."""
    from pipeline_cases import Net, step

    from zgraph.runtime import pipeline_run

    def backward(self: pipeline_run.RankRunner, action: object) -> None:
        if rank == world - 1 and getattr(backward, "armed", False):
            raise RuntimeError(f"boom in rank {rank}'s backward")
        original(self, action)

    original = pipeline_run.RankRunner._backward
    pipeline_run.RankRunner._backward = backward
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    config = zgraph.Config(backend="eager", pipeline_parallel=world, microbatches=4, collective_timeout=TIMEOUT)
    compiled = zgraph.distribute(config)(step)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    _start_together()
    compiled(model, opt, x, y)
    backward.armed = True
    _save(out, rank, {"first": _attempt(compiled, model, opt, x, y)})


def capture_failure_caught(rank: int, world: int, out: str) -> None:
    """Rank 1's capture fails (data-dependent Python); it catches the error and calls the step again."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())

    def branchy(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        if rank == 1 and loss.item() > 0:
            loss = loss * 2
        loss.backward()
        opt.step()
        return loss

    step = zgraph.distribute(stage=2, backend="eager", collective_timeout=TIMEOUT)(branchy)
    _start_together()
    record = {"first": _attempt(step, model, opt, *_batch(rank))}
    if rank == 1:
        record["again"] = _attempt(step, model, opt, *_batch(rank))
    _save(out, rank, record)


def extra_call(rank: int, world: int, out: str) -> None:
    """Rank 0 calls the step once more than rank 1."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    step = zgraph.distribute(stage=1, backend="eager", collective_timeout=TIMEOUT)(_step)
    _start_together()
    for _ in range(2):
        step(model, opt, *_batch(rank))
    record = {}
    if rank == 0:
        record["first"] = _attempt(step, model, opt, *_batch(rank))
    _save(out, rank, record)


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
        self.register_buffer("scale", torch.rand(8) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * self.scale)


def different_initial_weights(rank: int, world: int, out: str) -> None:
    """Every rank builds the model from its own seed; after one step at each stage the parameters equal an
    eager step, on the global batch, from rank 0's initial weights (parameters and buffers)."""
    xs, ys = zip(*(_batch(r) for r in range(world)))
    x, y = torch.cat(xs), torch.cat(ys)
    results = {}
    for stage in range(4):
        torch.manual_seed(100)  # rank 0's seed
        reference = _WithBuffer()
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
        _step(reference, ref_opt, x, y)
        torch.manual_seed(100 + rank)
        model = _WithBuffer()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        step = zgraph.distribute(stage=stage, backend="eager", param_persistence_threshold=0)(_step)
        step(model, opt, *_batch(rank))
        whole = zgraph.full_state_dict(model)
        results[stage] = max((whole[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    _save(out, rank, results)
