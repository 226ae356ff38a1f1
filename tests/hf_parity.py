"""Parity of a training run against DDP (Trainer's or accelerate's), as ``test_trainer_hf`` and
``test_accelerate_hf`` assert it. A run is a dict: per-optimizer-step series (``SERIES``) and the final whole
``state``. ZGraph's run must equal DDP's within a bound per quantity: ``NOISE_FACTOR`` times DDP's own relative
distance to one process on the global batch (``bounds``), never below ``REL``. DDP is held to that one-process
run in turn (it differs only in the order of float reductions): the series within ``DDP_REL``, the state within
``DDP_STATE_REL`` — looser, because an attention key bias has a gradient that is zero but for round-off, so
Adam's normalised update of it follows the reduction order (GPT-2's ``c_attn.bias``: 1.1e-4 of its scale; every
other tensor about 1e-7).
"""

from __future__ import annotations

import torch

STEPS = 4  # optimizer steps of every run (trainer_hf_cases.STEPS)
REL = 1e-6
NOISE_FACTOR = 10
DDP_REL = 1e-5
DDP_STATE_REL = 1e-3


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference, relative to the largest magnitude of ``expected``."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-12)).item()


def seriesrel(actual: list[float], expected: list[float]) -> float:
    return rel(torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64))


SERIES = ("loss", "grad_norm", "learning_rate")


def bounds(result: dict) -> dict[str, float]:
    """Each logged series' and state tensor's bound: ``NOISE_FACTOR`` times DDP's distance to one process."""
    ddp, eager = result["ddp"], result["eager"]
    for run in (ddp, eager):
        assert "error" not in run, run.get("error")
    noise = {k: seriesrel(ddp[k], eager[k]) for k in SERIES}
    noise.update({k: rel(v, eager["state"][k]) for k, v in ddp["state"].items()})
    return {k: max(REL, NOISE_FACTOR * n) for k, n in noise.items()}


def assert_close(got: dict, want: dict, limits: dict[str, float], what: str, steps: int = STEPS) -> None:
    """``got`` equals ``want`` within ``limits``: every logged series (``steps`` values) and state tensor."""
    assert "error" not in got, f"{what} failed:\n{got.get('error')}"
    for key in SERIES:
        assert len(got[key]) == len(want[key]) == steps, (what, key, got[key])
        err = seriesrel(got[key], want[key])
        assert err <= limits[key], f"{what}: {key} {got[key]} vs {want[key]}: {err:.2e} (bound {limits[key]:.2e})"
    assert got["state"].keys() == want["state"].keys(), what
    for key, value in want["state"].items():
        err = rel(got["state"][key], value)
        assert err <= limits[key], (
            f"{what}: state_dict[{key!r}] off by {err:.2e} of its scale (bound {limits[key]:.2e})"
        )
