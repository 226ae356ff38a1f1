"""Steps on process groups smaller than the world (run on 4 ranks by ``test_process_group.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zgraph

STEPS = 3


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * seed + step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def two_groups_train_their_own_models(rank: int, world: int) -> None:
    """Ranks 0-1 and 2-3 each train their own model at ZeRO-3 over their own group; each equals eager on the
    group's global batch, and a rank outside a step's group is refused."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    side, local = divmod(rank, 2)
    model = _model(seed=side)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zgraph.distribute(stage=3, param_persistence_threshold=0, process_group=groups[side])(_train)
    reference = _model(seed=side)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i in range(STEPS):
        x, y = _batch(side, i)
        loss = step(model, opt, x[2 * local : 2 * local + 2], y[2 * local : 2 * local + 2])
        mean = loss.clone()
        dist.all_reduce(mean, group=groups[side])
        expected = _train(reference, ref_opt, x, y)
        torch.testing.assert_close(mean / 2, expected, rtol=1e-5, atol=1e-6)
    assert all(p.to_local().shape[0] < p.shape[0] for p in model.parameters())  # sharded over 2 ranks, not 4
    with zgraph.gather(model):
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    outsider = zgraph.distribute(stage=3, process_group=groups[1 - side])(_train)
    try:
        outsider(model, opt, x, y)
    except RuntimeError as error:
        assert "not a member of the step's process_group" in str(error), error
    else:
        raise AssertionError("a step on another group's ranks ran")


def _encode(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def another_stage_is_refused_and_the_backward_still_runs(rank: int, world: int) -> None:
    """A step of another ZeRO stage on a model a split output still needs is refused (naming the stage), and
    leaves the parameters as they were: the output's backward then gives eager's gradients."""
    model, reference = _model(seed=7), _model(seed=7)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    out = zgraph.distribute(stage=1)(_encode)(model, x[2 * rank : 2 * rank + 2])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        zgraph.distribute(stage=3, param_persistence_threshold=0)(_train)(model, opt, x, torch.zeros(4, 4))
    except zgraph.ZGraphError as error:
        assert "already sharded by another zgraph step with stage 1" in str(error), error
    else:
        raise AssertionError("a stage-3 step re-laid out a model bound at stage 1")
    out.backward(torch.ones_like(out))
    reference(x).backward(torch.ones(4, 4) / world)  # the ranks' gradients are averaged
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def zgraph_groups_run_one_collective_at_a_time(rank: int, world: int) -> None:
    """zgraph's own gloo group has one worker thread: two collectives of a step never run at once (two did,
    under load, corrupt the heap); the user's default group keeps gloo's own setting."""
    from zgraph.runtime.process_group import _TIMED_GROUPS

    model = _model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step = zgraph.distribute(stage=3, param_persistence_threshold=0, backend="eager")(_train)
    for i in range(2):
        step(model, opt, *_batch(rank, i))
    cpu = torch.device("cpu")
    threads = lambda name: dist.distributed_c10d._resolve_process_group(name)._get_backend(cpu).options._threads
    assert _TIMED_GROUPS and all(threads(info.group_name) == 1 for info in _TIMED_GROUPS.values())
    assert threads(dist.group.WORLD.group_name) == 2


def exit_hook_destroys_zgraph_groups_only(rank: int, world: int) -> None:
    """zgraph's exit hook destroys zgraph's own groups, and the default group only if zgraph started it."""
    from zgraph.runtime.process_group import _TIMED_GROUPS, destroy_own_groups

    user_started = dist.is_initialized()
    model = _model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    zgraph.distribute(stage=3, param_persistence_threshold=0, backend="eager")(_train)(model, opt, *_batch(rank, 0))
    ours = {info.group_name for info in _TIMED_GROUPS.values()}
    assert ours and dist.is_initialized()
    dist.barrier()  # both ranks are done with the step (and the store rank 0 serves) before anything goes
    destroy_own_groups()
    assert dist.is_initialized() == user_started
    if user_started:
        assert not ours & set(dist.distributed_c10d._world.pg_names.values())
