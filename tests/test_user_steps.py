"""Training steps as users write them, where the state a step uses is not simply among its arguments.

Each test compares the decorated step with the same step run eagerly (on a deep copy, or on a twin built the
same way) after every call, bitwise: the graph runs the same aten ops as eager. Found by a sweep of user-style
steps; before the fixes they silently trained on a frozen batch, never updated a tensor, or crashed inside torch.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from parity import assert_close, compare_states, run_parity
from torch import nn

import zgraph

EAGER = zgraph.Config(backend="eager")


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batches(n: int = 4) -> list[tuple]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(n)]


def with_opt(cls: type, **kw) -> tuple:
    model = mlp()
    return model, cls(model.parameters(), **kw)


def classify(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


# ------------------------------------------------------------------------------------------- batch objects
class Batch:
    """What a custom collate function returns: a plain class, not a dataclass."""

    def __init__(self, x, y):
        self.x, self.y = x, y


def batch_step(model, opt, batch):
    return classify(model, opt, batch.x, batch.y)


def mapping_step(model, opt, batch):
    return classify(model, opt, batch["x"], batch["y"])


@pytest.mark.parametrize("reuse", [False, True], ids=["new_object_per_call", "reused_object"])
def test_plain_batch_object_is_an_input_not_a_constant(reuse):
    holder = Batch(None, None)

    def make_batches():
        for x, y in batches():
            if reuse:
                holder.x, holder.y = x, y
                yield (holder,)
            else:
                yield (Batch(x, y),)

    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_model, ref_opt = copy.deepcopy((model, opt))
    compiled = zgraph.distribute(EAGER)(batch_step)
    for call, (batch,) in enumerate(make_batches()):
        got = compiled(model, opt, batch)
        want = batch_step(ref_model, ref_opt, batch)
        assert_close(got, want, bitwise=True, what=f"call {call}: loss")
    compare_states((model, opt), (ref_model, ref_opt), bitwise=True, what="after the calls")
    assert len(compiled._dispatch.cache) == 1, "one capture for batches of the same shapes"


def test_user_dict_batch():
    data = [(collections.UserDict(x=x, y=y),) for x, y in batches()]
    compiled = run_parity(mapping_step, lambda: with_opt(torch.optim.AdamW, lr=1e-2), data)
    assert len(compiled._dispatch.cache) == 1, "one capture for batches of the same shapes"


@dataclasses.dataclass
class ModelOutput(collections.OrderedDict):
    """Hugging Face's ``ModelOutput`` in small: a dataclass and an ordered dict of its set fields, which refuses
    ``update`` and ``clear`` (a step returning ``model(**batch)`` returns one)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        object.__setattr__(self, key, value)

    def update(self, *args, **kwargs):
        raise Exception(f"You cannot use ``update`` on a {type(self).__name__} instance.")

    def clear(self):
        raise Exception(f"You cannot use ``clear`` on a {type(self).__name__} instance.")


def test_returned_model_output_keeps_its_type_and_fields():
    def step(model, opt, x, y):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return ModelOutput(loss=loss.detach(), logits=logits.detach())

    model, opt = with_opt(torch.optim.SGD, lr=0.1)
    ref_model, ref_opt = copy.deepcopy((model, opt))
    compiled = zgraph.distribute(EAGER)(step)
    for x, y in batches(2):
        got, want = compiled(model, opt, x, y), step(ref_model, ref_opt, x, y)
        assert type(got) is ModelOutput and list(got) == ["loss", "logits"]
        assert_close(got.loss, want.loss, bitwise=True, what="loss attribute")
        assert_close(got["logits"], want["logits"], bitwise=True, what="logits item")


class Weighted(nn.Module):
    """A plain (non-buffer) tensor attribute, reassigned by the user between calls."""

    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.class_weight = torch.ones(4)

    def forward(self, x):
        return self.net(x)


def weighted_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y, weight=model.class_weight)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_plain_tensor_attribute_reassigned_between_calls():
    def make():
        model = Weighted()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def reweight(state):
        state[0].class_weight = state[0].class_weight * 1.5

    run_parity(weighted_step, make, batches(), between_calls=reweight)


# -------------------------------------------------------------------------- tensors outside module params
LOG_ALPHA = torch.zeros(1, requires_grad=True)
ALPHA_OPT = torch.optim.Adam([LOG_ALPHA], lr=0.1)


def sac_alpha_step(x):
    loss = (x * LOG_ALPHA.exp()).mean()
    loss.backward()
    ALPHA_OPT.step()
    ALPHA_OPT.zero_grad()
    return loss


def test_global_learnable_tensor_and_its_optimizer():
    """SAC's temperature: a global tensor with its own optimizer, both named by the step."""
    global LOG_ALPHA, ALPHA_OPT
    LOG_ALPHA = torch.zeros(1, requires_grad=True)
    ALPHA_OPT = torch.optim.Adam([LOG_ALPHA], lr=0.1)
    compiled = zgraph.distribute(EAGER)(sac_alpha_step)
    reference = torch.zeros(1, requires_grad=True)
    reference_opt = torch.optim.Adam([reference], lr=0.1)
    for x, _ in batches():
        got = compiled(x[:, :1])
        want = (x[:, :1] * reference.exp()).mean()
        want.backward()
        reference_opt.step()
        reference_opt.zero_grad()
        assert_close(got, want.detach(), bitwise=True, what="loss")
        assert_close(LOG_ALPHA.detach(), reference.detach(), bitwise=True, what="log_alpha")
    assert LOG_ALPHA.grad is None


class Scaled(nn.Module):
    """A learnable tensor kept as a plain attribute (not an nn.Parameter), listed in the optimizer."""

    def __init__(self):
        super().__init__()
        self.lin = mlp()
        self.scale = torch.ones(1, requires_grad=True)

    def forward(self, x):
        return self.lin(x) * self.scale


def test_learnable_plain_attribute_in_the_optimizer():
    def make():
        model = Scaled()
        return model, torch.optim.SGD([*model.parameters(), model.scale], lr=0.5)

    state = make()
    reference = copy.deepcopy(state)
    compiled = zgraph.distribute(EAGER)(classify)
    for call, (x, y) in enumerate(batches()):
        assert_close(compiled(*state, x, y), classify(*reference, x, y), bitwise=True, what=f"call {call}")
        assert_close(state[0].scale.detach(), reference[0].scale.detach(), bitwise=True, what=f"call {call}: scale")
    compare_states(state, reference, bitwise=True, what="after the calls")


LOCKED = (torch.ones(1, requires_grad=True),)


def test_requires_grad_tensor_in_an_unswappable_place_is_an_error():
    def step(model, opt, x, y):
        loss = F.cross_entropy(model(x) * LOCKED[0], y)
        loss.backward()
        opt.step()
        return loss

    model = mlp()
    compiled = zgraph.distribute(EAGER)(step)
    with pytest.raises(zgraph.CaptureError, match=r"shape \(1,\).*requires_grad"):
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), *batches()[0])
    assert LOCKED[0].grad is None, "the failed capture left no traced gradient on the real tensor"


# ---------------------------------------------------------------------------- state reached indirectly
HELPER_MODEL = mlp()
HELPER_OPT = torch.optim.SGD(HELPER_MODEL.parameters(), lr=0.1)


def forward_loss(x, y):
    return F.cross_entropy(HELPER_MODEL(x), y)


def update():
    HELPER_OPT.step()
    HELPER_OPT.zero_grad()


def helper_step(x, y):
    loss = forward_loss(x, y)
    loss.backward()
    update()
    return loss


def test_model_and_optimizer_reached_only_through_helpers():
    global HELPER_MODEL, HELPER_OPT
    HELPER_MODEL = mlp()
    HELPER_OPT = torch.optim.SGD(HELPER_MODEL.parameters(), lr=0.1, momentum=0.9)
    reference = copy.deepcopy((HELPER_MODEL, HELPER_OPT))
    compiled = zgraph.distribute(EAGER)(helper_step)
    for call, (x, y) in enumerate(batches()):
        got = compiled(x, y)
        want = classify(*reference, x, y)
        assert_close(got, want, bitwise=True, what=f"call {call}: loss")
        compare_states((HELPER_MODEL, HELPER_OPT), reference, bitwise=True, what=f"call {call}")


def test_functools_partial_binding_model_and_optimizer():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference = copy.deepcopy((model, opt))
    compiled = zgraph.distribute(EAGER)(functools.partial(classify, model, opt))
    for call, (x, y) in enumerate(batches()):
        assert_close(compiled(x, y), classify(*reference, x, y), bitwise=True, what=f"call {call}")
    compare_states((model, opt), reference, bitwise=True, what="after the calls")


class TrainState:
    def __init__(self, model, opt):
        self.model, self.opt = model, opt


class Trainer:
    """State two objects deep: ``self.state.model``."""

    def __init__(self):
        model = mlp()
        self.state = TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

    @zgraph.distribute(EAGER)
    def train_step(self, x, y):
        return classify(self.state.model, self.state.opt, x, y)


def test_trainer_with_nested_state():
    trainer = Trainer()
    reference = copy.deepcopy((trainer.state.model, trainer.state.opt))
    for call, (x, y) in enumerate(batches()):
        assert_close(trainer.train_step(x, y), classify(*reference, x, y), bitwise=True, what=f"call {call}")
    compare_states((trainer.state.model, trainer.state.opt), reference, bitwise=True, what="after the calls")


# ---------------------------------------------------------------------------------- in-step Python state
def test_data_assignment_inside_the_step():
    """A max-norm constraint written with ``.data =`` after the update."""

    def step(model, opt, x, y):
        loss = classify(model, opt, x, y)
        with torch.no_grad():
            for layer in (model[0], model[2]):
                layer.weight.data = torch.renorm(layer.weight.data, 2, 0, 0.5)
        return loss

    run_parity(step, lambda: with_opt(torch.optim.SGD, lr=0.5), batches())


def test_data_assignment_of_another_shape_is_an_error():
    def step(model, opt, x, y):
        loss = classify(model, opt, x, y)
        model[0].bias.data = torch.zeros(3)
        return loss

    model = mlp()
    with pytest.raises(zgraph.CaptureError, match=r"\.data"):
        zgraph.distribute(EAGER)(step)(model, torch.optim.SGD(model.parameters(), lr=0.1), *batches()[0])


def test_scheduler_stepped_before_an_optimizer_traced_as_written():
    """RMSprop has no zgraph kernel: its learning rate is a constant of the graph, so a warm-up scheduler
    stepped before ``opt.step()`` must be stepped before the graph is chosen (the graph is traced again)."""

    def step(model, opt, scheduler, x, y):
        scheduler.step()
        return classify(model, opt, x, y)

    def make():
        model = mlp()
        opt = torch.optim.RMSprop(model.parameters(), lr=0.1)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: (i + 1) / 3)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "lr_scheduler.step() before optimizer.step()": as in eager
        run_parity(step, make, batches())


def test_recapturing_every_call_warns_once_naming_the_argument():
    def step(model, opt, x, y, weight):
        loss = F.cross_entropy(model(x), y) * weight
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = zgraph.distribute(EAGER)(step)
    x, y = batches(1)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(10):
            compiled(model, opt, x, y, 1.0 + i)
    messages = [str(w.message) for w in caught if "captured" in str(w.message)]
    assert len(messages) == 1, messages
    assert "argument `weight` changed from 7.0 to 8.0" in messages[0]


def test_returned_python_numbers_warn_that_they_are_frozen():
    def step(model, opt, x, y):
        loss = classify(model, opt, x, y)
        return {"loss": loss, "lr": opt.param_groups[0]["lr"]}

    model = mlp()
    with pytest.warns(RuntimeWarning, match=r"result\['lr'\] = 0.1"):
        zgraph.distribute(EAGER)(step)(model, torch.optim.SGD(model.parameters(), lr=0.1), *batches()[0])


# ------------------------------------------------------------------------------- plain-object optimizers
@pytest.mark.parametrize("world", [1, 2])
def test_plain_object_optimizer_trains_at_every_stage(tmp_path, world):
    """A class that is not a torch.optim.Optimizer, holding ``list(model.parameters())`` and doing
    ``p.sub_(lr * p.grad)``: at stage 3 its list now holds the sharded parameters the model uses (before issue
    16 the parameters never changed at stage 3 on 2 ranks)."""
    import plain_optimizer_cases as cases
    from dist_harness import run_ranks

    path = tmp_path / "results.pt"
    run_ranks(world, "plain_optimizer_cases.run", str(path), ["stages"], timeout=300)
    results = torch.load(path, weights_only=False)["stages"]
    assert "error" not in results, results.get("error")
    want = cases.eager()
    for stage in range(4):
        for name, p in want.items():
            assert_close(results[stage][name], p, bitwise=False, what=f"stage {stage} {name}")
