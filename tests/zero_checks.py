"""Multi-rank checks other than parity, run inside spawned ranks (see test_zero_parity.py): collective counts,
memory held per rank, errors that must not hang, ``zgraph.gather``."""

from __future__ import annotations

import copy
import gc
import operator

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from dist_harness import all_gather_values, run_named
from moved_cases import moved_between_steps  # noqa: F401  (run by name: run_checks)
from parity import train_step
from torch import nn

import zgraph
from zgraph.graph import collective_kind
from zgraph.runtime.memory import LiveTensorBytes, state_bytes
from zgraph.runtime.process_group import device_mesh
from zgraph.runtime.sharded_state import ShardSpec


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


_step = train_step


def collective_counts(rank: int, world: int) -> dict:
    """Per stage: ``{(kind, phase): count}`` of collectives in the final graph of the MLP step."""
    out = {}
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    for stage in range(4):
        model = _mlp()
        config = zgraph.Config(
            stage=stage,
            backend="eager",
            param_persistence_threshold=0,
            allgather_bucket_bytes=0,
            reduce_bucket_bytes=0,
        )
        step = zgraph.distribute(config)(_step)
        step(model, torch.optim.AdamW(model.parameters()), x, y)
        counts: dict = {}
        for node in step.graphs["final"].graph.nodes:
            kind = collective_kind(node)
            if kind is not None:
                key = (kind, node.meta["phase"])
                counts[key] = counts.get(key, 0) + 1
        out[stage] = counts
    return out


def _big_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 60))  # 60: not divisible by 4 or 8


def _step_keeping_grads(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss


def memory(rank: int, world: int) -> dict:
    """Per stage: bytes of params / grads / optimizer state this rank holds after two steps that leave
    ``.grad`` populated, counted from the live state and, independently, by a dispatch-mode tracker that saw
    every allocation since the model was built."""
    out = {}
    x = torch.randn(8, 64)
    mesh = device_mesh("cpu", world)  # made once per process (held here); not model state
    for stage in range(4):
        gc.collect()
        tracker = LiveTensorBytes()
        with tracker:
            model = _big_mlp()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            step = zgraph.distribute(stage=stage, backend="eager", param_persistence_threshold=0)(_step_keeping_grads)
            for _ in range(2):
                del_me = step(model, opt, x)
            del del_me
            gc.collect()
        out[stage] = {"state": state_bytes(model, opt), "tracked": tracker.current}
        del model, opt, step
    del mesh  # held until every stage is measured
    return out


def expected_state_bytes(world: int) -> dict:
    """What each rank should hold of ``_big_mlp``'s state, per stage (4-byte floats, padded shards)."""
    shapes = [tuple(p.shape) for p in _big_mlp().parameters()]

    def full(shape):
        n = 1
        for s in shape:
            n *= s
        return 4 * n

    def shard(shape):
        spec = ShardSpec(shape, world)
        return full(spec.shard_shape)

    steps = 4 * len(shapes)  # Adam's 0-d float32 step per parameter
    table = {}
    for stage in range(4):
        params = sum(shard(s) if stage >= 3 else full(s) for s in shapes)
        grads = sum(shard(s) if stage >= 2 else full(s) for s in shapes)
        optimizer = sum(2 * (shard(s) if stage >= 1 else full(s)) for s in shapes) + steps
        table[stage] = {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}
    return table


def errors(rank: int, world: int) -> dict:
    """Errors that must be raised on every rank, not hang."""
    out = {}
    # ranks calling the step with batch shapes that one graph cannot serve: sizes that differ between ranks are
    # symbolic, but a size 1 is specialized
    model = _mlp()
    step = zgraph.distribute(stage=3, backend="eager", param_persistence_threshold=0)(_step)
    opt = torch.optim.AdamW(model.parameters())
    batch = 4 if rank == 0 else 1
    try:
        step(model, opt, torch.randn(batch, 8), torch.randint(0, 4, (batch,)))
        out["shapes"] = None
    except zgraph.RankMismatchError as e:
        out["shapes"] = str(e)
    # one rank whose step branches on data: its capture fails, the others are told
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())

    def branchy(model, opt, x, y, fail):
        loss = F.cross_entropy(model(x), y)
        if fail and loss.item() > 0:
            loss = loss * 2
        loss.backward()
        opt.step()
        return loss

    try:
        zgraph.distribute(stage=2, backend="eager", param_persistence_threshold=0)(branchy)(
            model, opt, torch.randn(4, 8), torch.randint(0, 4, (4,)), rank == 1
        )
        out["capture"] = None
    except zgraph.ZGraphError as e:
        out["capture"] = f"{type(e).__name__}: {e}"
    # a stage-3 model used outside the step, then inside zgraph.gather
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zgraph.distribute(stage=3, backend="eager", param_persistence_threshold=0)(_step)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    step(model, opt, x, y)
    try:
        model(x)
        out["outside"] = None
    except zgraph.ShardedParameterError as e:
        out["outside"] = str(e)
    with zgraph.gather(model):
        out["inside_shape"] = tuple(model[0].weight.shape)
        out["inside_output"] = model(x).detach()
    dist.barrier()
    return out


def gather_roundtrip(rank: int, world: int) -> dict:
    """``zgraph.gather``: whole params and grads inside; edits written back to the shards; untouched
    state left exactly as it was."""
    out = {}
    for stage in (2, 3):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(model, opt, x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss  # leaves .grad

        compiled = zgraph.distribute(stage=stage, backend="eager", param_persistence_threshold=0)(step)
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        compiled(model, opt, x, y)

        def snapshot(model: nn.Module = model) -> dict:  # full_state_dict shares memory where state_dict does
            return {k: v.clone() for k, v in zgraph.full_state_dict(model).items()}

        before = snapshot()
        with zgraph.gather(model):
            grad = model[0].weight.grad.detach().clone()
            whole = {n: p.detach().clone() for n, p in model.named_parameters()}
        untouched = snapshot()
        with zgraph.gather(model), torch.no_grad():
            model[2].bias.add_(1.0)
            model[0].weight.grad.zero_()
        after = snapshot()
        with zgraph.gather(model):
            grad_after = model[0].weight.grad.detach().clone()
        out[stage] = {
            "before": before,
            "whole": whole,
            "untouched": untouched,
            "after": after,
            "grad": grad,
            "grad_after": grad_after,
        }
    return out


def run_checks(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: run the named checks; rank 0 saves ``{name: result}``."""
    try:
        run_named(rank, world, out_path, names, globals())
    finally:
        _GPT_GRAPHS.clear()


def _gpt_step(model, opt, idx, tgt):
    from zgraph.demos.models import lm_loss

    loss = lm_loss(model(idx), tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _small_gpt():
    from zgraph.demos.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=128, d_model=64, layers=2, heads=2, seq=32))


def _gpt_batch(rank: int) -> tuple:
    g = torch.Generator().manual_seed(rank)
    return torch.randint(0, 128, (4, 32), generator=g), torch.randint(0, 128, (4, 32), generator=g)


_GPT_GRAPHS: dict[int, fx.GraphModule] = {}  # stage -> final graph, for the checks of one ``run_checks``


def _gpt_final_graph(rank: int, stage: int) -> fx.GraphModule:
    """The final graph of the small GPT's step at ``stage`` (every parameter sharded, buckets and prefetch as by
    default) after one call, compiled once for every check of a ``run_checks`` that reads it."""
    if stage not in _GPT_GRAPHS:
        model = _small_gpt()
        step = zgraph.distribute(stage=stage, backend="eager", param_persistence_threshold=0)(_gpt_step)
        step(model, torch.optim.AdamW(model.parameters()), *_gpt_batch(rank))
        _GPT_GRAPHS[stage] = step.graphs["final"]
    return _GPT_GRAPHS[stage]


def collective_sequences(rank: int, world: int) -> dict:
    """Every rank's final graph issues the same collectives in the same order (bucketed, scheduled)."""
    from zgraph.runtime.consistency import describe_collectives

    out = {}
    for stage in range(4):
        out[stage] = all_gather_values(describe_collectives(_gpt_final_graph(rank, stage)))
    return out


def differing_plans(rank: int, world: int) -> str | None:
    """Ranks configured with different bucket sizes plan different collectives: an error, not a hang."""
    model = _small_gpt()
    config = zgraph.Config(
        stage=3, backend="eager", param_persistence_threshold=0, allgather_bucket_bytes=1 << (14 + rank)
    )
    step = zgraph.distribute(config)(_gpt_step)
    try:
        step(model, torch.optim.AdamW(model.parameters()), *_gpt_batch(rank))
    except zgraph.RankMismatchError as e:
        return str(e)
    return None


def prefetch_memory(rank: int, world: int) -> dict:
    """Peak live tensor bytes of a steady-state stage-3 step for several prefetch caps."""
    out = {}
    batch = _gpt_batch(rank)
    for cap in (0, 1 << 18, 1 << 20, 1 << 30):
        model = _small_gpt()
        opt = torch.optim.AdamW(model.parameters())
        config = zgraph.Config(
            stage=3, backend="eager", param_persistence_threshold=0, allgather_bucket_bytes=1 << 16, prefetch_bytes=cap
        )
        step = zgraph.distribute(config)(_gpt_step)
        step(model, opt, *batch)
        gc.collect()
        tracker = LiveTensorBytes()
        with tracker:
            step(model, opt, *batch)
        out[cap] = tracker.peak
    return out


def persistence(rank: int, world: int) -> dict:
    """Default ``param_persistence_threshold``: small parameters are not sharded nor gathered in stage 3."""
    from zgraph.demos.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=2048, d_model=64, layers=1, heads=2, seq=16))  # embedding and head > 1e5
    step = zgraph.distribute(stage=3, backend="eager")(_gpt_step)
    idx = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(rank))
    step(model, torch.optim.AdamW(model.parameters()), idx, idx.roll(1, dims=1))
    from torch.distributed.tensor import DTensor

    sharded = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    gathered = [
        n.meta["zgraph_collective"]
        for n in step.graphs["final"].graph.nodes
        if n.meta.get("zgraph_collective")
        and n.meta["zgraph_collective"][0] == "all_gather"
        and n.meta["phase"] == "forward"
    ]
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # a model too small for stage 3 to shard anything
        warnings.simplefilter("always")
        small = zgraph.distribute(stage=3, backend="eager")(_step)
        small_model = _mlp()
        small(small_model, torch.optim.AdamW(small_model.parameters()), torch.randn(4, 8), torch.randint(0, 4, (4,)))
    return {
        "sharded": sharded,
        "forward_gathers": len(gathered),
        "numels": {n: p.numel() for n, p in model.named_parameters()},
        "explain": step.explain(),
        "small_warnings": [str(w.message) for w in caught if "shards no parameter" in str(w.message)],
        "small_explain": small.explain(),
    }


def released(rank: int, world: int) -> dict:
    """Per stage: is a model a step sharded freed once the user drops model, optimizer and step?"""
    import weakref

    out = {}
    x = torch.randn(8, 64)
    for stage in range(4):
        model = _big_mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = zgraph.distribute(stage=stage, backend="eager", param_persistence_threshold=0)(_step_keeping_grads)
        step(model, opt, x)
        model_ref, opt_ref = weakref.ref(model), weakref.ref(opt)
        del model, opt, step
        gc.collect()
        out[stage] = (model_ref() is None, opt_ref() is None)
    return out


def _step_with_user_collectives(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
    biggest = loss.detach().clone()
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX, async_op=True).wait()
    from_rank1 = loss.detach().reshape(1).clone()
    dist.broadcast(from_rank1, src=1)
    every = torch.empty(dist.get_world_size(), dtype=loss.dtype)
    dist.all_gather_into_tensor(every, loss.detach().reshape(1))
    return loss.detach(), mean_loss, biggest, from_rank1, every


def _step_with_list_all_gather(model, opt, x):
    loss = model(x).pow(2).mean()
    everyone = [torch.empty_like(loss) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, loss.detach())
    return loss


def user_collectives(rank: int, world: int) -> dict:
    """A step that calls torch.distributed collectives itself (logging a mean loss, say): what they return
    inside the compiled step, and the same collectives run eagerly on the losses the step returned."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zgraph.distribute(stage=3, backend="eager")(_step_with_user_collectives)
    out = {"inside": [], "eager": []}
    for i in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * i + rank))
        loss, mean_loss, biggest, from_rank1, every = step(model, opt, x)
        out["inside"].append([mean_loss, biggest, from_rank1, every])
        everyone = [torch.empty_like(loss) for _ in range(world)]
        dist.all_gather(everyone, loss)
        stacked = torch.stack(everyone)
        out["eager"].append([stacked.mean(), stacked.max(), stacked[1].reshape(1), stacked])
    try:
        zgraph.distribute(stage=0, backend="eager")(_step_with_list_all_gather)(_mlp(), None, torch.randn(4, 8))
        out["list_all_gather"] = "no error"
    except zgraph.CaptureError as error:
        out["list_all_gather"] = str(error)
    return out


def _forward_backward(model, x):
    loss = model(x).pow(2).mean() / 2
    loss.backward()
    return loss.detach()


def _update(opt):
    opt.step()
    opt.zero_grad()


def split_steps(rank: int, world: int) -> dict:
    """Gradient accumulation over calls: a zgraph step with forward/backward only, called twice, then the
    optimizer stepped by a second zgraph step ("zgraph") or eagerly ("eager"). Per stage and optimizer mode: the
    largest difference of the full parameters from eager PyTorch on the global batch, or the error."""
    out = {}
    for mode in ("zgraph", "eager"):
        for stage in range(4):
            torch.manual_seed(0)
            model = _mlp()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            reference = copy.deepcopy(model)
            reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
            config = zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0)
            forward_backward = zgraph.distribute(config)(_forward_backward)
            update = zgraph.distribute(config)(_update) if mode == "zgraph" else _update
            try:
                for call in range(2):
                    for micro in range(2):
                        xs = [
                            torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * call + 10 * micro + r))
                            for r in range(world)
                        ]
                        forward_backward(model, xs[rank])
                        _forward_backward(reference, torch.cat(xs))
                    update(opt)
                    _update(reference_opt)
                full = zgraph.full_state_dict(model)
                out[(mode, stage)] = max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items())
            except zgraph.ZGraphError as error:
                out[(mode, stage)] = str(error)
    return out


def waits_before_use(rank: int, world: int) -> dict:
    """Stage 3, automatic buckets and prefetch: for every wait of a forward parameter gather in the final graph,
    the compute ops between the wait and the first op that really reads its result (views, casts and other
    waits do not count). "Wait late" means none."""
    from zgraph.passes.schedule import WAIT, is_collective

    aten = torch.ops.aten
    moves_bytes_only = {  # views, casts and copies: they do not compute with the gathered values
        aten.view.default,
        aten.reshape.default,
        aten.t.default,
        aten.transpose.int,
        aten.permute.default,
        aten.expand.default,
        aten.unsqueeze.default,
        aten._to_copy.default,
        aten.clone.default,
        aten.slice.Tensor,
        aten.split_with_sizes.default,
        operator.getitem,
    }

    nodes = list(_gpt_final_graph(rank, 3).graph.nodes)  # collective_sequences' stage-3 step
    position = {n: i for i, n in enumerate(nodes)}

    def passive(n: fx.Node) -> bool:
        return n.op != "call_function" or n.target in moves_bytes_only or n.target is WAIT or is_collective(n)

    between = {}
    for wait in (n for n in nodes if n.target is WAIT and n.meta.get("phase") == "forward"):
        chain, readers = {wait}, []
        for n in nodes[position[wait] + 1 :]:
            if any(a in chain for a in n.all_input_nodes):
                if passive(n):
                    chain.add(n)
                else:
                    readers.append(n)
        if readers:
            first = min(position[r] for r in readers)
            between[wait.name] = sum(not passive(n) for n in nodes[position[wait] + 1 : first])
    return between
