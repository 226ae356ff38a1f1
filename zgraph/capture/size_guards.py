"""The conditions a step captured with symbolic sizes (``zgraph.capture.inputs``) holds for, checked before each
call uses it.

A tensor argument's dim traced as a symbol (a backed symbol of the capture's ShapeEnv, hinted with the size the
capturing call had) keeps every size the graph computes symbolic, but the trace may have relied on facts about it:
torch's value range for a backed size ([2, inf): sizes 0 and 1 are specialized), the user's ``mark_dynamic`` range,
and every condition a Python branch of the step, or an op's own shape check, took on a size (two dims an op needs
equal become one symbol; ``if t.shape[1] > 64``, a ``view`` that needs a size to divide). The ShapeEnv records
them as guards; ``SizeGuards`` turns those over the arguments' symbols into one Python expression over the call's
tensors (torch's ``produce_guards_expression``) and evaluates it before a variant is used, as the host guards are
(``zgraph.capture.host_scalars``): a call that breaks one is captured again, never run on a graph that would
compute something else.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from types import CodeType

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP, ShapeEnv

from zgraph.capture.inputs import argument_path
from zgraph.graph import GraphInput


class SizeGuards:
    """The size guards of a capture: ``fakes`` are the symbolic stand-ins of the user tensors ``specs`` (kinds
    ``input`` / ``input_grad``) whose sizes are symbols. The expression is made on first use, after the passes
    (which may add guards of their own, such as a sequence that must divide by the sequence-parallel degree)."""

    def __init__(
        self,
        shape_env: ShapeEnv,
        specs: Sequence[GraphInput],
        fakes: Sequence[Tensor],
        dims: Sequence[Collection[int]],
    ):
        self.shape_env = shape_env
        self.specs = list(specs)
        self.fakes = list(fakes)
        self.dims = list(dims)  # the symbolic dims of each (asked for: a size 0 or 1 is specialized at once)

    def fixed(self) -> list[tuple[str, int, int]]:
        """``(path, dim, size)`` of the symbolic dims the trace fixed to one size (other than 0 or 1): the step (or
        an op) needed that size, so the graph serves it alone."""
        out = []
        for spec, fake, dims in zip(self.specs, self.fakes, self.dims):
            for d in sorted(dims):
                size = fake.shape[d]
                if isinstance(size, torch.SymInt):
                    value = self.shape_env.replace(size.node.expr)
                    if value.is_number and int(value) not in (0, 1):
                        out.append((spec.name, d, int(value)))
        return out

    def expression(self) -> str | None:
        """The guards as one Python expression over ``L['t<i>']``, the i-th of ``specs``; None if there are none."""
        symints = [s for f in self.fakes for s in f.shape if isinstance(s, torch.SymInt)]
        guards = self.shape_env.get_pruned_guards(symints)
        return self.shape_env.produce_guards_expression(self.fakes, guards=guards, ignore_static=False)

    @functools.cached_property
    def _code(self) -> CodeType | None:
        expression = self.expression()
        return None if expression is None else compile(expression, "<zgraph size guards>", "eval")

    def of_step(self, n_user: int) -> SizeGuards:
        """The guards on the step's own ``n_user`` user tensors (a split step's joint trace adds tangents after
        them, which a call does not have when it looks its variant up)."""
        kept = [i for i, s in enumerate(self.specs) if s.index < n_user]
        pick = lambda items: [items[i] for i in kept]
        return SizeGuards(self.shape_env, pick(self.specs), pick(self.fakes), pick(self.dims))

    def hold(self, user_tensors: Sequence[tuple[str, Tensor]]) -> bool:
        """Whether the guards hold for a call's user tensors (``(path, tensor)``, as the capture's)."""
        code = self._code
        if code is None:
            return True
        values = []
        for spec in self.specs:
            if spec.index >= len(user_tensors):
                return False
            t = user_tensors[spec.index][1]
            value = t if spec.kind == "input" else t.grad
            if value is None:
                return False
            values.append(value)
        return bool(eval(code, SYMPY_INTERP, {"L": {f"t{i}": v for i, v in enumerate(values)}}))  # noqa: S307


def size_guards(
    shape_env: ShapeEnv,
    specs: Sequence[GraphInput],
    fakes: Sequence[Tensor],
    dynamic: Mapping[str, Collection[int]],
) -> SizeGuards | None:
    """The size guards of a trace whose user tensors at the paths ``dynamic`` names have symbolic dims; None
    when there are none."""
    chosen = [
        (spec, fake)
        for spec, fake in zip(specs, fakes)
        if spec.kind in ("input", "input_grad") and argument_path(spec) in dynamic
    ]
    if not chosen:
        return None
    return SizeGuards(
        shape_env, [s for s, _ in chosen], [f for _, f in chosen], [dynamic[argument_path(s)] for s, _ in chosen]
    )
