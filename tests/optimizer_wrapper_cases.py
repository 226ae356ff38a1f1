"""Optimizer wrappers in a zgraph step (issue 28, part 5): ``torch.optim.Optimizer`` subclasses that forward
``state`` and ``param_groups`` to the optimizer inside them, as frameworks hand them to a training step. Used by
test_optimizer_wrappers.py in one process and on 2 spawned ranks (``run``)."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from dist_harness import run_named
from torch import nn

import zgraph

STEPS = 3
GLOBAL_BATCH = 8
LR = 1e-2


class Forwarding(torch.optim.Optimizer):
    """accelerate's ``AcceleratedOptimizer`` in short: the wrapped optimizer as ``optimizer``, no
    ``Optimizer.__init__``, ``state`` / ``param_groups`` / ``defaults`` properties, and its ``zero_grad`` that asks
    the wrapped ``zero_grad``'s signature whether it takes ``set_to_none``."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.optimizer = inner

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=None):
        if "set_to_none" not in inspect.signature(self.optimizer.zero_grad).parameters:
            if set_to_none is not None:
                raise ValueError("`set_to_none` for Optimizer.zero_grad` is not supported by this optimizer.")
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True if set_to_none is None else set_to_none)


class LightningShaped:
    """Lightning's ``LightningOptimizer`` in short: the wrapped optimizer as ``_optimizer`` (and the ``optimizer``
    property), its class swapped for a subclass of the wrapped one (``isinstance`` checks pass, ``type`` is not
    ``AdamW``), every other attribute read from the wrapped optimizer by ``__getattr__``. (Lightning's ``step``
    goes through its strategy, which passes a closure; this one calls the wrapped ``step()`` directly.)"""

    def __init__(self, inner: torch.optim.Optimizer):
        self._optimizer = inner
        self.__class__ = type("Lightning" + type(inner).__name__, (LightningShaped, type(inner)), {})

    @property
    def optimizer(self):
        return self._optimizer

    def step(self, closure=None):
        return self._optimizer.step()

    def zero_grad(self, set_to_none=True):
        return self._optimizer.zero_grad(set_to_none)

    def __getattr__(self, item):
        return getattr(self._optimizer, item)


class OtherName(torch.optim.Optimizer):
    """A wrapper keeping the optimizer where zgraph does not look (``inner``): the traced ``step()`` reaches the
    wrapped optimizer, which shares its ``state`` and ``param_groups``; the two are one optimizer."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner = inner

    @property
    def state(self):
        return self.inner.state

    @state.setter
    def state(self, value):
        self.inner.state = value

    @property
    def param_groups(self):
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.inner.param_groups = value

    def state_dict(self):
        return self.inner.state_dict()

    def step(self, closure=None):
        return self.inner.step(closure)

    def zero_grad(self, set_to_none=True):
        return self.inner.zero_grad(set_to_none)


class OwnState(Forwarding):
    """A wrapper zgraph cannot read: it keeps a ``state`` dict of its own beside the wrapped optimizer's."""

    def __init__(self, inner: torch.optim.Optimizer):
        super().__init__(inner)
        self.own_state: dict = {}

    @property
    def state(self):
        return self.own_state


WRAPPERS = {"forwarding": Forwarding, "lightning_shaped": LightningShaped, "other_name": OtherName}


def make(wrap=None) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    return model, inner if wrap is None else wrap(inner)


def train_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g))
        for _ in range(steps)
    ]


def eager() -> dict:
    """Eager PyTorch with the plain AdamW on the global batches: losses, parameters, optimizer state_dict."""
    model, opt = make()
    losses = [train_step(model, opt, x, y) for x, y in batches()]
    return {"losses": losses, "model": model.state_dict(), "optim": opt.state_dict()}


def stages(rank: int, world: int) -> dict:
    """Every wrapper at every stage on this rank's slice of the global batches: the ranks' mean losses and the
    whole state (``zgraph.full_state_dict`` through the wrapper)."""
    out = {}
    n = GLOBAL_BATCH // world
    for name, wrap in WRAPPERS.items():
        for stage in range(4):
            model, opt = make(wrap)
            step = zgraph.distribute(stage=stage, backend="eager", param_persistence_threshold=0)(train_step)
            losses = []
            for x, y in batches():
                loss = step(model, opt, x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
                torch.distributed.all_reduce(loss)
                losses.append(loss / world)
            model_state, optim_state = zgraph.full_state_dict(model, opt)
            out[(name, stage)] = {"losses": losses, "model": model_state, "optim": optim_state}
    return out


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named checks; rank 0 saves ``{name: result}``."""
    run_named(rank, world, out_path, names, globals())
