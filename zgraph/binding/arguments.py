"""One call of a step: its function and arguments, bound to the function's signature once and handed down."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCall:
    """A step's function and the arguments of one call.

    Attributes:
        fn: the user's step.
        args, kwargs: the call's arguments, as given.
        arguments: ``(name, value)`` of each argument, named after the step's signature where it binds (else
            ``args[i]`` and the keyword names).
    """

    fn: Callable
    args: tuple
    kwargs: dict
    arguments: tuple[tuple[str, object], ...]

    @classmethod
    def of(cls, fn: Callable, args: tuple, kwargs: dict) -> StepCall:
        try:
            bound = inspect.signature(fn).bind(*args, **kwargs)
        except (TypeError, ValueError):
            named = [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
            return cls(fn, args, kwargs, tuple(named))
        return cls(fn, args, kwargs, tuple(bound.arguments.items()))

    @property
    def name(self) -> str:
        """The step's qualified name, for messages."""
        return getattr(self.fn, "__qualname__", str(self.fn))
