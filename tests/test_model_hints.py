"""zgraph.capture.model_hints: capture failures inside a known model pattern name the call that avoids them."""

from __future__ import annotations

import types

import torch
from torch import nn

from zgraph.capture.model_hints import hint


class _Experts(nn.Module):
    """Stands in for a transformers experts module: a ``config`` with ``_experts_implementation``."""

    def __init__(self, implementation: str):
        super().__init__()
        self.config = types.SimpleNamespace(_experts_implementation=implementation)
        self.num_experts = 4

    def forward(self, x):
        for _ in x.nonzero():  # data-dependent, as transformers' eager experts loop
            pass
        raise RuntimeError("data-dependent")


class _Dense(_Experts):
    """A dense model: transformers 5 sets ``_experts_implementation="eager"`` on GPT-2's config too."""

    def __init__(self, implementation: str):
        super().__init__(implementation)
        del self.num_experts


def _raised(implementation: str, cls: type = _Experts) -> BaseException:
    try:
        cls(implementation)(torch.ones(2))
    except RuntimeError as exc:
        return exc
    raise AssertionError("did not raise")


def test_eager_experts_name_batched_mm():
    text = hint(_raised("eager"))
    assert 'set_experts_implementation("batched_mm")' in text and "_Experts" in text


def test_other_implementations_and_plain_code_give_no_hint():
    assert hint(_raised("grouped_mm")) == ""
    assert hint(_raised("eager", _Dense)) == "", "a dense model's failure is not the experts loop's"
    try:
        raise ValueError("plain")
    except ValueError as exc:
        assert hint(exc) == ""
