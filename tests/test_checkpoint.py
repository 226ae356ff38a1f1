"""``zgraph.save`` / ``zgraph.load`` / ``zgraph.consolidate``: round trips, resharding, atomicity, bad input.

The model (``checkpoint_cases.Net``) has an embedding of 9 rows (5 + 4 rows on 2 ranks, 3 + 3 + 3 + 0 on 4) and
AdamW with two param groups under a StepLR scheduler. A run is 3 steps, a checkpoint, 3 more steps. Resumed at
the world size and stage that saved, the losses are bitwise those of the uninterrupted run; resumed at another
world size or stage, they equal eager PyTorch on the global batch within 1e-6 relative (ranks reduce gradients
in another order than one process does, as in tests/test_zero_parity.py). Every rank group is started once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import checkpoint_cases as cc
import pytest
import torch
from dist_harness import run_ranks
from torch import nn

import zgraph
from zgraph.cli.main import main as cli_main

REL = 1e-6
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """What ``checkpoint_cases.world2_worker`` did on 2 ranks (its checkpoints are under ``results["dir"]``)."""
    out = tmp_path_factory.mktemp("ckpt_world2")
    run_ranks(2, "checkpoint_cases.world2_worker", str(out), timeout=300)
    results = torch.load(out / "world2.pt", weights_only=False)
    results["dir"] = out
    return results


@pytest.fixture(scope="module")
def reference():
    """Eager PyTorch on one process: the losses of all 6 steps, and the state after the first 3."""
    before = cc.eager_run(cc.BEFORE)["state"]
    return {"losses": cc.eager_run()["losses"], "model": before[0], "optimizer": before[1]}


def assert_losses_close(got, want, what):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= REL * abs(b), f"{what}, step {i}: {a} vs {b}"


def assert_rel(actual, expected, what):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), what
        return
    err = (actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)
    assert err <= REL, f"{what}: max |diff| is {err.item():.2e} of max |expected|"


def assert_same_state(got, want, what):
    """Model and optimizer state (``checkpoint_cases.whole``) bitwise equal."""
    assert got["model"].keys() == want["model"].keys(), what
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), f"{what}: model[{key!r}]"
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"], what
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys(), what
    for index, state in want["optimizer"]["state"].items():
        assert state.keys() == got["optimizer"]["state"][index].keys()
        for key, value in state.items():
            assert torch.equal(got["optimizer"]["state"][index][key], value), f"{what}: state[{index}][{key!r}]"


def snapshot(model, opt):
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": {
            "state": {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        },
    }


# --------------------------------------------------------------------------------------------- 2 ranks
def test_uninterrupted_run_matches_eager(world2, reference):
    assert_losses_close(world2["uninterrupted"], reference["losses"], "zgraph stage 3 on 2 ranks vs eager")


def test_saved_state_is_the_eager_state(world2, reference):
    saved = world2["saved_state"]
    for key, value in reference["model"].state_dict().items():
        assert_rel(saved["model"][key], value, f"model[{key!r}]")
    for index, state in reference["optimizer"].state_dict()["state"].items():
        for key, value in state.items():
            assert_rel(saved["optimizer"]["state"][index][key], value, f"optimizer state[{index}][{key!r}]")


def test_round_trip_stage3_two_ranks(world2):
    """Saved at stage 3 on 2 ranks and loaded there, into a model no step has sharded yet and into the sharded
    model of another run: the same state, and the run goes on with bitwise the uninterrupted losses."""
    after = world2["uninterrupted"][cc.BEFORE :]
    assert_same_state(world2["fresh_loaded_state"], world2["saved_state"], "loaded into a fresh model")
    assert_same_state(world2["bound_loaded_state"], world2["saved_state"], "loaded into a sharded model")
    assert world2["resumed_s3_fresh"] == after
    assert world2["resumed_s3_bound"] == after
    assert world2["saved_lr"] == [0.01, 0.01]  # StepLR halved it after step 2: restored with the param groups


def test_extra_and_rng_restored(world2):
    extra = world2["extra"]
    assert extra.keys() == cc.EXTRA.keys()
    assert extra["epoch"] == 7 and extra["name"] == "run-a" and torch.equal(extra["tokens"], cc.EXTRA["tokens"])
    for rank in range(2):
        assert torch.equal(world2[f"rng_loaded{rank}"], world2[f"rng{rank}"]), f"rank {rank}'s RNG"
    assert not torch.equal(world2["rng0"], world2["rng1"])  # each rank got its own state back


def test_resume_at_other_stages_two_ranks(world2, reference):
    after = reference["losses"][cc.BEFORE :]
    assert_losses_close(world2["resumed_s1"], after, "saved at stage 3, loaded into a stage-1 sharded model")
    assert_losses_close(world2["resumed_s0_to_s2"], after, "saved at stage 0, resumed at stage 2")


# --------------------------------------------------------------------------------------------- 1 and 4 ranks
def test_resume_on_one_process(world2, reference):
    """The 2-rank stage-3 checkpoint loaded without any process group, resumed by a zgraph step."""
    state = cc.make_state()
    extra = zgraph.load(world2["dir"] / "w2s3", state[0], state[1], scheduler=state[2])
    assert extra["epoch"] == 7
    assert torch.equal(torch.rand(4), world2["rng0"])  # rank 0's RNG
    assert state[2].last_epoch == cc.BEFORE
    losses = cc.train(state, cc.zgraph_step(3), cc.batches()[cc.BEFORE :])
    assert_losses_close(losses, reference["losses"][cc.BEFORE :], "resumed on 1 process")


def test_resume_on_four_ranks(world2, reference, tmp_path):
    out = tmp_path / "losses.pt"
    run_ranks(4, "checkpoint_cases.resume_worker", str(world2["dir"] / "w2s3"), 3, str(out), timeout=300)
    losses = torch.load(out)
    assert_losses_close(losses, reference["losses"][cc.BEFORE :], "resumed at stage 3 on 4 ranks (one empty shard)")


# --------------------------------------------------------------------------------------------- 1 process
@pytest.mark.parametrize("stage", [None, 0, 3])
def test_round_trip_one_process(tmp_path, stage):
    """Without a process group: eager PyTorch (``stage=None``, the model never seen by zgraph) or a zgraph step
    saves after 3 steps; a fresh model loads, and goes on exactly like the uninterrupted run."""
    make_step = (lambda: cc.classify_step) if stage is None else (lambda: cc.zgraph_step(stage))
    batches = cc.batches()
    uninterrupted = cc.make_state()
    want = cc.train(uninterrupted, make_step(), batches)

    first = cc.make_state()
    cc.train(first, make_step(), batches[: cc.BEFORE])
    zgraph.save(tmp_path / "ck", *first[:2], scheduler=first[2], extra={"step": cc.BEFORE})
    saved = snapshot(*first[:2])

    second = cc.make_state()
    assert zgraph.load(tmp_path / "ck", *second[:2], scheduler=second[2]) == {"step": cc.BEFORE}
    loaded = snapshot(*second[:2])
    for key, value in saved["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    names = {id(p): n for n, p in first[0].named_parameters()}
    by_name = {names[id(p)]: s for p, s in saved["optimizer"]["state"].items()}
    names = {id(p): n for n, p in second[0].named_parameters()}
    assert {names[id(p)] for p in loaded["optimizer"]["state"]} == by_name.keys()
    for p, state in loaded["optimizer"]["state"].items():
        for key, value in by_name[names[id(p)]].items():
            assert torch.equal(state[key], value) and state[key].dtype == value.dtype, (names[id(p)], key)
    assert loaded["optimizer"]["groups"] == saved["optimizer"]["groups"]
    assert cc.train(second, make_step(), batches[cc.BEFORE :]) == want[cc.BEFORE :]


class WithExtraState(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.tag = "new"

    def get_extra_state(self):
        return {"tag": self.tag}

    def set_extra_state(self, state):
        self.tag = state["tag"]


def test_module_extra_state(tmp_path):
    model = WithExtraState()
    model.tag = "saved"
    zgraph.save(tmp_path / "ck", model)
    other = WithExtraState()
    zgraph.load(tmp_path / "ck", other)
    assert other.tag == "saved" and torch.equal(other.fc.weight, model.fc.weight)


# --------------------------------------------------------------------------------------------- consolidation
def test_consolidate_cli_loads_without_zgraph(world2, tmp_path, capsys):
    out = tmp_path / "model.pt"
    assert cli_main(["consolidate", str(world2["dir"] / "w2s3"), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    expected = tmp_path / "expected.pt"
    torch.save(world2["saved_state"]["model"], expected)
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["zgraph"] = None  # importing zgraph fails from here on
        import torch
        from checkpoint_cases import Net
        state = torch.load({str(out)!r}, weights_only=True)
        model = Net()
        model.load_state_dict(state)  # strict: exactly the model's keys
        expected = torch.load({str(expected)!r}, weights_only=True)
        assert list(state) == list(Net().state_dict()), list(state)
        for key, value in expected.items():
            assert type(state[key]) is torch.Tensor and torch.equal(state[key], value), key
        assert all(v.dtype == torch.float32 for k, v in state.items() if k != "calls")
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_consolidate_casts_low_precision_to_fp32(tmp_path):
    model = cc.Net().to(torch.bfloat16)
    zgraph.save(tmp_path / "ck", model)
    state = zgraph.consolidate(tmp_path / "ck", tmp_path / "out.pt")
    written = torch.load(tmp_path / "out.pt", weights_only=True)
    assert written.keys() == state.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        want = value.float() if value.is_floating_point() else value
        assert written[key].dtype == want.dtype and torch.equal(written[key], want), key


def test_consolidate_refuses_incomplete(tmp_path, capsys):
    (tmp_path / "ck").mkdir()
    assert cli_main(["consolidate", str(tmp_path / "ck"), str(tmp_path / "out.pt")]) == 1
    assert ".zgraph_complete" in capsys.readouterr().err
    assert not (tmp_path / "out.pt").exists()


# --------------------------------------------------------------------------------------------- atomicity
@pytest.mark.parametrize("where", ["mid_write", "before_marker"])
def test_killed_save_leaves_previous_checkpoint(tmp_path, where):
    """A process killed (SIGKILL) while saving over a checkpoint — in the middle of DCP's writes, or after DCP
    finished but before the marker — leaves the previous checkpoint loadable at ``path`` and a temporary
    directory that no load takes for a checkpoint; the next save cleans it up."""
    path, signal_file = tmp_path / "ck", tmp_path / "signal"
    code = f"import checkpoint_cases; checkpoint_cases.killed_child({str(path)!r}, {str(signal_file)!r}, {where!r})"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p))
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not signal_file.exists():
            assert child.poll() is None, child.stderr.read()
            assert time.monotonic() < deadline, "the child never reached the point to kill it at"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stderr.close()

    temps = sorted(tmp_path.glob("ck.tmp-*"))
    assert len(temps) == 1 and any(temps[0].iterdir())  # the interrupted save's files
    assert (temps[0] / ".metadata").exists() == (where == "before_marker")

    expected = cc.Net()  # the child's first checkpoint: the initial model
    model, opt, _ = cc.make_state()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    zgraph.load(path, model, opt)
    for key, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key

    untouched = cc.Net()
    with pytest.raises(zgraph.CheckpointError, match="no .zgraph_complete marker"):
        zgraph.load(temps[0], untouched)
    assert all(torch.equal(untouched.state_dict()[k], v) for k, v in expected.state_dict().items())

    zgraph.save(path, model, opt)
    assert not list(tmp_path.glob("ck.tmp-*")) and not list(tmp_path.glob("ck.old-*"))


def test_save_replaces_a_checkpoint_and_refuses_other_directories(tmp_path):
    model = cc.Net()
    zgraph.save(tmp_path / "ck", model)
    with torch.no_grad():
        model.l1.bias.fill_(3.0)
    zgraph.save(tmp_path / "ck", model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    other = cc.Net()
    zgraph.load(tmp_path / "ck", other)
    assert torch.equal(other.l1.bias, torch.full((11,), 3.0))

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("x")
    with pytest.raises(zgraph.CheckpointError, match="not a zgraph checkpoint"):
        zgraph.save(tmp_path / "data", model)
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "data"]


# --------------------------------------------------------------------------------------------- bad input
@pytest.fixture
def saved_checkpoint(tmp_path):
    model, opt, scheduler = cc.make_state()
    cc.train((model, opt, scheduler), cc.classify_step, cc.batches()[:1])
    zgraph.save(tmp_path / "ck", model, opt)
    return tmp_path / "ck"


def test_load_of_another_model_lists_keys_and_changes_nothing(saved_checkpoint):
    model, opt, _ = cc.make_state(cc.Net(hidden=12, head="out"))
    before = snapshot(model, opt)
    with pytest.raises(zgraph.CheckpointError) as raised:
        zgraph.load(saved_checkpoint, model, opt)
    message = str(raised.value)
    assert "missing in the checkpoint (2): out.weight, out.bias" in message
    assert "unexpected (in the checkpoint, not in the model) (2): l2.weight, l2.bias" in message
    assert "l1.weight: checkpoint (11, 6), model (12, 6)" in message
    assert "l1.bias: checkpoint (11,), model (12,)" in message
    assert "emb.weight" not in message
    after = snapshot(model, opt)
    for key, value in before["model"].items():
        assert torch.equal(after["model"][key], value), key
    assert not opt.state and after["optimizer"]["groups"] == before["optimizer"]["groups"]


def test_load_with_another_optimizer_layout_changes_nothing(saved_checkpoint):
    model = cc.Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)  # one group, the checkpoint has two
    before = snapshot(model, opt)
    with pytest.raises(zgraph.CheckpointError, match=r"param_groups: checkpoint \[3, 2\] parameters per group"):
        zgraph.load(saved_checkpoint, model, opt)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before["model"].items())
    assert not opt.state and opt.param_groups[0]["lr"] == 0.5

    model, opt, scheduler = cc.make_state()
    with pytest.raises(zgraph.CheckpointError, match="no LR scheduler state"):
        zgraph.load(saved_checkpoint, model, opt, scheduler=scheduler)
    with pytest.raises(zgraph.CheckpointError, match="no checkpoint at"):
        zgraph.load(saved_checkpoint.parent / "nothing", model, opt)


def test_loss_scale_state_restored(tmp_path):
    """The dynamic loss scale a step carries is saved, and restored into a step's state (before its first call,
    and in place into a running one)."""
    if not hasattr(zgraph, "DynamicLossScale"):
        pytest.skip("this zgraph has no loss scaling")
    config = zgraph.Config(
        stage=0,
        backend="eager",
        measure_collectives=False,
        loss_scale=zgraph.DynamicLossScale(init_scale=2.0**10, growth_interval=2),
    )
    batches = cc.batches()
    state, step = cc.make_state(), zgraph.distribute(config)(cc.classify_step)
    cc.train(state, step, batches[: cc.BEFORE])
    saved_scale = {k: v.clone() for k, v in state[1]._zgraph_loss_scale.items()}
    zgraph.save(tmp_path / "ck", *state[:2], scheduler=state[2])
    want = cc.train(state, step, batches[cc.BEFORE :])
    want_scale = dict(state[1]._zgraph_loss_scale)
    assert want_scale["scale"] != saved_scale["scale"]  # the scale moved after the checkpoint

    fresh = cc.make_state()
    zgraph.load(tmp_path / "ck", *fresh[:2], scheduler=fresh[2])
    assert cc.train(fresh, zgraph.distribute(config)(cc.classify_step), batches[cc.BEFORE :]) == want
    zgraph.load(tmp_path / "ck", *state[:2], scheduler=state[2])
    assert torch.equal(state[1]._zgraph_loss_scale["scale"], saved_scale["scale"])
    assert cc.train(state, step, batches[cc.BEFORE :]) == want
    for resumed in (fresh, state):
        assert resumed[1]._zgraph_loss_scale.keys() == want_scale.keys()
        for key, value in want_scale.items():
            assert torch.equal(resumed[1]._zgraph_loss_scale[key], value), key


def test_optimizer_state_keeps_the_dtype_it_has(tmp_path):
    """State is loaded into the dtype the optimizer keeps it in (a run with another optimizer_state_dtype), and
    created in the saved dtype where the optimizer has none yet."""
    state = cc.make_state()
    cc.train(state, cc.classify_step, cc.batches()[:1])
    model, opt, _ = state
    zgraph.save(tmp_path / "ck", model, opt)
    other_state = cc.make_state()
    cc.train(other_state, cc.classify_step, cc.batches()[1:2])
    other, other_opt, _ = other_state
    weight = other.l1.weight
    other_opt.state[weight]["exp_avg"] = other_opt.state[weight]["exp_avg"].to(torch.bfloat16)
    zgraph.load(tmp_path / "ck", other, other_opt)
    loaded = other_opt.state[weight]["exp_avg"]
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded, opt.state[model.l1.weight]["exp_avg"].to(torch.bfloat16))
    assert other_opt.state[weight]["exp_avg_sq"].dtype == torch.float32


def test_two_optimizers_and_a_frozen_parameter(tmp_path):
    """A list of optimizers (SGD with momentum, AdamW), one parameter without state: the loaded state is the
    saved one, created for SGD's lazily made momentum, and removed where the checkpoint has none."""

    def make():
        model = cc.Net()
        model.emb.weight.requires_grad_(False)
        sgd = torch.optim.SGD([model.emb.weight, *model.l1.parameters()], lr=0.1, momentum=0.9)
        adamw = torch.optim.AdamW(model.l2.parameters(), lr=0.01)
        return model, sgd, adamw

    def step(model, sgd, adamw, ids, y):
        loss = torch.nn.functional.cross_entropy(model(ids), y)
        loss.backward()
        for opt in (sgd, adamw):
            opt.step()
            opt.zero_grad()

    model, sgd, adamw = make()
    for batch in cc.batches()[:2]:
        step(model, sgd, adamw, *batch)
    assert model.emb.weight not in sgd.state
    zgraph.save(tmp_path / "ck", model, [sgd, adamw])

    other, other_sgd, other_adamw = make()
    other_sgd.state[other.emb.weight] = {"momentum_buffer": torch.ones(cc.VOCAB, 6)}
    other_sgd.param_groups[0]["lr"] = 0.5
    zgraph.load(tmp_path / "ck", other, [other_sgd, other_adamw])
    assert other.emb.weight not in other_sgd.state and other_sgd.param_groups[0]["lr"] == 0.1
    for saved, loaded in ((sgd, other_sgd), (adamw, other_adamw)):
        want, got = saved.state_dict(), loaded.state_dict()
        assert want["param_groups"] == got["param_groups"] and want["state"].keys() == got["state"].keys()
        for index, state in want["state"].items():
            assert state.keys() == got["state"][index].keys()
            assert all(torch.equal(got["state"][index][k], v) for k, v in state.items())
    with pytest.raises(zgraph.CheckpointError, match=r"3 optimizer\(s\) given, the checkpoint holds 2"):
        zgraph.load(tmp_path / "ck", other, [other_sgd, other_adamw, torch.optim.SGD(other.parameters(), lr=1)])
