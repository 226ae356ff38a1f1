"""Offload runs for tests/test_offload.py: the same training with and without ``offload_optimizer="nvme"``."""

from __future__ import annotations

import errno
import os
import tempfile

import torch
from torch import nn

import zgraph

STEPS = 4


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def batches(rank: int = 0, world: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        n = 8 // world
        out.append((x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]))
    return out


def make_step(config: zgraph.Config):
    @zgraph.distribute(config)
    def step(model, opt, x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def train(config: zgraph.Config, rank: int = 0, world: int = 1) -> tuple[list[float], dict, dict]:
    """Losses (as exact float bits) and the whole model / optimizer state after training."""
    model, opt = make()
    step = make_step(config)
    losses = [step(model, opt, x, y).item() for x, y in batches(rank, world)]
    model_state, optim_state = zgraph.full_state_dict(model, opt)
    return losses, model_state, optim_state


def same(a: object, b: object) -> bool:
    """Bitwise equality of nested results."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def compare_ranks(rank: int, world: int, stage: int, state_dtype_name: str | None) -> None:
    """On each rank: offloaded training equals training without offload, bitwise; files gone afterwards."""
    state_dtype = getattr(torch, state_dtype_name) if state_dtype_name else None
    base = zgraph.Config(stage=stage, backend="eager", measure_collectives=False, optimizer_state_dtype=state_dtype)
    with tempfile.TemporaryDirectory() as directory:
        expected = train(base, rank, world)
        got = train(base.replace(offload_optimizer="nvme", offload_dir=directory), rank, world)
        assert same(expected, got), f"rank {rank}: offloaded training differs"
        import gc

        gc.collect()
        assert os.listdir(directory) == [], os.listdir(directory)


# ------------------------------------------------------------------------------------------ parameters (stage 3)
RECIPES = {
    "fp32": {},
    "bf16": dict(param_dtype=torch.bfloat16, master_dtype=torch.bfloat16, optimizer_state_dtype=torch.bfloat16),
}


def stage3(recipe: str = "fp32", backend: str = "eager", **fields: object) -> zgraph.Config:
    """Stage 3 with every parameter of ``make()``'s model sharded (threshold 0 except where a test sets one)."""
    fields = {"param_persistence_threshold": 0, **fields}
    return zgraph.Config(stage=3, backend=backend, measure_collectives=False, **RECIPES[recipe], **fields)


def with_offload(config: zgraph.Config, directory: str, optimizer: bool) -> zgraph.Config:
    """``config`` with ``offload_params="nvme"`` (and ``offload_optimizer="nvme"`` if ``optimizer``)."""
    extra = {"offload_optimizer": "nvme"} if optimizer else {}
    return config.replace(offload_params="nvme", offload_dir=directory, **extra)


def compare_params_ranks(rank: int, world: int, recipe: str, optimizers: list[bool], backend: str = "eager") -> None:
    """On each rank: training with offloaded parameter shards (and optimizer states, for each ``True`` of
    ``optimizers``) equals the same training without offload (trained once), bitwise (losses, whole parameters,
    optimizer state); files gone afterwards."""
    import gc

    base = stage3(recipe, backend)
    expected = train(base, rank, world)
    for optimizer in optimizers:
        with tempfile.TemporaryDirectory() as directory:
            got = train(with_offload(base, directory, optimizer), rank, world)
            assert same(expected, got), f"rank {rank}: training with offloaded parameters differs ({recipe})"
            gc.collect()
            assert os.listdir(directory) == [], os.listdir(directory)


def params_checkpoint_ranks(rank: int, world: int, directory: str) -> None:
    """Save with offloaded parameters after two steps, resume without offload (and into an offloading step
    whose shards are in files already): the same losses as the run that went on; gather sees the real values."""
    data = batches(rank, world)
    offload = with_offload(stage3(), os.path.join(directory, f"rank{rank}"), optimizer=True)
    os.makedirs(offload.offload_dir, exist_ok=True)
    model, opt = make()
    step = make_step(offload)
    for x, y in data[:2]:
        step(model, opt, x, y)
    with zgraph.gather(model):
        gathered = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert same(gathered, zgraph.full_state_dict(model)), "gather and full_state_dict disagree"
    zgraph.save(os.path.join(directory, "ckpt"), model, opt)
    continued = [step(model, opt, x, y).item() for x, y in data[2:]]
    model2, opt2 = make(seed=1)
    zgraph.load(os.path.join(directory, "ckpt"), model2, opt2)
    resumed = [make_step(stage3())(model2, opt2, x, y).item() for x, y in data[2:]]
    assert resumed == continued, (resumed, continued)
    model3, opt3 = make(seed=2)
    step3 = make_step(offload)
    step3(model3, opt3, *data[0])  # its shards are in files now; load replaces them
    zgraph.load(os.path.join(directory, "ckpt"), model3, opt3)
    assert [step3(model3, opt3, x, y).item() for x, y in data[2:]] == continued


def _shard_storages(model: nn.Module) -> dict[str, int]:
    """Bytes of each parameter's local storage (0: released to the offload files)."""
    return {name: getattr(p, "_local_tensor", p).untyped_storage().nbytes() for name, p in model.named_parameters()}


def params_in_files_ranks(rank: int, world: int, directory: str) -> None:
    """One rank: shards leave memory between steps (whole parameters under the threshold stay), the graph reloads
    them in forward and backward, explain() and dump() show it, reading the model sees the real values."""
    from zgraph.runtime.memory import state_bytes

    threshold = 64  # the biases (64, 64 and 4 elements) stay whole, in memory
    base = stage3(param_persistence_threshold=threshold)
    held = {}
    for name, config in (("memory", base), ("nvme", with_offload(base, directory, optimizer=False))):
        model, opt = make()
        step = make_step(config)
        for x, y in batches(rank, world):
            step(model, opt, x, y)
        held[name] = state_bytes(model, opt)
    sharded = sum(p.numel() * 4 for p in make()[0].parameters() if p.numel() > threshold)
    assert held["memory"]["params"] - held["nvme"]["params"] == sharded, (held, sharded)
    assert held["memory"]["optimizer"] == held["nvme"]["optimizer"]  # offload_params alone: states stay
    storages = _shard_storages(model)
    assert all((n == 0) == name.endswith("weight") for name, n in storages.items()), storages
    store = step._dispatch.last.offload
    assert sum(os.path.getsize(os.path.join(store.path, f)) for f in os.listdir(store.path)) == 2 * sharded
    final = step.graphs["final"]
    reloads = [n for n in final.graph.nodes if n.target is torch.ops.zgraph.reload.default]
    placeholders = [n for n in final.graph.nodes if n.op == "placeholder"]
    phases = {}
    for node in reloads:
        phases.setdefault(placeholders[node.args[1]].meta["zgraph_input"].name, []).append(node.meta["phase"])
    assert sorted(phases) == ["0.weight", "2.weight", "4.weight"], phases
    assert phases["2.weight"] == ["forward", "backward", "optimizer"], phases  # reloaded per phase, not held
    writes = [n for n in final.graph.nodes if n.target is torch.ops.zgraph.write_back.default]
    assert len(writes) == 3 and all(n.meta["zgraph_pass"] == "offload" for n in reloads + writes)
    assert f'offload_params="nvme": 3 parameter shards ({sharded} of {sharded} sharded parameter bytes)' in (
        step.explain()
    )
    dumped = step.dump(os.path.join(directory, "dump"))
    assert any("zgraph.reload.default" in open(path).read() for path in dumped)
    state = model.state_dict()  # its hook reads the shards back
    assert all(n > 0 for n in _shard_storages(model).values())
    whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    assert same(whole, zgraph.full_state_dict(model))


def params_full_disk_ranks(rank: int, world: int, directory: str) -> None:
    """A full disk when the shards are first offloaded: a clear error, the parameters untouched; once space is
    free the same step goes on exactly as training without offload."""
    from zgraph.runtime import offload as runtime_offload
    from zgraph.runtime import offload_nvme

    expected = train(stage3(), rank, world)
    model, opt = make()
    step = make_step(with_offload(stage3(), directory, optimizer=True))
    data = batches(rank, world)

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    real = offload_nvme.os.posix_fallocate
    offload_nvme.os.posix_fallocate = full
    try:
        step(model, opt, *data[0])
        raise AssertionError("a full disk was not reported")
    except runtime_offload.OffloadError as error:
        assert "disk under offload_dir full" in str(error) and "training state is intact" in str(error), error
    finally:
        offload_nvme.os.posix_fallocate = real
    untouched = make()[0].state_dict()
    assert same(zgraph.full_state_dict(model), untouched)
    assert not [f for _, _, files in os.walk(directory) for f in files]  # nothing half-reserved is left
    losses = [step(model, opt, x, y).item() for x, y in data]
    assert losses == expected[0], (losses, expected[0])
    assert same(zgraph.full_state_dict(model, opt), expected[1:])


def params_eager_optimizer_ranks(rank: int, world: int, directory: str, split: bool) -> None:
    """A zgraph forward/backward step over offloaded shards (``split``: a forward step, backward run outside it,
    from the returned loss), then an eager ``opt.step()`` outside it: the optimizer reads and updates the real
    parameters, as without offload."""
    results = []
    for config in (stage3(), with_offload(stage3(), directory, optimizer=False)):
        model, opt = make()

        @zgraph.distribute(config)
        def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.cross_entropy(model(x), y)
            if not split:
                loss.backward()
            return loss

        losses = []
        for x, y in batches(rank, world):
            loss = forward_backward(model, x, y)
            if split:
                loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        results.append((losses, zgraph.full_state_dict(model)))
        if split and config.offload_params:  # both graphs of the split step read the shards through reloads
            parts = forward_backward._dispatch.last.split
            assert parts is not None and parts.forward_reloads and parts.backward_reloads
    assert same(results[0], results[1]), "an eager optimizer step over offloaded parameters differs"


def params_eager_optimizer_after_another_store(rank: int, world: int, directory: str) -> None:
    """``params_eager_optimizer_ranks`` (split) in a process that used an offload tier before any stage-3 step:
    torch runs global optimizer hooks in registration order, so the offload tier's ran before the one that points
    the optimizer at its shards, missed that they were offloaded, and the eager step read released storage
    (a segfault)."""
    model, opt = make()
    config = zgraph.Config(stage=1, backend="eager", offload_optimizer="nvme", offload_dir=directory)
    make_step(config)(model, opt, *batches(rank, world)[0])
    params_eager_optimizer_ranks(rank, world, directory, True)


def params_inductor_ranks(rank: int, world: int, directory: str) -> None:
    """The inductor backend compiles the graph with the offload nodes (no fallback to eager) and trains
    bitwise as it does without offload."""
    expected = train(stage3(backend="inductor"), rank, world)
    model, opt = make()
    step = make_step(with_offload(stage3(backend="inductor"), directory, optimizer=True))
    losses = [step(model, opt, x, y).item() for x, y in batches(rank, world)]
    assert step._dispatch.last.executable.backend == "inductor", step._dispatch.last.executable.backend
    assert same(expected, (losses, *zgraph.full_state_dict(model, opt)))


def params_recapture_ranks(rank: int, world: int, directory: str) -> None:
    """Two batch shapes, two graphs, one store: the shards' files are found by the parameter, not the graph, and
    the losses match training without offload call by call."""
    model, opt = make()
    reference, ref_opt = make()
    step, plain = make_step(with_offload(stage3(), directory, optimizer=True)), make_step(stage3())
    for x, y in batches(rank, world):
        for rows in (4, 3):
            got = step(model, opt, x[:rows], y[:rows]).item()
            assert got == plain(reference, ref_opt, x[:rows], y[:rows]).item(), rows
    store = step._dispatch.last.offload
    assert len(os.listdir(store.path)) == 2 * len(store.states) == 2 * (6 + 2 * 6)  # 6 shards, 12 states
    assert same(zgraph.full_state_dict(model, opt), zgraph.full_state_dict(reference, ref_opt))
