"""Which optimizers a step binds: an optimizer wrapper is the optimizer it wraps.

Frameworks hand the training step a ``torch.optim.Optimizer`` subclass that forwards ``state`` and
``param_groups`` to the optimizer inside it (accelerate's ``AcceleratedOptimizer`` keeps it as ``optimizer``,
Lightning's ``LightningOptimizer`` as ``_optimizer``). zgraph binds, traces, shards and checkpoints the wrapped
optimizer, where the state lives; the wrapper's own ``step()`` still runs in a traced step and reaches the wrapped
optimizer's traced ``step``. An optimizer whose state zgraph cannot tell apart from another's is refused with a
``CaptureError`` naming its class, and so are the ``torch.optim`` classes a graph cannot run (``REFUSED``): before
the step binds anything, so the model and the optimizer are left as they were.
"""

from __future__ import annotations

import torch

from zgraph.errors import CaptureError

# where optimizer wrappers keep the optimizer they forward to (accelerate's AcceleratedOptimizer: ``optimizer``;
# Lightning's LightningOptimizer: ``_optimizer``, also read through its ``optimizer`` property)
_WRAPPED_ATTRS = ("optimizer", "_optimizer")

Named = list[tuple[str, torch.optim.Optimizer]]

# torch.optim classes a captured step cannot run: class -> why, and what to do instead
REFUSED: dict[type, str] = {
    torch.optim.LBFGS: (
        "LBFGS.step(closure) calls its closure (forward and backward) a number of times that its line search "
        "decides on the host from the loss values, which one captured graph cannot replay. Run LBFGS eagerly, "
        "outside a zgraph step, or use another optimizer"
    ),
    torch.optim.SparseAdam: (
        "SparseAdam updates only the rows a sparse gradient (nn.Embedding(sparse=True)) names, and zgraph's "
        "graph inputs, gradient reductions and ZeRO shards are dense tensors. Use dense gradients "
        "(nn.Embedding(sparse=False)) with torch.optim.Adam or AdamW"
    ),
}


def unwrap_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer ``opt`` stands for: ``opt`` itself or, for a wrapper that keeps a ``torch.optim.Optimizer`` as
    ``optimizer`` or ``_optimizer`` and forwards ``state`` and ``param_groups`` to it, the optimizer it wraps, down
    the chain. A wrapper whose ``state`` or ``param_groups`` is not the wrapped optimizer's is refused
    (``CaptureError`` naming its class): zgraph could not tell which state the update reads and writes."""
    seen = {id(opt)}
    while (found := _wrapped(opt)) is not None and id(found[1]) not in seen:
        attr, inner = found
        unshared = [name for name in ("state", "param_groups") if getattr(opt, name, None) is not getattr(inner, name)]
        if unshared:
            raise CaptureError(
                f"zgraph cannot read the optimizer {class_name(opt)}: it wraps the {class_name(inner)} in its "
                f"`{attr}`, but its {' and '.join(f'`{n}`' for n in unshared)} {'is' if len(unshared) == 1 else 'are'}"
                " not the wrapped optimizer's, so zgraph cannot tell which state its step updates. Forward `state` "
                "and `param_groups` to the wrapped optimizer (as accelerate's AcceleratedOptimizer does), or pass "
                "the wrapped optimizer to the step."
            )
        seen.add(id(inner))
        opt = inner
    return opt


def bound_optimizers(found: Named) -> Named:
    """The optimizers a step binds from the ``(name, optimizer)`` pairs it reached: each unwrapped, once, under the
    name found first. Optimizers sharing one ``param_groups`` list and one ``state`` (a wrapper that forwards them
    from another attribute, reached along with the optimizer it wraps: the traced wrapper's ``step()`` reaches it)
    are one: the one that holds both as its own attributes. Sharing ``param_groups`` but not ``state`` is refused."""
    out: dict[int, tuple[str, torch.optim.Optimizer]] = {}
    for label, opt in found:
        opt = unwrap_optimizer(opt)
        why = REFUSED.get(type(opt))
        if why is not None:
            raise CaptureError(f"zgraph does not support the optimizer {class_name(opt)} ({label}): {why}.")
        key = id(opt.param_groups)
        if key in out:
            label, opt = out[key][0], _owner(out[key][1], opt)
        out[key] = (label, opt)
    return list(out.values())


def _owner(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Of two optimizers sharing their ``param_groups``, the one that holds them and the shared ``state``."""
    if a is b:
        return a
    if a.state is b.state:
        owners = [o for o in (a, b) if "state" in vars(o) and "param_groups" in vars(o)]
        if len(owners) == 1:
            return owners[0]
    shared = "`param_groups` and `state`" if a.state is b.state else "`param_groups` but not their `state`"
    raise CaptureError(
        f"zgraph cannot read the optimizers {class_name(a)} and {class_name(b)}: the step reaches both, and they share "
        f"{shared}, so zgraph cannot tell which one's state the update reads and writes. A wrapper should keep the "
        "optimizer it wraps as `optimizer` or `_optimizer` and forward `state` and `param_groups` to it."
    )


def _wrapped(opt: object) -> tuple[str, torch.optim.Optimizer] | None:
    """``(attribute, optimizer)``: the ``torch.optim.Optimizer`` a wrapper keeps, or None."""
    for attr in _WRAPPED_ATTRS:
        inner = getattr(opt, attr, None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not opt:
            return attr, inner
    return None


def class_name(obj: object) -> str:
    """``module.QualifiedName`` of ``obj``'s class, as errors name it."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
