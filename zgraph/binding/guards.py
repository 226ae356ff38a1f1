"""What a step call depends on besides tensor values: the modules and optimizers it uses (discovery), and the
guard key a compiled variant is cached under (shapes, dtypes, structure, requires_grad, grad mode, training
flags, optimizer structure)."""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Collection, Mapping, Sequence

import torch
from torch import Tensor, nn

from zgraph.binding.arguments import StepCall
from zgraph.capture import update_rules as zopt
from zgraph.capture.as_written import lifted_keys
from zgraph.runtime.optimizers import bound_optimizers
from zgraph.runtime.state import Binding
from zgraph.tree import children, iter_leaves, structure_key

_STATE_TYPES = (nn.Module, torch.optim.Optimizer)


def _find_state(obj: object, path: str, out: list[tuple[str, object]], seen: set[int], depth: int = 0) -> None:
    if isinstance(obj, _STATE_TYPES):
        if id(obj) not in seen:
            seen.add(id(obj))
            out.append((path, obj))
        return
    kids = children(obj)
    if kids is not None:
        for suffix, child in kids:
            _find_state(child, path + suffix, out, seen, depth)
    elif depth == 0 and hasattr(obj, "__dict__") and not isinstance(obj, (type, types.ModuleType, Tensor)):
        # A plain object (a trainer, ``self`` of a method): look at its attributes, one level deep.
        for name, value in list(vars(obj).items()):
            _find_state(value, f"{path}.{name}", out, seen, depth + 1)


def discover(
    call: StepCall, observed: Sequence[tuple[str, object]] = ()
) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, torch.optim.Optimizer]]]:
    """Modules and optimizers a step call uses: in its arguments (any nesting), the arguments a
    ``functools.partial`` binds, its closure, the globals it names, and ``observed`` (found while tracing an
    earlier call). An optimizer wrapper is the optimizer it wraps (``zgraph.runtime.optimizers``)."""
    found: list[tuple[str, object]] = []
    seen: set[int] = set()
    for name, value in call.arguments:
        _find_state(value, name, found, seen)
    inner = call.fn
    while isinstance(inner, (functools.partial, types.MethodType)):
        if isinstance(inner, functools.partial):
            _find_state(list(inner.args), "partial.args", found, seen)
            _find_state(dict(inner.keywords), "partial.keywords", found, seen)
            inner = inner.func
        else:
            _find_state(inner.__self__, "self", found, seen)
            inner = inner.__func__
    code = getattr(inner, "__code__", None)
    if code is not None:
        for name, cell in zip(code.co_freevars, getattr(inner, "__closure__", None) or ()):
            try:
                _find_state(cell.cell_contents, name, found, seen, depth=1)
            except ValueError:  # empty cell
                continue
        fn_globals = getattr(inner, "__globals__", {})
        for name in code.co_names:
            if name in fn_globals:
                _find_state(fn_globals[name], name, found, seen, depth=1)
    for name, value in observed:
        _find_state(value, name, found, seen)
    modules = [(label, m) for label, m in found if isinstance(m, nn.Module)]
    return modules, bound_optimizers([(label, o) for label, o in found if isinstance(o, torch.optim.Optimizer)])


# ------------------------------------------------------------------------------------------------ guard key


def named_objects(call: StepCall) -> dict[int, str]:
    """``id -> name`` of the objects a step call's arguments, globals and closure name directly."""
    names: dict[int, str] = {}
    for name, value in call.arguments:
        names.setdefault(id(value), name)
    inner = call.fn
    while isinstance(inner, (functools.partial, types.MethodType)):
        inner = inner.func if isinstance(inner, functools.partial) else inner.__func__
    code = getattr(inner, "__code__", None)
    if code is not None:
        for name in code.co_names:
            if name in getattr(inner, "__globals__", {}):
                names.setdefault(id(inner.__globals__[name]), name)
        for name, cell in zip(code.co_freevars, getattr(inner, "__closure__", None) or ()):
            with contextlib.suppress(ValueError):
                names.setdefault(id(cell.cell_contents), name)
    return names


def binding_key(modules: list, optimizers: list) -> tuple:
    return (
        tuple(id(m) for _, m in modules),
        tuple((id(o), tuple(tuple(id(p) for p in g["params"]) for g in o.param_groups)) for _, o in optimizers),
    )


def _tensor_key(t: Tensor, dynamic: Collection[int] = ()) -> tuple:
    """A tensor's part of the key; its sizes in ``dynamic`` (symbolic dims) are wildcards (None)."""
    shape = tuple(None if d in dynamic else n for d, n in enumerate(t.shape))
    return (shape, t.dtype, t.device, t.requires_grad, t.is_contiguous(), t.is_leaf and t.grad is not None)


def _value_key(value: object, dynamic: Collection[int] = ()) -> object:
    if isinstance(value, Tensor):
        return _tensor_key(value, dynamic)
    if isinstance(value, _STATE_TYPES):
        return (type(value), "object", id(value))
    try:
        hash(value)
    except TypeError:
        return (type(value), "object", id(value))
    return (type(value), value)


KEY_PARTS = (
    "the modules and optimizers",
    "grad mode",
    "autocast",
    "parameters (shape, dtype, device, requires_grad, .grad) or the loss-scale state",
    "buffers",
    "optimizer hyper-parameters or state",
    "train()/eval() flags",
    "the structure of the arguments",
    "an argument",
    "a tensor read outside the arguments",
)


def guard_key(
    binding: Binding,
    arguments: Sequence[tuple[str, object]],
    located: Sequence[Tensor] = (),
    dynamic: Mapping[str, Collection[int]] | None = None,
) -> tuple:
    """Everything a captured graph depends on besides tensor values; ``arguments`` are the step's named
    arguments, ``located`` the tensors read from places ``zgraph.binding.locate`` found, ``dynamic`` the symbolic
    dims of argument tensors by path (``zgraph.binding.dynamic``: their sizes are not part of the key). A different
    key retraces. Its parts are named by ``KEY_PARTS``; the arguments part holds ``(path, key)`` per leaf."""
    dynamic = dynamic or {}
    params = tuple(
        (tuple(r.tensor.shape), r.tensor.dtype, r.tensor.device, r.tensor.requires_grad, _grad_key(r.tensor))
        for r in binding.params
    )
    loss_scale = tuple((k, v.device, v.dtype) for k, v in binding.loss_scale_state.items())
    buffers = tuple(_maybe_tensor_key(r.get()) for r in binding.buffers)
    opts = []
    for o in binding.optimizers:
        kernel = zopt.kernel_for(o.optimizer)
        groups = tuple(kernel.structure(g) if kernel else _group_key(o.optimizer, g) for g in o.optimizer.param_groups)
        states = tuple(
            tuple(sorted((k, _value_key(v)) for k, v in binding.optimizer_state(o.index, i).items()))
            for indices in o.group_params
            for i in indices
        )
        opts.append((groups, states))
    training = tuple(m.training for _, root in binding.modules for m in root.modules())
    leaves = tuple(
        (path, _value_key(leaf, dynamic.get(path, ())))
        for name, value in arguments
        for path, leaf in iter_leaves(value, name)
    )
    autocast = autocast_key(binding.device.type)
    return (
        id(binding),
        torch.is_grad_enabled(),
        autocast,
        (params, loss_scale),
        buffers,
        tuple(opts),
        training,
        tuple((name, structure_key(value)) for name, value in arguments),
        leaves,
        tuple(_tensor_key(t) for t in located),
    )


def _group_key(opt: torch.optim.Optimizer, group: dict) -> tuple:
    """A param group of an optimizer traced as written: its values by value, but those that are graph inputs
    (``zgraph.capture.as_written``; a branch on one is a host guard of the variant)."""
    lifted = {"params", *lifted_keys(opt, group)}
    return tuple(sorted((k, _value_key(v)) for k, v in group.items() if k not in lifted))


def autocast_key(device_type: str) -> tuple:
    """``torch.autocast``'s state (enabled, dtype) for the host, CUDA and ``device_type``: a region entered or
    left around the call, on any of them, retraces."""
    types = dict.fromkeys(("cpu", "cuda", device_type))
    available = [t for t in types if torch.amp.is_autocast_available(t)]
    return tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in available)


def _grad_key(t: Tensor) -> tuple | None:
    g = t.grad
    return None if g is None else (tuple(g.shape), g.dtype, g.device)


def _maybe_tensor_key(t: Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.dtype, t.device, t.is_contiguous())


# ---------------------------------------------------------------------------------------------- compiled step


def describe_leaf(leaf_key: tuple) -> str:
    """A guard-key leaf (``_value_key``) as the user would recognise it."""
    if len(leaf_key) == 6 and isinstance(leaf_key[1], torch.dtype):
        shape = tuple("*" if n is None else n for n in leaf_key[0])
        return f"a tensor of shape {shape} ({leaf_key[1]})"
    if len(leaf_key) == 3:
        return f"a {leaf_key[0].__name__} object"
    return repr(leaf_key[1])
