"""Helpers for parity tests: run a step through zgraph and eagerly on deep copies, compare everything."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

import zgraph


def train_step(model, opt, x, y):
    """The plain classification step many tests compile: forward, backward, optimizer step, zero_grad."""
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


class WithUnused(nn.Module):
    """A linear layer and a parameter the forward never reads (it gets no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Parameter(torch.zeros(16))

    def forward(self, x: Tensor) -> Tensor:
        return self.used(x)


def square_step(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor) -> Tensor:
    """Mean of the squared output, backward, optimizer step, zero_grad; returns the detached loss."""
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def assert_close(actual: Any, expected: Any, *, bitwise: bool, what: str, rtol: float = 1e-6) -> None:
    """Compare tensors (or nested containers of them, or None). ``bitwise``: exact equality."""
    if isinstance(expected, Tensor):
        assert isinstance(actual, Tensor), f"{what}: expected a tensor, got {type(actual).__name__}"
        assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
        if bitwise:
            diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
            assert torch.equal(actual, expected), f"{what}: not bitwise equal (max abs diff {diff:.3e})"
        else:
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * 1e-2, msg=lambda m: f"{what}: {m}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{what}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, bitwise=bitwise, what=f"{what}[{i}]", rtol=rtol)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{what}: keys {sorted(actual)} != {sorted(expected)}"
        for k in expected:
            assert_close(actual[k], expected[k], bitwise=bitwise, what=f"{what}[{k!r}]", rtol=rtol)
    else:
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"


def module_state(module: nn.Module) -> dict[str, Any]:
    """Parameters, buffers and ``.grad`` of a module, by name."""
    state: dict[str, Any] = {}
    for name, p in module.named_parameters():
        state[f"param {name}"] = p.detach()
        state[f"grad {name}"] = None if p.grad is None else p.grad.detach()
    for name, b in module.named_buffers():
        state[f"buffer {name}"] = b
    return state


def optimizer_state(opt: torch.optim.Optimizer, module: nn.Module | None = None) -> dict[str, Any]:
    """An optimizer's state and hyper-parameters, keyed by parameter name where a module is given."""
    names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
    out: dict[str, Any] = {}
    for g_index, group in enumerate(opt.param_groups):
        for p_index, p in enumerate(group["params"]):
            key = names.get(id(p), f"group{g_index}[{p_index}]")
            for k, v in opt.state.get(p, {}).items():
                out[f"state {key}.{k}"] = v
        for k, v in group.items():
            if k != "params":
                out[f"group{g_index}.{k}"] = v
    return out


def run_parity(
    step: Callable,
    make: Callable[[], tuple],
    batches: Iterable[tuple],
    *,
    config: zgraph.Config | None = None,
    bitwise: bool = True,
    rtol: float = 1e-6,
    between_calls: Callable[[tuple], None] | None = None,
    seed: int | None = None,
) -> zgraph.DistributedStep:
    """Run ``step(*state, *batch)`` with zgraph and eagerly on a deep copy of ``state``; after every call
    compare returned values, parameters, buffers, ``.grad`` and optimizer state.

    ``make()`` returns the state tuple (modules, optimizers...). ``between_calls(state)`` runs after each call
    on both copies (an LR scheduler step, say). ``seed``: for steps that draw random numbers, the global
    generator is seeded with ``seed + call`` before each run of a call, and its state after the two runs must
    be equal too.
    """
    state = make()
    reference = copy.deepcopy(state)
    compiled = zgraph.distribute(config or zgraph.Config(backend="eager"))(step)
    for call, batch in enumerate(batches):
        if seed is not None:
            torch.manual_seed(seed + call)
        got = compiled(*state, *batch)
        rng_after = torch.get_rng_state()
        if seed is not None:
            torch.manual_seed(seed + call)
        want = step(*reference, *batch)
        if seed is not None:
            assert torch.equal(rng_after, torch.get_rng_state()), f"call {call}: generator state after the step"
        assert_close(got, want, bitwise=bitwise, what=f"call {call}: returned value", rtol=rtol)
        compare_states(state, reference, bitwise=bitwise, what=f"call {call}", rtol=rtol)
        if between_calls is not None:
            between_calls(state)
            between_calls(reference)
    return compiled


def compare_states(state: tuple, reference: tuple, *, bitwise: bool, what: str, rtol: float = 1e-6) -> None:
    modules = [m for m in state if isinstance(m, nn.Module)]
    ref_modules = [m for m in reference if isinstance(m, nn.Module)]
    for i, (m, r) in enumerate(zip(modules, ref_modules)):
        assert_close(module_state(m), module_state(r), bitwise=bitwise, what=f"{what}: module {i}", rtol=rtol)
    opts = [o for o in state if isinstance(o, torch.optim.Optimizer)]
    ref_opts = [o for o in reference if isinstance(o, torch.optim.Optimizer)]
    owner = modules[0] if len(modules) == 1 else None
    ref_owner = ref_modules[0] if len(ref_modules) == 1 else None
    for i, (o, r) in enumerate(zip(opts, ref_opts)):
        assert_close(
            optimizer_state(o, owner),
            optimizer_state(r, ref_owner),
            bitwise=bitwise,
            what=f"{what}: optimizer {i}",
            rtol=rtol,
        )
