"""Runtime choices that save host memory and its traffic: in-place all-reduce of temporaries, copies into buffers of
their own size, keeping freed memory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from zgraph.inspect.liveness import liveness
from zgraph.runtime.host_memory import GLIBC_TUNABLES
from zgraph.runtime.memory import LiveTensorBytes
from zgraph.runtime.reinplace import fresh_copies, reinplace_all_reduces, reinplace_temporaries

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def _graph(pack: bool, extra_reader: bool) -> fx.GraphModule:
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    for node, shape in ((a, (4, 2)), (b, (3,))):
        node.meta["val"] = torch.empty(shape)
    if pack:
        packed = graph.call_function(aten._chunk_cat.default, ([a, b], 0, 1))
        packed.meta["val"] = torch.empty(1, 11)
        x = graph.call_function(aten.view.default, (packed, [-1]))
        x.meta["val"] = torch.empty(11)
    else:
        x = a
    reduced = graph.call_function(c10d.all_reduce.default, (x, "avg", "0"))
    done = graph.call_function(c10d.wait_tensor.default, (reduced,))
    graph.output((done, x) if extra_reader else (done,))
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize(
    ("pack", "extra_reader", "in_place"),
    [(True, False, True), (True, True, False), (False, False, False)],
    ids=["packed_bucket", "input_read_again", "graph_input"],
)
def test_all_reduce_of_a_temporary_runs_in_place(pack, extra_reader, in_place):
    """A bucket packed by ``_chunk_cat`` is reduced in place (no copy); an input something else reads, or a
    graph input, keeps the copying functional form."""
    gm = _graph(pack, extra_reader)
    assert reinplace_all_reduces(gm) == int(in_place)
    targets = {n.target for n in gm.graph.nodes}
    assert (c10d.all_reduce_.default in targets) == in_place
    assert (c10d.all_reduce.default in targets) != in_place


def test_all_reduce_of_an_unsafe_view_of_a_value_read_again_copies():
    """``aten._unsafe_view`` (what ``reshape`` of a fresh ``mm`` result traces to) shares its input's memory
    though its schema declares no alias: reducing it in place would change the ``mm`` result another node reads."""
    graph = fx.Graph()
    a = graph.placeholder("a")
    a.meta["val"] = torch.empty(4, 4)
    product = graph.call_function(aten.mm.default, (a, a))
    product.meta["val"] = torch.empty(4, 4)
    flat = graph.call_function(aten._unsafe_view.default, (product, [16]))
    flat.meta["val"] = torch.empty(16)
    reduced = graph.call_function(c10d.all_reduce.default, (flat, "avg", "0"))
    done = graph.call_function(c10d.wait_tensor.default, (reduced,))
    graph.output((done, product))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert reinplace_all_reduces(gm) == 0


def test_a_copy_into_a_shard_allocates_the_shard_not_the_whole_parameter():
    """``copy(slice(param), new)`` (the optimizer's write-back of a ZeRO shard) runs as ``copy_`` into a buffer of
    the shard's size: the aten kernel would clone the whole parameter. Same values, and the bytes liveness
    predicts from the fake values are the bytes the run allocates."""
    mode = FakeTensorMode()
    graph = fx.Graph()
    param, new = graph.placeholder("param"), graph.placeholder("new")
    shard = graph.call_function(aten.slice.Tensor, (param, 0, 0, 64))
    copied = graph.call_function(aten.copy.default, (shard, new))
    graph.output((copied,))
    with mode:
        param.meta["val"] = torch.empty(256, 16, dtype=torch.bfloat16)
        new.meta["val"] = torch.empty(64, 16)
        shard.meta["val"] = param.meta["val"][:64]
        copied.meta["val"] = aten.copy.default(shard.meta["val"], new.meta["val"])
    gm = fx.GraphModule(torch.nn.Module(), graph)
    inputs = (torch.randn(256, 16).bfloat16(), torch.randn(64, 16))
    assert fresh_copies(gm) == 1 and aten.copy.default not in {n.target for n in gm.graph.nodes}
    tracker = LiveTensorBytes()
    for t in inputs:
        tracker.track(t)
    with tracker:
        (out,) = gm(*inputs)
    assert torch.equal(out, inputs[1].bfloat16()) and out.untyped_storage().nbytes() == 64 * 16 * 2
    assert liveness(gm).peak_bytes == tracker.peak == (256 * 16 + 64 * 16) * 2 + 64 * 16 * 4


@pytest.mark.parametrize("read_again", [False, True], ids=["temporary", "read_again"])
def test_pointwise_op_on_a_temporary_runs_in_place_with_the_same_numbers(read_again):
    """``sqrt(v) / c + eps`` (AdamW's denominator): the ``div`` and the ``add`` write into the ``sqrt``'s result
    when nothing else reads it, bitwise as the functional graph; a temporary read again is not written into
    (the ``div`` stays functional, the ``add`` still writes into the ``div``'s result)."""
    graph = fx.Graph()
    v, c = graph.placeholder("v"), graph.placeholder("c")
    v.meta["val"], c.meta["val"] = torch.empty(5, 3), torch.empty(())
    root = graph.call_function(aten.sqrt.default, (v,))
    scaled = graph.call_function(aten.div.Tensor, (root, c))
    out = graph.call_function(aten.add.Tensor, (scaled, 1e-8))
    for node in (root, scaled, out):
        node.meta["val"] = torch.empty(5, 3)
    graph.output((out, root) if read_again else (out,))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    inputs = (torch.rand(5, 3), torch.tensor(0.37))
    before = inputs[0].clone()
    want = gm(*inputs)
    assert reinplace_temporaries(gm) == (1 if read_again else 2)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    div = aten.div.Tensor if read_again else aten.div_.Tensor
    assert targets == [aten.sqrt.default, div, aten.add_.Tensor]
    got = gm(*inputs)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(inputs[0], before)  # a graph input is never written into


_FAULTS_PER_ROUND = """
import resource, sys, torch
from zgraph.runtime.host_memory import keep_freed_host_memory

def faults_per_round():
    # 64 MiB, freed at once. Warm up: from the heap, the second block may not fit in the first one freed (an
    # aligned request is a little larger than the block it frees), so steady state takes a few rounds (up to
    # six seen here).
    for _ in range(8):
        torch.ones(16 * 2**20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.ones(16 * 2**20)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5

default = faults_per_round()
if sys.argv[1] == "mallopt":
    assert keep_freed_host_memory()
print(default, faults_per_round())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("how", ["mallopt", "tunables"])
def test_keeping_freed_host_memory_stops_page_faults(how):
    """Freeing and allocating the same 64 MiB again faults every page back in under glibc's defaults, and not
    once the thresholds are fixed and the heap has grown to the step's size: set by
    ``keep_freed_host_memory()`` (what ``Config(keep_host_memory=True)`` calls), or by ``GLIBC_TUNABLES`` for a
    whole program. In a fresh process: the setting is process-wide."""
    env = dict(os.environ)
    if how == "tunables":
        env["GLIBC_TUNABLES"] = GLIBC_TUNABLES
    run = subprocess.run([sys.executable, "-c", _FAULTS_PER_ROUND, how], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    default, kept = map(float, run.stdout.split())
    if how == "mallopt":
        assert default > 10_000, f"64 MiB allocations should fault their pages in by default ({default})"
    assert kept < 100, f"with freed memory kept, allocating again should not fault ({kept} faults)"


def test_an_input_the_caller_lets_go_is_freed_after_its_last_use():
    """``run_consuming`` (a pipeline stage's graph on the eager backend) empties its input list as it reads it:
    an input held nowhere else (a micro-batch's saved activations) is freed after the node that reads it last,
    and ``liveness(consumed=...)`` predicts the bytes the run holds; the values are those of a plain call."""
    from zgraph.runtime.executor import run_consuming

    graph = fx.Graph()
    saved, weight = graph.placeholder("saved"), graph.placeholder("weight")
    scaled = graph.call_function(aten.mul.Tensor, (saved, 2.0))
    summed = graph.call_function(aten.sum.dim_IntList, (scaled, [0]))
    out = graph.call_function(aten.mul.Tensor, (summed, weight))
    wide = graph.call_function(aten.expand.default, (out, [64, 256]))
    big = graph.call_function(aten.mul.Tensor, (wide, 3.0))
    graph.output((big,))
    for node, shape in ((saved, (64, 256)), (weight, (256,)), (scaled, (64, 256)), (summed, (256,))):
        node.meta["val"] = torch.empty(shape)
    out.meta["val"], wide.meta["val"], big.meta["val"] = (
        torch.empty(256),
        torch.empty(256).expand(64, 256),
        torch.empty(64, 256),
    )
    gm = fx.GraphModule(torch.nn.Module(), graph)
    peaks = []
    for consume in (False, True):
        inputs = [torch.randn(64, 256, generator=torch.Generator().manual_seed(0)), torch.ones(256)]
        tracker = LiveTensorBytes()
        for t in inputs:
            tracker.track(t)
        with tracker:
            (got,) = run_consuming(gm)(inputs) if consume else gm(*inputs)
        assert inputs == [] if consume else len(inputs) == 2
        peaks.append(tracker.peak)
        want = (torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 2.0).sum(0) * 3.0
        assert torch.equal(got, want.expand(64, 256))
    assert peaks == [liveness(gm).peak_bytes, liveness(gm, consumed=[saved]).peak_bytes]
    assert peaks[1] < peaks[0], "the saved input is gone before the last product is made"
