"""A stage-3 model handed to serializers on 2 ranks (run by test_serializers.py)."""

from __future__ import annotations

import copy
import io
import os

import torch
import torch.nn.functional as F
from dist_harness import run_named
from torch import nn

import zgraph


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _error(fn) -> str:
    try:
        fn()
    except zgraph.ShardedParameterError as error:
        return f"ShardedParameterError: {error}"
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def stage3(rank: int, world: int) -> dict:
    """Train one stage-3 step, then read the sharded state as serializers do; save whole tensors the two
    documented ways (``full_state_dict``, inside ``gather``) with safetensors where it is installed."""
    model, opt = make()
    step = zgraph.distribute(stage=3, backend="eager", param_persistence_threshold=0)(train)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    step(model, opt, x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4])
    weight = model.state_dict()["0.weight"]
    out = {
        "untyped_storage": _error(lambda: weight.untyped_storage().data_ptr()),
        "storage": _error(lambda: weight.storage()),
        "data_ptr": _error(lambda: weight.data_ptr()),
        "optimizer_state": _error(lambda: opt.state_dict()["state"][0]["exp_avg"].untyped_storage()),
        "torch_save": _error(lambda: torch.save((model.state_dict(), opt.state_dict()), io.BytesIO())),
        "deepcopy": _error(lambda: copy.deepcopy(model)),
        "local_data_ptr": _error(lambda: weight.to_local().data_ptr()),
        "whole": zgraph.full_state_dict(model),
    }
    try:
        import safetensors.torch as st
    except ImportError:
        return out
    directory = os.environ["SERIALIZER_DIR"]
    out["safetensors_sharded"] = _error(lambda: st.save_file(model.state_dict(), f"{directory}/sharded.safetensors"))
    state = zgraph.full_state_dict(model)
    with zgraph.gather(model):
        out["inside_gather"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        out["save_gathered"] = _error(lambda: st.save_file(model.state_dict(), f"{directory}/{rank}.gathered"))
    out["save_full_state_dict"] = _error(lambda: st.save_file(state, f"{directory}/{rank}.full_state_dict"))
    return out


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named checks; rank 0 saves ``{name: result}``."""
    run_named(rank, world, out_path, names, globals())
