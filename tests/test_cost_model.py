"""The collective cost model's fit (``zgraph.runtime.cost_model``)."""

from __future__ import annotations

import pytest

from zgraph.runtime.cost_model import _fit


def test_fit_recovers_latency_and_bandwidth():
    points = [(b, 100e-6 + b / 1e9) for b in (64 * 1024, 1024 * 1024, 8 * 1024 * 1024)]
    cost = _fit(points)
    assert cost.latency == pytest.approx(100e-6, rel=1e-6)
    assert cost.bandwidth == pytest.approx(1e9, rel=1e-6)


def test_fit_of_noise_without_a_slope_stays_positive():
    cost = _fit([(64 * 1024, 2e-3), (1024 * 1024, 1e-3), (8 * 1024 * 1024, 1.5e-3)])
    assert cost.latency >= 1e-6 and cost.bandwidth > 0
