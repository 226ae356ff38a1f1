"""``torch.optim`` classes zgraph has no kernel for (``zgraph.capture.update_rules``), traced as written.

Their own ``step()`` runs under the tracer (``zgraph.capture.optimizers``), with:

- every numeric hyper-parameter of a param group (a float, or a tuple of floats such as ``betas``, ``etas``) a
  0-d float64 graph input, set into the group as a host-known symbol while the step is traced
  (``zgraph.capture.host_scalars``): a changed ``lr`` or an LR scheduler does not recapture, and a Python branch on
  a hyper-parameter (``if weight_decay != 0``) is a guard checked before each call. Integers (Muon's ``ns_steps``,
  a loop count), booleans and strings stay constants of the graph, part of its guard key;
- Python builtins that torch.optim applies to values only the device knows made graph operations: Adafactor's
  ``max(eps2, RMS(param))`` and ``max(1.0, RMS(update) / d)`` are ``torch.sym_max`` (the same number, computed
  by the graph), its ``min(lr, 1 / sqrt(step))`` ``torch.sym_min``.

Only the classes ``torch.optim`` defines are lifted so: a subclass, or another library's optimizer, may read its
hyper-parameters in ways a symbol does not stand for, and is traced with them as constants.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from zgraph.capture import update_rules as zopt

# classes whose step's module applies Python builtins to device values: class -> (module, {builtin: replacement})
_SYMBOLIC_BUILTINS = {
    torch.optim.Adafactor: (torch.optim._adafactor, {"max": torch.sym_max, "min": torch.sym_min}),
}


def lifts(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt``'s numeric hyper-parameters are graph inputs: a zgraph kernel reads them, or the class is one
    ``torch.optim`` defines."""
    module = type(opt).__module__
    return zopt.kernel_for(opt) is not None or module == "torch.optim" or module.startswith("torch.optim.")


def _is_float(value: object) -> bool:
    return isinstance(value, float)


def lifted_keys(opt: torch.optim.Optimizer, group: dict) -> list[str]:
    """The param-group keys of a class traced as written whose values are graph inputs."""
    if zopt.kernel_for(opt) is not None or not lifts(opt):
        return []
    return [
        k
        for k, v in group.items()
        if k != "params" and (_is_float(v) or (isinstance(v, tuple) and v and all(_is_float(x) for x in v)))
    ]


def hyperparameters(opt: torch.optim.Optimizer, group: dict) -> dict[str, float]:
    """A param group's numeric hyper-parameters that are graph inputs, by input name (a tuple's items as
    ``"betas.0"``, ``"betas.1"``)."""
    kernel = zopt.kernel_for(opt)
    if kernel is not None:
        return kernel.hyperparameters(group)
    out: dict[str, float] = {}
    for key in lifted_keys(opt, group):
        value = group[key]
        if isinstance(value, tuple):
            out.update({f"{key}.{i}": float(x) for i, x in enumerate(value)})
        else:
            out[key] = float(value)
    return out


@contextlib.contextmanager
def lifted_groups(opt: torch.optim.Optimizer, hparams: list[dict[str, Tensor]]) -> Iterator[None]:
    """While the step of a class traced as written runs: each lifted group value is the ``.item()`` of its graph
    input (``hparams``, per group), read under ``zgraph.capture.host_scalars.HostScalars`` (a host-known symbol);
    the values are put back after. (A fused kernel, ``Adagrad(fused=True)``'s, takes its hyper-parameters as
    floats: a symbol there is fixed to its value by a guard, so a change recaptures.)"""
    saved = []
    try:
        for group, inputs in zip(opt.param_groups, hparams):
            for key in lifted_keys(opt, group):
                saved.append((group, key, group[key]))
                value = group[key]
                if isinstance(value, tuple):
                    group[key] = tuple(inputs[f"{key}.{i}"].item() for i in range(len(value)))
                else:
                    group[key] = inputs[key].item()
        yield
    finally:
        for group, key, value in saved:
            group[key] = value


@contextlib.contextmanager
def symbolic_builtins(opt: torch.optim.Optimizer) -> Iterator[None]:
    """While ``opt``'s step runs: the builtins its module applies to device values are graph operations."""
    module, replaced = _SYMBOLIC_BUILTINS.get(type(opt), (None, {}))
    try:
        for name, fn in replaced.items():
            setattr(module, name, fn)
        yield
    finally:
        for name in replaced:
            vars(module).pop(name, None)
