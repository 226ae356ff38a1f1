"""Models, batches and rank workers for tests/test_checkpoint.py.

Importing this module does not import zgraph (the consolidation test loads ``Net`` in a process without zgraph);
the workers import it when they run.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

GLOBAL_BATCH = 8  # divisible by every world size tested (1, 2, 4)
BEFORE = 3  # steps before the checkpoint
AFTER = 3  # steps after it
VOCAB = 9  # rows of the embedding: 5 + 4 on 2 ranks, 3 + 3 + 3 + 0 on 4 (padding, and an empty shard)
EXTRA = {"epoch": 7, "name": "run-a", "tokens": torch.arange(3)}


class Net(nn.Module):
    """An embedding of 9 rows, two linear layers of 11 and 5 rows, and a buffer counting forward calls."""

    def __init__(self, hidden: int = 11, head: str = "l2"):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 6)
        self.l1 = nn.Linear(6, hidden)
        self.add_module(head, nn.Linear(hidden, 5))
        self.head = head
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, ids):
        self.calls += 1
        return getattr(self, self.head)(torch.tanh(self.l1(self.emb(ids).mean(1))))


def make_state(model: nn.Module | None = None) -> tuple:
    """``(model, AdamW with a decay and a no-decay group, StepLR)``."""
    model = model if model is not None else Net()
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=2e-2
    )
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def batches() -> list[tuple]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, VOCAB, (GLOBAL_BATCH, 4), generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g))
        for _ in range(BEFORE + AFTER)
    ]


def classify_step(model, opt, ids, y):
    loss = F.cross_entropy(model(ids), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def zgraph_step(stage: int):
    import zgraph

    config = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0, measure_collectives=False)
    return zgraph.distribute(config)(classify_step)


def train(state: tuple, step, steps: list[tuple], rank: int = 0, world: int = 1) -> list[float]:
    """Run ``step`` on this rank's share of each global batch, stepping the scheduler after each; returns the
    losses averaged over ranks."""
    import torch.distributed as dist

    model, opt, scheduler = state
    losses = []
    for ids, y in steps:
        n = ids.shape[0] // world
        loss = step(model, opt, ids[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]).detach().clone()
        if world > 1:
            dist.all_reduce(loss)
        losses.append(float(loss) / world)
        scheduler.step()
    return losses


def eager_run(steps: int | None = None) -> dict:
    """The reference: eager PyTorch on one process, global batches."""
    state = make_state()
    losses = train(state, classify_step, batches()[:steps])
    return {"losses": losses, "state": state}


def whole(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Whole, plain copies of the model's and optimizer's state (``zgraph.full_state_dict``)."""
    import zgraph

    model_state, optim_state = zgraph.full_state_dict(model, opt)
    # like state_dict(), full_state_dict shares memory with live (whole) state, which later steps update in place
    optim_state["state"] = {
        i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in optim_state["state"].items()
    }
    return {"model": {k: v.clone() for k, v in model_state.items()}, "optimizer": optim_state}


# ------------------------------------------------------------------------------------------- rank workers
def world2_worker(rank: int, world: int, out_dir: str) -> None:
    """On 2 ranks: save at stage 3 and at stage 0, resume at stages 3 and 1; rank 0 saves the results."""
    import zgraph

    all_batches = batches()
    head, tail = all_batches[:BEFORE], all_batches[BEFORE:]
    results: dict = {}

    # the uninterrupted run, stage 3
    uninterrupted = make_state()
    step0 = zgraph_step(3)
    results["uninterrupted"] = train(uninterrupted, step0, all_batches, rank, world)

    # train, save at stage 3; the RNG draws right after the save are what a load must reproduce
    saved = make_state()
    results["before"] = train(saved, zgraph_step(3), head, rank, world)
    torch.manual_seed(1000 + rank)
    ck3 = os.path.join(out_dir, "w2s3")
    zgraph.save(ck3, saved[0], saved[1], scheduler=saved[2], extra=EXTRA)
    results[f"rng{rank}"] = torch.rand(4)
    results["saved_state"] = whole(saved[0], saved[1])
    results["saved_lr"] = [g["lr"] for g in saved[1].param_groups]

    # resume at stage 3 in a model no step has sharded yet (loaded whole, sharded by the step)
    fresh = make_state()
    torch.manual_seed(5)
    extra = zgraph.load(ck3, fresh[0], fresh[1], scheduler=fresh[2])
    results[f"rng_loaded{rank}"] = torch.rand(4)
    results["extra"] = extra
    results["fresh_loaded_state"] = whole(fresh[0], fresh[1])
    results["resumed_s3_fresh"] = train(fresh, zgraph_step(3), tail, rank, world)

    # resume in the model of the uninterrupted run: stage-3 DTensors loaded in place, its compiled step reused
    zgraph.load(ck3, uninterrupted[0], uninterrupted[1], scheduler=uninterrupted[2])
    results["bound_loaded_state"] = whole(uninterrupted[0], uninterrupted[1])
    results["resumed_s3_bound"] = train(uninterrupted, step0, tail, rank, world)

    # resume at stage 1 in a model a stage-1 step has already sharded (optimizer state as DTensors)
    other = make_state()
    step1 = zgraph_step(1)
    train(other, step1, head[:1], rank, world)
    zgraph.load(ck3, other[0], other[1], scheduler=other[2])
    results["resumed_s1"] = train(other, step1, tail, rank, world)

    # save at stage 0, resume at stage 2 in a fresh model
    s0 = make_state()
    train(s0, zgraph_step(0), head, rank, world)
    ck0 = os.path.join(out_dir, "w2s0")
    zgraph.save(ck0, s0[0], s0[1], scheduler=s0[2])
    resumed = make_state()
    zgraph.load(ck0, resumed[0], resumed[1], scheduler=resumed[2])
    results["resumed_s0_to_s2"] = train(resumed, zgraph_step(2), tail, rank, world)

    from dist_harness import all_gather_values

    gathered = all_gather_values(results)
    if rank == 0:
        merged = {k: v for r in gathered for k, v in r.items()}
        torch.save(merged, os.path.join(out_dir, "world2.pt"))


def resume_worker(rank: int, world: int, checkpoint: str, stage: int, out: str) -> None:
    """Load ``checkpoint`` into a fresh model at ``stage`` and continue; rank 0 saves the losses."""
    import zgraph

    state = make_state()
    zgraph.load(checkpoint, state[0], state[1], scheduler=state[2])
    losses = train(state, zgraph_step(stage), batches()[BEFORE:], rank, world)
    if rank == 0:
        torch.save(losses, out)


# ------------------------------------------------------------------------------------- killed mid-save
def killed_child(path: str, signal_file: str, where: str) -> None:
    """Save a checkpoint to ``path``, then start saving another with different values and stop ``where``
    (``"mid_write"``: after DCP wrote the first tensor; ``"before_marker"``: after DCP finished, before the
    marker), touching ``signal_file`` and sleeping there until the parent kills this process."""
    import torch.distributed.checkpoint.filesystem as fs

    import zgraph
    import zgraph.checkpoint.save_load as zc

    model, opt, _ = make_state()
    zgraph.save(path, model, opt)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def hang() -> None:
        with open(signal_file, "w") as f:
            f.write("1")
        time.sleep(120)

    if where == "mid_write":
        original = fs._write_item

        def write_item(*args, **kwargs):
            result = original(*args, **kwargs)
            args[1].flush()
            hang()
            return result

        fs._write_item = write_item
    else:
        zc._commit = lambda *args, **kwargs: hang()
    zgraph.save(path, model, opt)


# ------------------------------------------------------------------------------------- integrity and safety
class NetWithExtra(Net):
    """``Net`` with a module extra state (``get_extra_state``), saved as data under ``_extra_state``."""

    def __init__(self):
        super().__init__()
        self.tag = "new"

    def get_extra_state(self):
        return {"tag": self.tag, "history": (1, 2.5, float("inf"))}

    def set_extra_state(self, state):
        self.tag = state["tag"]


def save_stage3_worker(rank: int, world: int, path: str) -> None:
    """Train 1 step at stage 3 and save to ``path`` (a checkpoint with a shard file per rank)."""
    import zgraph

    state = make_state()
    train(state, zgraph_step(3), batches()[:1], rank, world)
    zgraph.save(path, state[0], state[1], scheduler=state[2], extra={"step": 1})


def damaged_load_worker(rank: int, world: int, path: str, out_dir: str) -> None:
    """Load a damaged checkpoint into a model a stage-3 step has sharded: every rank must raise
    ``CheckpointError`` and keep its state; each rank writes ``ok<rank>`` if so."""
    import zgraph

    state = make_state()
    train(state, zgraph_step(3), batches()[:1], rank, world)
    before = whole(state[0], state[1])
    try:
        zgraph.load(path, state[0], state[1], scheduler=state[2])
    except zgraph.CheckpointError as error:
        message = str(error)
    else:
        raise AssertionError("a damaged checkpoint loaded")
    after = whole(state[0], state[1])
    for key, value in before["model"].items():
        assert torch.equal(after["model"][key], value), key
    for index, fields in before["optimizer"]["state"].items():
        for key, value in fields.items():
            assert torch.equal(after["optimizer"]["state"][index][key], value), (index, key)
    with open(os.path.join(out_dir, f"ok{rank}"), "w") as f:
        f.write(message)


def concurrent_saver(path: str, value: float, rounds: int, start_file: str) -> None:
    """Save a model whose parameters all equal ``value`` to ``path`` ``rounds`` times, after ``start_file``
    exists (so that two savers overlap)."""
    import zgraph

    model, opt, _ = make_state()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    deadline = time.monotonic() + 60
    while not os.path.exists(start_file) and time.monotonic() < deadline:
        time.sleep(0.01)
    for i in range(rounds):
        zgraph.save(path, model, opt, extra={"value": value, "round": i})
