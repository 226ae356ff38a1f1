"""One rank of one system of ``benchmarks.compare``: build, warm up, time, measure, write a JSON result.

Started by ``benchmarks.compare`` (never imported by the library), once per rank, with torchrun-style
environment variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) for the
distributed systems and none for ``eager-1proc``:

    python -m benchmarks.compare_worker --system ddp --model bench --data data.pt --out rank0.json

Every system trains ``zgraph.demos.models.GPT`` built from the same seed, on the same batches (rank ``r`` of ``w``
takes rows ``[r * B / w, (r + 1) * B / w)`` of each global batch of ``B`` sequences), with ``torch.optim.AdamW``
(weight decay on matrices only). DeepSpeed is imported here only, and only for the ``deepspeed-z*`` systems.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zgraph.demos.models import BENCH_GPT, GPT, GPT_100M, GPTConfig, count_params, lm_loss, weight_decay_groups

MODELS: dict[str, GPTConfig] = {"bench": BENCH_GPT, "100m": GPT_100M}
MIB = 1024 * 1024

StepFn = Callable[[Tensor, Tensor], Tensor]


@dataclass
class System:
    """A built system: ``step(idx, tgt) -> loss`` and the objects whose tensors are its model state."""

    step: StepFn
    state_roots: list[Any]


@dataclass
class RankResult:
    """What one rank measured; written as JSON for the harness."""

    system: str
    rank: int
    world_size: int
    threads: int
    params: int = 0
    warmup_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    warmup_losses: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    cpu_s: float | None = None
    threads_after: int | None = None
    peak_mib: float | None = None
    baseline_rss_mib: float | None = None
    state_mib: float | None = None
    error: str | None = None


# ------------------------------------------------------------------------------------------------ training
def train_step(model: nn.Module, opt: torch.optim.Optimizer, idx: Tensor, tgt: Tensor) -> Tensor:
    """The plain PyTorch step every torch-based system runs (zgraph compiles exactly this function)."""
    loss = lm_loss(model(idx), tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer of every system: AdamW with weight decay on matrices only (``weight_decay_groups``), as the
    independent harness of issue 17 and GPT training scripts have it."""
    return torch.optim.AdamW(weight_decay_groups(model), lr=lr)


# ------------------------------------------------------------------------------------------------ systems
def build_eager(model: nn.Module, lr: float, args: argparse.Namespace) -> System:
    """Plain eager PyTorch in one process (no process group)."""
    opt = adamw(model, lr)
    return System(lambda idx, tgt: train_step(model, opt, idx, tgt), [model, opt])


def build_ddp(model: nn.Module, lr: float, args: argparse.Namespace) -> System:
    """``DistributedDataParallel`` over gloo."""
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = adamw(ddp, lr)
    return System(lambda idx, tgt: train_step(ddp, opt, idx, tgt), [model, opt])


def build_fsdp2(model: nn.Module, lr: float, args: argparse.Namespace, reshard: bool = True) -> System:
    """FSDP2 (``fully_shard``) on every transformer block, then on the root, over a CPU gloo mesh;
    ``reshard``: its ``reshard_after_forward`` (False: each block's parameters gathered once per step)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)
    opt = adamw(model, lr)
    return System(lambda idx, tgt: train_step(model, opt, idx, tgt), [model, opt])


def build_compiled(model: nn.Module, lr: float, args: argparse.Namespace, peer: str) -> System:
    """``ddp`` or ``fsdp2`` with ``torch.compile`` (inductor, default options) on the wrapped model, as their docs
    show it: DDP's compiled graph split at its buckets (DDPOptimizer), FSDP2's traced with its hooks; the
    optimizer step stays eager."""
    if peer == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
        opt = adamw(wrapped, lr)
    else:
        opt = build_fsdp2(model, lr, args).state_roots[1]
        wrapped = model
    compiled = torch.compile(wrapped)
    return System(lambda idx, tgt: train_step(compiled, opt, idx, tgt), [model, opt])


def build_zgraph(model: nn.Module, lr: float, args: argparse.Namespace, stage: int, keep: bool = False) -> System:
    """``zgraph.distribute(Config(stage, backend))(train_step)``; zgraph starts the process group itself.
    ``keep``: ``max_reuse_distance`` of a billion elements (DeepSpeed's default): gathered once per step."""
    import zgraph

    opt = adamw(model, lr)
    config = zgraph.Config(stage=stage, backend=args.backend, max_reuse_distance=10**9 if keep else 0)
    step = zgraph.distribute(config)(train_step)
    return System(lambda idx, tgt: step(model, opt, idx, tgt), [model, opt])


def deepspeed_config(stage: int, micro_batch: int) -> dict[str, Any]:
    """fp32 DeepSpeed config: ZeRO ``stage``, one micro-batch per step, no loss scaling, quiet.

    ``gradient_clipping`` is set to 0 explicitly: DeepSpeed's default is 1.0, which would clip where the other
    systems do not (their losses would then differ from the second step on)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def build_deepspeed(model: nn.Module, lr: float, args: argparse.Namespace, stage: int) -> System:
    """DeepSpeed ZeRO ``stage`` (fp32) with ``torch.optim.AdamW`` as the client optimizer, gloo."""
    import deepspeed

    opt = adamw(model, lr)
    config = deepspeed_config(stage, args.micro_batch)
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(idx: Tensor, tgt: Tensor) -> Tensor:
        loss = lm_loss(engine(idx), tgt)
        engine.backward(loss)
        engine.step()
        return loss

    return System(step, [model, ds_opt, getattr(ds_opt, "optimizer", None)])


def build_system(name: str, model: nn.Module, args: argparse.Namespace) -> System:
    """Dispatch on the system's name (``eager-1proc``, ``ddp``, ``fsdp2``, ``deepspeed-zN``, ``zgraph-zN``)."""
    if name == "eager-1proc":
        return build_eager(model, args.lr, args)
    if name == "ddp":
        return build_ddp(model, args.lr, args)
    if name in ("fsdp2", "fsdp2-keep"):
        return build_fsdp2(model, args.lr, args, reshard=name == "fsdp2")
    if name == "zgraph-z3-keep":
        return build_zgraph(model, args.lr, args, 3, keep=True)
    if name.endswith("-compiled"):
        return build_compiled(model, args.lr, args, name.removesuffix("-compiled"))
    match = re.fullmatch(r"(zgraph|deepspeed)-z([0-3])", name)
    if match is None:
        raise ValueError(f"unknown system {name!r}")
    builder = build_zgraph if match.group(1) == "zgraph" else build_deepspeed
    return builder(model, args.lr, args, int(match.group(2)))


# ------------------------------------------------------------------------------------------------ process group
def distributed_env() -> bool:
    """True when started as one rank of a group (torchrun-style environment)."""
    return "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def init_group(system: str) -> None:
    """Start the gloo group, except for zgraph (it starts its own from the environment) and one process."""
    if distributed_env() and not system.startswith("zgraph") and not dist.is_initialized():
        dist.init_process_group(backend="gloo")


def sync() -> None:
    """Barrier across ranks, once a group exists (zgraph's starts on its first call)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# ------------------------------------------------------------------------------------------------ measuring
def status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field_name}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) if match else -1


def reset_peak_rss() -> None:
    """Reset the resident-set high-water mark (VmHWM) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mib() -> float:
    """VmHWM (peak resident set since the last reset) in MiB."""
    return status_kib("VmHWM") / 1024


def rss_mib() -> float:
    """Current resident set in MiB."""
    return status_kib("VmRSS") / 1024


def _tensors(obj: Any, depth: int = 0) -> Iterator[Tensor]:
    """Tensors reachable from ``obj``: modules (parameters, their ``.grad`` and DeepSpeed's ``ds_tensor``,
    buffers), optimizers (state), containers, and, two levels deep, the attributes of other objects (DeepSpeed's
    ZeRO optimizers keep their flat buffers and partitions in lists)."""
    if depth > 4 or obj is None:
        return
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, nn.Module):
        for p in obj.parameters():
            yield from (t for t in (p, p.grad, getattr(p, "ds_tensor", None)) if t is not None)
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer) and type(obj).__module__.startswith("torch.optim"):
        for state in obj.state.values():
            yield from _tensors(state, depth + 1)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, depth + 1)
    elif depth < 2 and hasattr(obj, "__dict__") and not isinstance(obj, type):
        for value in vars(obj).values():
            if isinstance(value, (Tensor, list, tuple, dict, torch.optim.Optimizer)):
                yield from _tensors(value, depth + 1)


def state_mib(roots: list[Any]) -> float:
    """Bytes of the distinct storages held by the system's model state, in MiB (a DTensor counts its local
    tensor's storage; storages shared by views are counted once)."""
    storages: dict[int, int] = {}
    for root in roots:
        for t in _tensors(root):
            local = getattr(t, "_local_tensor", t)
            storage = local.untyped_storage()
            if storage.nbytes():
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / MIB


# ------------------------------------------------------------------------------------------------ running
def local_batches(path: str, rank: int, world_size: int) -> list[tuple[Tensor, Tensor]]:
    """This rank's rows of every global batch in ``path`` (a ``{"idx", "tgt"}`` file from the harness)."""
    data = torch.load(path)
    rows = data["idx"].shape[1] // world_size
    sl = slice(rank * rows, (rank + 1) * rows)
    return [(i[sl].contiguous(), t[sl].contiguous()) for i, t in zip(data["idx"], data["tgt"])]


def timed_call(step: StepFn, idx: Tensor, tgt: Tensor) -> tuple[float, Tensor]:
    """One step between barriers: seconds (``perf_counter``) and the loss."""
    sync()
    start = time.perf_counter()
    loss = step(idx, tgt)
    sync()
    return time.perf_counter() - start, loss


def run(args: argparse.Namespace, result: RankResult) -> None:
    """Build the system, warm up, reset the memory high-water mark, run the timed steps, measure."""
    init_group(args.system)
    result.baseline_rss_mib = rss_mib()
    batches = local_batches(args.data, result.rank, result.world_size)
    torch.manual_seed(args.seed)
    model = GPT(MODELS[args.model])
    result.params = count_params(model)
    system = build_system(args.system, model, args)
    for i in range(args.warmup):
        seconds, loss = timed_call(system.step, *batches[i % len(batches)])
        result.warmup_s.append(seconds)
        result.warmup_losses.append(float(loss.detach().float().item()))
    sync()
    reset_peak_rss()
    cpu_start = time.process_time()
    for i in range(args.warmup, args.warmup + args.steps):
        seconds, loss = timed_call(system.step, *batches[i % len(batches)])
        result.step_s.append(seconds)
        result.losses.append(float(loss.detach().float().item()))
    result.cpu_s = time.process_time() - cpu_start
    result.threads_after = torch.get_num_threads()
    result.peak_mib = peak_rss_mib()
    result.state_mib = state_mib(system.state_roots)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="bench")
    parser.add_argument("--data", required=True, help="torch.save'd {'idx', 'tgt'}: [steps, global batch, seq]")
    parser.add_argument("--out", required=True, help="where this rank writes its JSON result")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--backend", choices=("eager", "inductor"), default="eager")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one rank; the JSON result is written even when the system fails (with ``error`` set)."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    result = RankResult(
        system=args.system,
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        threads=torch.get_num_threads(),
    )
    return run_and_report(lambda: run(args, result), result, args.out)


def run_and_report(body: Callable[[], None], result: Any, out: str) -> int:
    """Run ``body()``; write ``result`` (a dataclass with ``error``, set to the traceback of any failure, an OOM
    included) as JSON to ``out`` either way; end the process group after a success. Returns the exit code."""
    code = 0
    try:
        body()
    except BaseException:  # noqa: BLE001 - report any failure to the harness, then exit non-zero
        result.error = traceback.format_exc()
        code = 1
    with open(out, "w") as f:
        json.dump(asdict(result), f, indent=1)
    if code == 0 and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
