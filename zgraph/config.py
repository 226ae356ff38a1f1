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
        allgather_bucket_bytes: largest all-gather the ``bucket`` pass builds by merging parameter gathers, in
            bytes of the gathered (whole) tensors; 0 disables merging; ``"auto"`` (default) sizes buckets from
            the cost model so that a collective's latency is a tenth of its transfer time.
        reduce_bucket_bytes: the same for gradient reduce-scatters and all-reduces.
        prefetch_bytes: stage 3: how many bytes of parameters the ``schedule`` pass may have gathered ahead of
            their first use (issued or landed, not yet used); ``"auto"`` (default): two all-gather buckets.
        param_persistence_threshold: stage 3: parameters with at most this many elements are not sharded; they
            stay whole on every rank and need no all-gather (DeepSpeed's
            ``stage3_param_persistence_threshold``, same default: 100000).
        measure_collectives: fit the collective cost model (latency + bytes / bandwidth) by a short
            measurement on the first call, cached per machine and world size; False uses an analytical model.
    """

    stage: int = 0
    backend: str = "inductor"
    disable_passes: tuple[str, ...] = ()
    extra_passes: tuple[Any, ...] = field(default=())
    allgather_bucket_bytes: int | str = "auto"
    reduce_bucket_bytes: int | str = "auto"
    prefetch_bytes: int | str = "auto"
    param_persistence_threshold: int = 100_000
    measure_collectives: bool = True

    def __post_init__(self) -> None:
        _check_choice("stage", self.stage, _STAGES, int)
        _check_choice("backend", self.backend, _BACKENDS, str)
        for name in ("allgather_bucket_bytes", "reduce_bucket_bytes", "prefetch_bytes"):
            _check_size(name, getattr(self, name), allow_auto=True)
        _check_size("param_persistence_threshold", self.param_persistence_threshold, allow_auto=False)
        if not isinstance(self.measure_collectives, bool):
            raise ValueError(
                f"Config.measure_collectives must be True or False; got {self.measure_collectives!r} "
                f"({_type_name(self.measure_collectives)})"
            )
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


def _check_size(name: str, value: object, allow_auto: bool) -> None:
    allowed = "a non-negative int" + (' or "auto"' if allow_auto else "")
    if allow_auto and value == "auto":
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"Config.{name} must be {allowed}; got {value!r} ({_type_name(value)})")
    if value < 0:
        raise ValueError(f"Config.{name} must be {allowed}; got {value}")


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
