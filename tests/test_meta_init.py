"""Models built on the meta device (issue 27, item 1): ``zgraph.materialize`` and a step's first call give each
rank its shards filled by the model's own initialisation, equal to the eager model from the same seed, and the
model then trains as eager does; rank 0 alone holding the real model (``sync_module_states``) works; refusals
change nothing and never hang."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from meta_cases import BUILDERS, init_and_train, meta_model
from torch import nn

import zgraph
from zgraph.runtime.meta_init import MetaInitError

HF = [name for name in BUILDERS if name.startswith("hf")]
PLAIN = [name for name in BUILDERS if not name.startswith("hf")]


def test_one_process_equals_eager():
    init_and_train(0, 1, PLAIN, [0, 3])  # one process: stages 1 and 2 shard nothing, as stage 0


@pytest.mark.hf
def test_one_process_hugging_face_equals_eager():
    pytest.importorskip("transformers")
    init_and_train(0, 1, HF, [0, 3])


def test_two_ranks_every_stage():
    run_ranks(2, "meta_cases.init_and_train", ["gpt", "llama"], [0, 1, 2, 3], timeout=600)


@pytest.mark.hf
def test_two_ranks_every_stage_hugging_face():
    pytest.importorskip("transformers")
    run_ranks(2, "meta_cases.init_and_train", ["hf-llama-tied"], [0, 1, 2, 3], timeout=600)


def test_four_ranks():
    run_ranks(4, "meta_cases.init_and_train", ["gpt-untied"], [0, 1, 2, 3], timeout=600)


@pytest.mark.hf
def test_four_ranks_hugging_face():
    pytest.importorskip("transformers")
    run_ranks(4, "meta_cases.init_and_train", ["hf-llama"], [1, 3], timeout=600)


def test_rank0_holds_the_model():
    run_ranks(2, "meta_cases.rank0_holds_the_model", timeout=300)


def test_ranks_that_disagree_are_refused_quickly():
    run_ranks(2, "meta_cases.ranks_disagree", timeout=120)


class _NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_a_module_with_no_initialisation_is_named_and_nothing_changes():
    with torch.device("meta"):
        model = _NoInit()
    with pytest.raises(MetaInitError, match=r"_NoInit at '<root>' .*\(scale\).*reset_parameters"):
        zgraph.materialize(model)
    assert all(p.is_meta for p in model.parameters())


def test_buffers_on_the_host_beside_meta_parameters():
    """``accelerate.init_empty_weights()`` keeps buffers real: only the parameters are made real."""
    reference = BUILDERS["llama"]()
    with torch.device("meta"):
        model = BUILDERS["llama"]()
    model.cos, model.sin = reference.cos.clone(), reference.sin.clone()
    zgraph.materialize(model)
    assert not any(p.is_meta for p in model.parameters())
    assert torch.equal(model.cos, reference.cos)


def test_materialize_keeps_real_state():
    model = meta_model("gpt")
    zgraph.materialize(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    zgraph.materialize(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_meta_tensor_only_an_optimizer_holds_is_refused_before_anything_changes():
    model = meta_model("gpt")
    extra = nn.Parameter(torch.empty(3, device="meta"))
    opt = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    step = zgraph.distribute(stage=0, backend="eager")(lambda model, opt, x: model(x).sum())
    with pytest.raises(MetaInitError, match="held by an optimizer only"):
        step(model, opt, torch.zeros(1, 4, dtype=torch.long))
    assert all(p.is_meta for p in model.parameters())
