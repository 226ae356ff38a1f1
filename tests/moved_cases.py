"""A model moved between steps (``zero_checks.CHECKS``' ``moved_between_steps``, run inside the spawned ranks):
``model.to(device)`` on a model whose parameters zgraph sharded, and a parameter re-laid out by hand."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import Replicate

import zgraph


def _mse_step(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def moved_between_steps(rank: int, world: int) -> dict:
    """``model.to(device)`` between steps (accelerate, Trainer and users call it; on a model zgraph sharded it swaps
    copies into the DTensor parameters): per stage, the largest difference of the full parameters from eager
    PyTorch on the global batch after three steps with a move after the first. Then, at stage 3, after another
    step failed on every rank and this one succeeded again, a parameter swapped for one laid out otherwise
    (replicated): the error the next step raises, and whether the model was left as it was."""
    from zero_checks import _mlp, _step_with_list_all_gather  # zero_checks imports this module

    out: dict = {}
    for stage in range(4):
        torch.manual_seed(0)
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        reference = copy.deepcopy(model)
        reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        step = zgraph.distribute(zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0))(_mse_step)
        for call in range(3):
            xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * call + r)) for r in range(world)]
            step(model, opt, xs[rank])
            _mse_step(reference, reference_opt, torch.cat(xs))
            if call == 0:
                model.to("cpu")
        full = zgraph.full_state_dict(model)
        out[stage] = max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items())
    try:  # a failure on every rank (capture refuses it), then a good call: the old failure records are over
        zgraph.distribute(stage=0, backend="eager")(_step_with_list_all_gather)(_mlp(), None, torch.randn(4, 8))
    except zgraph.CaptureError:
        pass
    step(model, opt, torch.randn(4, 8))
    weight = model[0].weight
    before = {k: v.clone() for k, v in zgraph.full_state_dict(model).items()}
    torch.utils.swap_tensors(weight, nn.Parameter(weight.redistribute(placements=[Replicate()])))
    try:
        step(model, opt, torch.randn(4, 8))
        out["replicated"] = "no error"
    except zgraph.ZGraphError as error:
        out["replicated"] = str(error)
    after = zgraph.full_state_dict(model)
    out["unchanged"] = all(torch.equal(after[k], v) for k, v in before.items())
    return out
