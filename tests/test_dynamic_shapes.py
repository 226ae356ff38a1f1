"""Symbolic sizes (issue 41, item 1): a step whose batch and sequence sizes change is captured at most twice.

The first call captures for its sizes; the first call whose guard key differs only in the sizes of some argument
dims makes those dims (and the batch dim) symbolic, and its capture serves every later size its size guards accept
(``zgraph.binding.dynamic``, ``zgraph.capture.size_guards``). ``zgraph.mark_dynamic`` makes a dim symbolic from the
first call, with a range refused before anything changes. Every step equals eager PyTorch (bitwise on one process
with the eager backend, DDP's semantics within fp32 rounding on two ranks) at stages 0-3, and in split mode. Ranks
whose batches have sizes of their own (each padded to its own longest row) run one graph, those sizes symbolic on
every rank (issue 41, item 5).
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from dynamic_cases import CONFIG, SIZES, adamw, batch, batches, eager, eager_ranks, model, train_step, zgraph_run
from parity import train_step as classification_step

import zgraph
from zgraph.demos.models import lm_loss


def _equal(got: dict, want: dict) -> None:
    for a, b in zip(got["losses"], want["losses"], strict=True):
        assert torch.equal(a, b), (a, b)
    for name, value in want["params"].items():
        assert torch.equal(got["params"][name], value), name


def test_changing_sizes_are_captured_twice_and_equal_eager():
    """The sequence changes first (its dim and the batch dim become symbolic), then the batch: no third capture.
    A batch of one row after that is a third capture (torch specializes sizes 0 and 1), which serves every later
    size 1; other sizes still run on the symbolic one."""
    sizes = [(4, 12), (4, 20), (4, 33), (6, 9), (2, 40), (1, 15), (1, 9), (3, 15)]
    got = zgraph_run(zgraph.Config(backend="eager"), sizes=sizes)
    _equal(got, eager(sizes=sizes))
    assert got["variants"] == [1, 2, 2, 2, 2, 3, 3, 3]


def test_sizes_equal_at_the_second_capture_keep_symbols_of_their_own():
    """The call that makes the sizes symbolic has as many rows as positions (6 x 6): each dim still gets a symbol of
    its own (not torch's duck sizing, which would tie them and capture again at the next unequal pair)."""
    sizes = [(4, 12), (6, 6), (4, 20), (6, 9), (8, 8)]
    got = zgraph_run(zgraph.Config(backend="eager"), sizes=sizes)
    _equal(got, eager(sizes=sizes))
    assert got["variants"] == [1, 2, 2, 2, 2]


def test_an_optimizer_traced_as_written_is_captured_twice():
    """RMSprop's first step creates its state in the graph: the second call's key differs in the state as well as
    in the sizes, and still makes the sizes symbolic (a third capture would otherwise follow)."""
    sizes = SIZES[:3]
    m, ref = model(), model()
    opt, ref_opt = torch.optim.RMSprop(m.parameters(), lr=1e-2), torch.optim.RMSprop(ref.parameters(), lr=1e-2)
    step = zgraph.distribute(zgraph.Config(backend="eager"))(train_step)
    for idx, targets in batches(sizes):
        assert torch.equal(step(m, opt, idx, targets), train_step(ref, ref_opt, idx, targets))
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
    assert step._dispatch.variants() == 2


def test_stage_3_on_one_process():
    config = zgraph.Config(stage=3, backend="eager", param_persistence_threshold=0)
    got = zgraph_run(config, sizes=SIZES[:3])
    _equal(got, eager(sizes=SIZES[:3]))
    assert got["variants"] == [1, 2, 2]


@pytest.mark.inductor
@pytest.mark.parametrize("stage", [0, 3])
def test_inductor_compiles_the_symbolic_capture_once_and_equals_eager(stage):
    """Inductor compiles each capture once, the second with symbolic sizes (no fallback to the eager backend), and
    it serves every later size within fp32 rounding of eager. AdamW's ``eps`` is 1e-3 here: the key bias's gradient
    is zero in exact arithmetic, so in any two computations it is rounding noise, which a tiny ``eps`` turns into
    updates of size ``lr``."""
    config = zgraph.Config(stage=stage, backend="inductor", param_persistence_threshold=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = zgraph_run(config, eps=1e-3)
    want = eager(eps=1e-3)
    assert not [str(w.message) for w in caught if "inductor" in str(w.message)]
    assert got["variants"] == [1, 2, 2, 2, 2]
    for a, b in zip(got["losses"], want["losses"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_config_dynamic_true_captures_once_and_false_captures_every_size():
    """``Config(dynamic=True)``, as ``torch.compile(dynamic=True)``: every dim of every argument symbolic from the
    first call, one capture for every size (sizes 1 aside), equal to eager bitwise; the feature dim the model
    needs as a number (``nn.Linear``'s input in a classifier step) is fixed without a warning. ``dynamic=False``:
    a capture per new size, no automatic symbols."""
    sizes = [(4, 12), (6, 20), (8, 7), (4, 33)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about fixed sizes
        got = zgraph_run(zgraph.Config(backend="eager", dynamic=True), sizes=sizes)
    _equal(got, eager(sizes=sizes))
    assert got["variants"] == [1, 1, 1, 1]
    got = zgraph_run(zgraph.Config(backend="eager", dynamic=False), sizes=sizes[:3])
    _equal(got, eager(sizes=sizes[:3]))
    assert got["variants"] == [1, 2, 3]
    net = torch.nn.Linear(8, 3)
    step = zgraph.distribute(zgraph.Config(backend="eager", dynamic=True))(classification_step)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rows in (5, 7):
            step(net, opt, torch.randn(rows, 8), torch.randint(0, 3, (rows,)))
    assert step._dispatch.variants() == 1
    with pytest.raises(ValueError, match=r"Config.dynamic must be True, False or None; got 'yes'"):
        zgraph.Config(dynamic="yes")


def test_mark_dynamic_captures_once_and_refuses_a_size_outside_its_range():
    m, opt = model(), None
    opt = adamw(m)
    step = zgraph.distribute(zgraph.Config(backend="eager"))(train_step)
    ref, ref_opt = model(), None
    ref_opt = adamw(ref)
    for i, (idx, targets) in enumerate(batches()):
        if i == 0:  # marked once: the step remembers the argument path's dims
            zgraph.mark_dynamic(idx, 0, min=2)
            zgraph.mark_dynamic(idx, 1, min=2, max=CONFIG.seq)
            zgraph.mark_dynamic(targets, 0)
            zgraph.mark_dynamic(targets, 1)
        assert torch.equal(step(m, opt, idx, targets), train_step(ref, ref_opt, idx, targets))
    assert step._dispatch.variants() == 1
    before = {k: v.clone() for k, v in m.state_dict().items()}
    state = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    idx, targets = batch(4, CONFIG.seq + 1, 99)
    with pytest.raises(zgraph.CaptureError, match=r"argument `idx`.*size 41 in dim 1.*\[2, 40\].*mark_dynamic"):
        step(m, opt, idx, targets)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert all(torch.equal(v, state[k]) for k, v in opt.state_dict()["state"][0].items())
    assert step._dispatch.variants() == 1


def test_torch_dynamo_mark_dynamic_is_honoured():
    m = model()
    step = zgraph.distribute(zgraph.Config(backend="eager"))(train_step)
    opt = adamw(m)
    for i, (idx, targets) in enumerate(batches(SIZES[:2])):
        if i == 0:
            for t in (idx, targets):
                t._dynamo_dynamic_indices = {0, 1}  # what torch._dynamo.mark_dynamic(t, [0, 1]) sets
        step(m, opt, idx, targets)
    assert step._dispatch.variants() == 1


def test_split_mode_with_symbolic_sizes():
    """The step returns logits (a tangent of symbolic shape); the loss, its backward and the update are eager."""
    m, ref = model(), model()
    opt, ref_opt = adamw(m), adamw(ref)
    forward = zgraph.distribute(zgraph.Config(backend="eager"))(lambda net, idx: net(idx))
    for idx, targets in batches():
        for net, fn, o in ((m, forward, opt), (ref, ref, ref_opt)):
            loss = lm_loss(fn(net, idx) if fn is forward else fn(idx), targets)
            loss.backward()
            o.step()
            o.zero_grad()
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert forward._dispatch.variants() == 2


def on_two_ranks(directory, names: list[str]) -> dict:
    """``dynamic_cases.run``'s results of ``names`` on 2 ranks (each checked to have no error)."""
    from dist_harness import run_ranks

    path = directory / "results.pt"
    run_ranks(2, "dynamic_cases.run", str(path), names, timeout=600)
    results = torch.load(path, weights_only=False)
    for name in names:
        assert "error" not in results[name], results[name].get("error")
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return on_two_ranks(tmp_path_factory.mktemp("dynamic"), ["stages", "ranks_differ"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stages_on_two_ranks_equal_ddp_at_every_size(two_ranks, stage):
    got, want = two_ranks["stages"][stage], eager(world=2)
    for a, b in zip(got["losses"], want["losses"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert got["variants"][-1] == 2


@pytest.mark.inductor
def test_inductor_at_stage_3_on_two_ranks_equals_ddp_at_every_size(tmp_path):
    got, want = on_two_ranks(tmp_path, ["inductor_stage_3"])["inductor_stage_3"], eager(world=2, eps=1e-3)
    assert not got["fallbacks"] and got["variants"] == [1, 2, 2, 2, 2]
    for a, b in zip(got["losses"], want["losses"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-6, msg=name)
    # the ranks compile each graph in turn (zgraph.runtime.compile_turns): one of them compiles it, the other loads
    # it from inductor's cache (with the cache warm, both load it)
    compiles = [c["fxgraph_cache_miss"] + c["fxgraph_cache_hit"] for c in got["cache"]]
    assert compiles == [2, 2] and sum(c["fxgraph_cache_miss"] for c in got["cache"]) <= 2, got["cache"]


@pytest.mark.parametrize("stage", [0, 3])
def test_ranks_with_sizes_of_their_own_equal_ddp(two_ranks, stage):
    """Each rank's batch of its own sizes (as DDP ranks whose collators pad to their own longest row): one graph
    with the sizes that differ between ranks symbolic serves every rank; each rank captures at most twice."""
    got, want = two_ranks["ranks_differ"][stage], eager_ranks()
    for a, b in zip(got["losses"], want["losses"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert got["variants"][0] == [1, 1] and got["variants"][-1] == [2, 2], got["variants"]


def test_a_size_the_step_fixes_warns_and_is_captured_again():
    m, ref = model(), model()
    opt, ref_opt = adamw(m), adamw(ref)

    def fixed_step(net, o, idx, targets):
        if idx.shape[1] == 12:  # a Python branch on a size: the graph holds for 12 alone
            idx = idx.flip(1)
        return train_step(net, o, idx, targets)

    step = zgraph.distribute(zgraph.Config(backend="eager"))(fixed_step)
    for i, (idx, targets) in enumerate(batches(SIZES[:2])):
        if i == 0:
            zgraph.mark_dynamic(idx, 1)
        if i == 0:
            with pytest.warns(RuntimeWarning, match=r"fixed dim 1 of `idx` to 12"):
                got = step(m, opt, idx, targets)
        else:
            got = step(m, opt, idx, targets)
        assert torch.equal(got, fixed_step(ref, ref_opt, idx, targets))
    assert step._dispatch.variants() == 2


def test_ranks_of_one_host_compile_a_graph_in_turn(monkeypatch):
    """``compile_turn`` on a shared store: the first rank to reach a graph compiles it while the others wait; once it
    is done they compile (from inductor's cache); a rank that hears nothing within the timeout compiles anyway."""
    import threading

    import torch.distributed as dist

    from zgraph.runtime import compile_turns

    store = dist.HashStore()
    monkeypatch.setattr(compile_turns, "_store", lambda: store)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    order: list[str] = []
    first_in, release = threading.Event(), threading.Event()

    def first() -> None:
        with compile_turns.compile_turn(gm, timeout=30):
            first_in.set()
            release.wait(10)
            order.append("first compiled")

    def second() -> None:
        first_in.wait(10)
        with compile_turns.compile_turn(gm, timeout=30):
            order.append("second compiled")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    threading.Timer(0.3, release.set).start()
    for t in threads:
        t.join(20)
    assert order == ["first compiled", "second compiled"]
    other = torch.fx.symbolic_trace(torch.nn.ReLU())  # another graph: claimed by a rank that never finishes
    key = compile_turns.graph_key(other)
    assert key != compile_turns.graph_key(gm)
    store.add(_claim(key), 1)
    start = time.perf_counter()
    with compile_turns.compile_turn(other, timeout=0.2):  # waits out the timeout, then compiles: no hang
        assert time.perf_counter() - start >= 0.2


def _claim(key: str) -> str:
    """The store key ``compile_turn`` claims a graph of digest ``key`` with on this host."""
    import socket

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return f"{socket.gethostname()}:{cache_dir()}:{key}/claim"
