"""``zgraph.Config``: every option of a distributed step, validated when it is built."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_BACKENDS = ("inductor", "eager")
_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Config:
    """Options of ``@zgraph.distribute``. Frozen; every field is checked when the object is created.

    Attributes:
        stage: ZeRO stage, with DeepSpeed's meaning. 0: data parallel (gradients all-reduced, everything
            replicated). 1: optimizer state sharded across ranks. 2: gradients sharded too (reduce-scattered).
            3: parameters sharded too (all-gathered around their uses). Default 0.
        backend: ``"inductor"`` compiles the transformed graph with inductor; ``"eager"`` runs the transformed
            FX GraphModule op by op (no compile time, same numbers). Default ``"inductor"``.
        disable_passes: names of pipeline passes to skip (see ``zgraph.passes.default_pipeline``). An unknown
            name, or a pass another enabled pass depends on, is rejected before anything runs.
        extra_passes: user passes, each a ``zgraph.passes.Pass`` or a plain ``fn(gm, ctx) -> gm`` (named after
            the function, appended at the end of the pipeline).
    """

    stage: int = 0
    backend: str = "inductor"
    disable_passes: tuple[str, ...] = ()
    extra_passes: tuple[Any, ...] = field(default=())

    def __post_init__(self) -> None:
        _check_choice("stage", self.stage, _STAGES, int)
        _check_choice("backend", self.backend, _BACKENDS, str)
        object.__setattr__(self, "disable_passes", _as_str_tuple("disable_passes", self.disable_passes))
        object.__setattr__(self, "extra_passes", _as_pass_tuple(self.extra_passes))

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (validated like a new Config)."""
        return dataclasses.replace(self, **changes)


def _type_name(value: object) -> str:
    return type(value).__name__


def _check_choice(name: str, value: object, allowed: tuple, typ: type) -> None:
    if not isinstance(value, typ) or isinstance(value, bool):
        raise ValueError(
            f"Config.{name} must be one of {', '.join(map(repr, allowed))}; got {value!r} ({_type_name(value)})"
        )
    if value not in allowed:
        raise ValueError(f"Config.{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _as_str_tuple(name: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise ValueError(f"Config.{name} must be a list of pass names; got {value!r} ({_type_name(value)})")
    items = tuple(value)
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"Config.{name} must contain pass names (str); got {item!r} ({_type_name(item)})")
    return items


def _as_pass_tuple(value: object) -> tuple[Any, ...]:
    from zgraph.passes import Pass

    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"Config.extra_passes must be a list of zgraph.passes.Pass or fn(gm, ctx) -> gm; got {value!r}"
        )
    passes = []
    for item in value:
        if isinstance(item, Pass):
            passes.append(item)
        elif isinstance(item, Callable):
            passes.append(Pass(name=getattr(item, "__name__", repr(item)), fn=item))
        else:
            raise ValueError(
                "Config.extra_passes must contain zgraph.passes.Pass objects or callables fn(gm, ctx) -> gm; "
                f"got {item!r} ({_type_name(item)})"
            )
    return tuple(passes)
