"""``zgraph.DynamicLossScale`` and the check of ``Config.loss_scale``: fp16 loss scaling's options."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic fp16 loss scaling, with DeepSpeed's meaning and defaults.

    Attributes:
        init_scale: first scale (DeepSpeed ``initial_scale_power`` 16: 2**16).
        growth_factor: the scale is multiplied by this after ``growth_interval`` steps without overflow.
        backoff_factor: the scale is multiplied by this when a step overflows (after ``hysteresis`` overflows).
        growth_interval: steps without overflow before the scale grows (DeepSpeed ``loss_scale_window``).
        hysteresis: overflows tolerated before the scale backs off (DeepSpeed ``hysteresis``); every
            overflowing step is skipped regardless.
        min_scale: the scale never goes below this (DeepSpeed ``min_loss_scale``).
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        checks = {
            "init_scale": self.init_scale > 0,
            "growth_factor": self.growth_factor >= 1,
            "backoff_factor": 0 < self.backoff_factor <= 1,
            "growth_interval": isinstance(self.growth_interval, int) and self.growth_interval >= 1,
            "hysteresis": isinstance(self.hysteresis, int) and self.hysteresis >= 1,
            "min_scale": 0 < self.min_scale <= self.init_scale,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"DynamicLossScale.{name} is out of range: {getattr(self, name)!r}")


def loss_scale_value(value: object) -> float | DynamicLossScale | None:
    """``Config.loss_scale`` as the step uses it: None, a ``DynamicLossScale`` (``"dynamic"``: the defaults) or a
    positive float; anything else is a ``ValueError``."""
    if value is None or isinstance(value, DynamicLossScale):
        return value
    if value == "dynamic":
        return DynamicLossScale()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise ValueError(
        f'Config.loss_scale must be None, "dynamic", a zgraph.DynamicLossScale or a positive float; got {value!r}'
    )
