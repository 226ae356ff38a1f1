"""Pipeline parallelism over ``P x D`` ranks (two pipelines of two stages; ZeRO stage 0, and 1 to 3 within each
stage's data-parallel group) against eager PyTorch on the global batch, and the gradient reductions (stage 3: and
parameter gathers) each step issues (one per stage, whatever the micro-batch count): the worker of
``test_pipeline_data.py``."""

from __future__ import annotations

import contextlib
import copy
import gc
import re
import tempfile
from collections.abc import Iterator

import sequence_cases as sc
import torch
import torch.distributed as dist
from dist_harness import all_gather_values, run_named
from pipeline_cases import CLIP, LR, SGD, Net, _by_name, _distance, _params, batches, clipping_step, step
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import zgraph
from zgraph.runtime.memory import LiveTensorBytes, state_bytes
from zgraph.runtime.pipeline_run import RankRunner

P = 2
SGD_LR = 0.1


def train(
    rank: int,
    world: int,
    microbatches: int,
    steps: int,
    stage: int = 0,
    shard_group_size: int | None = None,
    **options: object,
) -> dict:
    """``steps`` steps of eager on the whole batch and of the pipelined step (ZeRO ``stage``, hybrid sharding's
    ``shard_group_size``, other Config ``options``) on this rank's pipeline's rows; the sizes of the all-reduces the
    last step issued, the reduce-scatters its update graphs run (stage 3 or hybrid: the functional collectives the
    last step ran)."""
    eager_model, tracker = Net(), LiveTensorBytes() if stage == 3 else contextlib.nullcontext()
    with tracker:  # stage 3: what the pipelined model's state and steps leave alive
        model = copy.deepcopy(eager_model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=LR)
    config = zgraph.Config(
        backend="eager",
        pipeline_parallel=P,
        microbatches=microbatches,
        stage=stage,
        param_persistence_threshold=0,  # stage 3: every parameter of the tiny model sharded
        shard_group_size=shard_group_size,
        **{"schedule": "1f1b", **options},
    )
    compiled = zgraph.distribute(config)(step)
    want, got, sizes, comm = [], [], [], FunctionalCollectives()
    for i, batch in enumerate(batches()[:steps]):
        want.append(step(eager_model, eager_opt, *batch))
        last = i == steps - 1
        counts = last and (stage == 3 or shard_group_size is not None)
        with tracker, counted(sizes if last else []), comm if counts else contextlib.nullcontext():
            loss = compiled(model, opt, *zgraph.pipeline_batch(batch, P))
        got.append(loss.clone())  # not counted as the pipelined model's
        del loss
    gc.collect()
    owned = [role.name for name, gm in compiled.graphs.items() if name.endswith(".update") for role in _params(gm)]
    eager = dict(eager_model.named_parameters())
    whole_params = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
    distance = max((p - eager[n]).abs().max().item() for n, p in whole_params.items() if n in owned)
    full = zgraph.full_state_dict(model)
    whole = max((full[k] - v).abs().max().item() for k, v in eager_model.state_dict().items())
    numel = sum(eager[n].numel() for n in owned)
    lines = compiled.explain().splitlines()
    explained = next(line for line in lines if line.startswith("pipeline:"))
    sharding = [line.strip() for line in lines if line.startswith(("buckets of", "  ZeRO within", "  ZeRO 3:"))]
    updates = [gm for name, gm in compiled.graphs.items() if name.endswith(".update")]
    out = {"want": want, "got": got, "owned": owned, "distance": distance, "whole": whole, "sizes": sizes,
           "stage_numel": numel, "explained": explained, "sharding": sharding,
           "state": state_bytes(model, opt)["total"],
           "optimizer": state_bytes(model, opt)["optimizer"],
           "eager_optimizer": state_bytes(eager_model, eager_opt)["optimizer"],
           "reduce_scatters": [_reduce_scatters(gm) for gm in updates],
           "params": state_bytes(model)["params"], "eager_params": state_bytes(eager_model)["params"],
           "gathers": {n: _all_gathers(gm) for n, gm in compiled.graphs.items() if re.match(r"stage\d+\.", n)},
           "comm": comm.counts, "live": getattr(tracker, "current", 0)}  # fmt: skip
    if steps > 1 and stage != 2:  # stage 2 runs stage 1's graphs (a pipelined step leaves no gradient sharded)
        out["loaded"] = _saved_and_loaded(rank, model, opt, eager_model, eager_opt)
    if stage == 3:  # every parameter whole on every rank inside zgraph.gather
        with zgraph.gather(model):
            out["gathered"] = max((p - eager[n]).abs().max().item() for n, p in model.named_parameters())
    if steps > 1 and stage in (1, 3):  # the optimizer state sharded within each stage, gathered whole
        full_optim = zgraph.full_state_dict(model, opt)[1]
        out["whole_optim"] = _distance(_by_name(full_optim, model), _by_name(eager_opt.state_dict(), eager_model))
    return out


def _saved_and_loaded(rank: int, model: nn.Module, opt: torch.optim.Optimizer, eager: nn.Module, eager_opt) -> float:
    """``zgraph.save`` of the pipelined model (each tensor written by the rank of the first pipeline holding it),
    loaded into a fresh model and optimizer: their largest distance from eager's."""
    path = all_gather_values(tempfile.mkdtemp() if rank == 0 else None)[0]
    zgraph.save(f"{path}/ckpt", model, opt)
    fresh = Net()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
    zgraph.load(f"{path}/ckpt", fresh, fresh_opt)
    states = _by_name(fresh_opt.state_dict(), fresh), _by_name(eager_opt.state_dict(), eager)
    return max(_distance(fresh.state_dict(), eager.state_dict()), _distance(*states))


@contextlib.contextmanager
def counted(sizes: list[int], dtypes: list[str] | None = None) -> Iterator[None]:
    """The sizes (and dtypes) of the ``dist.all_reduce`` calls made inside, appended to ``sizes`` (``dtypes``)."""
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        sizes.append(tensor.numel())
        if dtypes is not None and tensor.numel() > 1:  # not a 0-d result's or count's
            dtypes.append(str(tensor.dtype))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield
    finally:
        dist.all_reduce = real


def _reduce_scatters(gm: torch.fx.GraphModule) -> int:
    """The reduce-scatters a lowered graph runs (on gloo each an ``all_to_all_single``: see
    ``zgraph.graph.reduce_scatter_by_all_to_all``)."""
    return len(_scatters(gm))


def _scatters(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    c10d = torch.ops._c10d_functional
    targets = (c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default)
    return [node for node in gm.graph.nodes if node.target in targets]


class FunctionalCollectives(TorchDispatchMode):
    """Counts the functional collectives (``torch.ops._c10d_functional``) of floating-point tensors run inside, by
    name (not the step's int64 check that every rank runs the same graph: ``zgraph.runtime.consistency``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name != "wait_tensor":
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            if first.is_floating_point():
                self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _all_gathers(gm: torch.fx.GraphModule) -> int:
    """The all-gathers a lowered graph runs (a bucket's is one coalesced all-gather)."""
    c10d = torch.ops._c10d_functional
    targets = (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_coalesced.default)
    return sum(node.target in targets for node in gm.graph.nodes)


def two_by_two(rank: int, world: int) -> list[dict]:
    return all_gather_values([train(rank, world, 2, steps=3), train(rank, world, 4, steps=1)])


def zero_within_stages(rank: int, world: int) -> list[dict]:
    """ZeRO 1 (2 and 4 micro-batches) and 2 within each stage's data-parallel group."""
    runs = [train(rank, world, 2, steps=3, stage=1), train(rank, world, 4, steps=1, stage=1)]
    return all_gather_values([*runs, train(rank, world, 2, steps=2, stage=2)])


def stage_three(rank: int, world: int) -> list[dict]:
    """ZeRO 3 within each stage's data-parallel group: 3 steps with 2 micro-batches, 2 with 4."""
    return all_gather_values([train(rank, world, 2, steps=3, stage=3), train(rank, world, 4, steps=2, stage=3)])


def stage_three_regathered(rank: int, world: int) -> list[dict]:
    """ZeRO 3 within each stage with ``Config.pipeline_regather``, interleaved (2 stages per rank, one block each),
    2 micro-batches, 2 steps: each stage's parameters gathered before each of its actions."""
    options = {"schedule": "interleaved_1f1b", "pipeline_virtual_stages": 2, "pipeline_regather": True}
    return all_gather_values(train(rank, world, 2, steps=2, stage=3, **options))


def hybrid_degenerate(rank: int, world: int) -> list[dict]:
    """Hybrid sharding within stages at its two ends (issue 42, item 2): ``shard_group_size=1`` at ZeRO 2 (shard
    groups of one rank, the state replicated across the data-parallel group), 3 steps, and ``shard_group_size=2``
    (the whole data-parallel group: plain ZeRO) at ZeRO 1, 2 steps."""
    runs = [train(rank, world, 2, steps=3, stage=2, shard_group_size=1)]
    return all_gather_values([*runs, train(rank, world, 2, steps=2, stage=1, shard_group_size=2)])


def zero_clipped(rank: int, world: int) -> list[dict]:
    """``Config.max_grad_norm`` at ZeRO 2 within each stage's data-parallel group (issue 42, item 2): the norm over
    every stage and every shard (each rank's shard's squares, over its data-parallel group, then the pipeline)
    against ``clip_grad_norm_`` on the whole batch, SGD; the reduce-scatters of its update graphs (the part
    before the total, and the update); the all-reduces of the last step: the graphs' (over the data-parallel
    group) and the sizes of those combining the totals (``RankRunner._stage_totals``, over the pipeline)."""
    eager_model = Net()
    model = copy.deepcopy(eager_model)
    eager_opt, opt = SGD(eager_model.parameters()), SGD(model.parameters())
    config = zgraph.Config(
        backend="eager", pipeline_parallel=P, schedule="1f1b", microbatches=2, stage=2, max_grad_norm=CLIP
    )
    compiled = zgraph.distribute(config)(step)
    norms: list[float] = []
    want, got = [], []
    sizes: list[int] = []
    for i, batch in enumerate(batches()):
        want.append(clipping_step(norms)(eager_model, eager_opt, *batch))
        with _totals_counted(sizes if i == len(batches()) - 1 else []):
            got.append(compiled(model, opt, *zgraph.pipeline_batch(batch, P)))
    full = zgraph.full_state_dict(model)
    whole = max((full[k] - v).abs().max().item() for k, v in eager_model.state_dict().items())
    graphs = [gm for n, gm in compiled.graphs.items() if n.endswith((".totals", ".update"))]
    scatters = sum(_reduce_scatters(gm) for gm in graphs)
    reduces = sum(n.target is torch.ops._c10d_functional.all_reduce_.default for gm in graphs for n in gm.graph.nodes)
    out = {"want": want, "got": got, "whole": whole, "norms": norms, "reduce_scatters": scatters}
    return all_gather_values({**out, "graph_all_reduces": reduces, "totals_all_reduced": sizes})


def step_results(rank: int, world: int) -> list[dict]:
    """A step that clips with ``clip_grad_norm_`` itself and returns the loss, the norm and a value of the
    parameters alone (as ``ZGraphTrainer``'s step returns its grad norm), P=2 x D=2 at ZeRO 1, against eager on the
    whole batch: each result as eager's (the norm made once, from the gradients over every stage and pipeline)."""

    def clipping(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> tuple:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        return loss.detach(), norm, model.head.weight.detach().pow(2).sum()

    eager_model = Net()
    model = copy.deepcopy(eager_model)
    eager_opt, opt = SGD(eager_model.parameters()), SGD(model.parameters())
    config = zgraph.Config(backend="eager", pipeline_parallel=P, schedule="1f1b", microbatches=2, stage=1)
    compiled = zgraph.distribute(config)(clipping)
    want, got = [], []
    for batch in batches():
        want.append(torch.stack(clipping(eager_model, eager_opt, *batch)))
        got.append(torch.stack(compiled(model, opt, *zgraph.pipeline_batch(batch, P))))
    return all_gather_values({"want": want, "got": got})


@contextlib.contextmanager
def _totals_counted(sizes: list[int]) -> Iterator[None]:
    """The sizes of the all-reduces ``RankRunner._stage_totals`` makes inside, appended to ``sizes``."""
    real = RankRunner._stage_totals

    def counting(self: RankRunner) -> dict[str, torch.Tensor]:
        with counted(sizes):
            return real(self)

    RankRunner._stage_totals = counting
    try:
        yield
    finally:
        RankRunner._stage_totals = real


def reduced_in_bf16(rank: int, world: int) -> list[dict]:
    """``Config.reduce_dtype=torch.bfloat16`` with P=2 x D=2 (issue 42, item 2), at ZeRO 0 (the runtime's
    all-reduce of each stage's gradient sums) and 2 (the update graph's reduce-scatter): the dtypes the gradients
    cross in, and the whole model's distance from eager's after 2 steps (within bf16's rounding of the gradients)."""
    runs = []
    for stage in (0, 2):
        eager_model = Net()
        model = copy.deepcopy(eager_model)
        eager_opt, opt = SGD(eager_model.parameters()), SGD(model.parameters())
        options = {"schedule": "1f1b", "microbatches": 2, "stage": stage, "reduce_dtype": torch.bfloat16}
        compiled = zgraph.distribute(zgraph.Config(backend="eager", pipeline_parallel=P, **options))(step)
        dtypes: list[str] = []
        for batch in batches()[:2]:
            step(eager_model, eager_opt, *batch)
            with counted([], dtypes):
                compiled(model, opt, *zgraph.pipeline_batch(batch, P))
        full = zgraph.full_state_dict(model)
        whole = max((full[k] - v).abs().max().item() for k, v in eager_model.state_dict().items())
        updates = [gm for name, gm in compiled.graphs.items() if name.endswith(".update")]
        scattered = sorted({str(n.meta["val"].dtype) for gm in updates for n in _scatters(gm)})
        runs.append({"whole": whole, "all_reduced": sorted(set(dtypes)), "scattered": scattered})
    return all_gather_values(runs)


def pipeline_by_sequence(rank: int, world: int) -> list[dict]:
    """P=2 x SP=2: sequence_cases' GPT (attention in each of its 2 blocks), 3 SGD steps on each rank's slice of the
    global batch's sequences (``zgraph.pipeline_batch(..., sequence_parallel=2)``), 2 micro-batches, ZeRO 0, 1
    and 3 (and at 3 with hybrid sharding's shard groups of one rank), and at ZeRO 0 with labels shifted over the
    whole sequence, its last position ignored (``-100``: the slices count different numbers of labels), against
    eager on the whole batch: the losses, the largest distance of the parameters (``zgraph.full_state_dict``) from
    eager's, the parameters each rank's update graphs hold, the sequence all-to-alls in its stage graphs, and (stage
    3) the all-gathers in each stage graph, the functional collectives the last step ran and the parameter bytes
    each rank holds. SGD: linear in the gradients, so the
    float noise in the key bias's gradient (zero in exact arithmetic: softmax ignores a shift of every key) stays
    small; Adam would scale it up."""
    runs = [(0, "gpt", None), (1, "gpt", None), (0, "llama", None), (3, "gpt", None), (3, "gpt", 1)]
    return all_gather_values([_by_sequence(*run) for run in runs])  # "llama": labels shifted (sequence_cases)


def _by_sequence(stage: int, labels: str, shard_group_size: int | None) -> dict:
    eager, model = sc.build("gpt")[0], sc.build("gpt")[0]
    eager_opt = torch.optim.SGD(eager.parameters(), lr=SGD_LR)
    want = [float(sc.train_step(eager, eager_opt, *b)) for b in sc.batches(labels)]
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    config = zgraph.Config(
        backend="eager", pipeline_parallel=P, sequence_parallel=2, microbatches=2, stage=stage,
        param_persistence_threshold=0,  # stage 3: every parameter of the tiny model sharded
        shard_group_size=shard_group_size,
    )  # fmt: skip
    compiled = zgraph.distribute(config)(sc.train_step)
    got, comm, steps = [], FunctionalCollectives(), sc.batches(labels)
    for i, b in enumerate(steps):
        with comm if i == len(steps) - 1 else contextlib.nullcontext():  # the last step's
            got.append(float(compiled(model, opt, *zgraph.pipeline_batch(b, P, sequence_parallel=2))))
    owned = [role.name for name, gm in compiled.graphs.items() if name.endswith(".update") for role in _params(gm)]
    sequence_ops = (torch.ops.zgraph.seq_to_heads.default, torch.ops.zgraph.heads_to_seq.default)
    exchanges = {name: sum(n.target in sequence_ops for n in gm.graph.nodes) for name, gm in compiled.graphs.items()}
    full = zgraph.full_state_dict(model)
    distance = max((full[k] - v).abs().max().item() for k, v in eager.state_dict().items())
    lines = compiled.explain().splitlines()
    explained = next(line for line in lines if line.startswith("pipeline:"))
    sharding = "\n".join(line for line in lines if line.startswith("  ZeRO within"))
    gathers = {n: _all_gathers(gm) for n, gm in compiled.graphs.items() if re.match(r"stage\d+\.", n)}
    return {"got": got, "want": want, "distance": distance, "owned": owned, "exchanges": exchanges,
            "explained": explained, "sharding": sharding, "gathers": gathers, "comm": comm.counts,
            "params": state_bytes(model)["params"], "eager_params": state_bytes(eager)["params"]}  # fmt: skip


def pipeline_by_sequence_refused(rank: int, world: int) -> list[str]:
    """``Config(pipeline_parallel=2, sequence_parallel=4)`` on 4 ranks (each divides the world, their product does
    not): the message of the ``ValueError`` it raises on each rank."""
    try:
        zgraph.Config(pipeline_parallel=P, sequence_parallel=4)
        message = "not refused"
    except ValueError as error:
        message = str(error)
    return all_gather_values(message)


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    run_named(rank, world, out_path, names, globals())
