"""One rank of one system of ``benchmarks.gpu`` on a GPU: build, warm up, time, measure, write a JSON result.

Started by ``benchmarks.gpu`` (never imported by the library), one process per rank, with torchrun-style
environment variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; one rank too):

    python -m benchmarks.gpu_worker --system zgraph-eager --model llama-1b --micro-batch 4 --seq 1024 --out r0.json

Every system trains ``zgraph.demos.llama.Llama`` built on the rank's GPU from the same seed, on the same batches (rank
``r`` of ``w`` takes rows ``[r * B, (r + 1) * B)`` of each global batch of ``w * B`` sequences of zgraph's text
corpus), AdamW (lr ``--lr``, weight decay 0.01). The torch-based systems keep float32 parameters and run the
forward under ``torch.autocast(bfloat16)`` (``--precision autocast``, the default; ``fp32``: no autocast); DeepSpeed
runs its own mixed precision (``bf16.enabled``: bf16 weights on the GPU, float32 master weights and optimizer
states in its optimizer; with ``--precision fp32``, none). The loss is computed in float32.

Systems: ``ddp``; ``fsdp2`` (``fully_shard`` per decoder layer, then the root), ``fsdp2-compiled``
(``torch.compile`` on it), ``fsdp2-offload`` (with ``CPUOffloadPolicy``: parameters, gradients and AdamW on the
host); ``deepspeed-z3``; ``deepspeed-offload`` (ZeRO-Offload: stage 2, optimizer on the host with DeepSpeed's CPU
Adam where its extension builds, else ``zero_force_ds_cpu_optimizer: false`` with torch's CPU AdamW, which the
row's notes say); ``zgraph-eager`` / ``zgraph-inductor`` (``Config(stage=--zgraph-stage, backend=...)``),
``zgraph-offload`` (``Config(stage=1, offload_optimizer="cpu")``, the update on the GPU: ``offload_update="device"``
where zgraph has that option), ``zgraph-host`` (``offload_update="host"``: master weights and AdamW states only in
host memory, the update there) and ``zgraph-host-overlap`` (that and ``offload_overlap="one_step"``).

``--pcie`` adds one step after the timed ones under torch's profiler and records the bytes it copied between host and
device (``benchmarks.gpu_pcie``).

``--memory-cap-gib`` limits the caching allocator (``torch.cuda.set_per_process_memory_fraction``), so that a
model whose AdamW states do not fit next to it can be sized small enough to run in minutes (the offload case).
DeepSpeed is imported here only, and only for the ``deepspeed-*`` systems.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks.compare_worker import peak_rss_mib, reset_peak_rss, run_and_report
from zgraph.demos.llama import Llama, LlamaConfig
from zgraph.demos.models import count_params, lm_loss

SYSTEMS = (  # the systems this worker builds (benchmarks.gpu runs each in its own processes)
    "ddp",
    "fsdp2",
    "fsdp2-compiled",
    "fsdp2-offload",
    "deepspeed-z3",
    "deepspeed-offload",
    "zgraph-eager",
    "zgraph-inductor",
    "zgraph-offload",
    "zgraph-host",
    "zgraph-host-overlap",
)

# ~1.1 B parameters: Llama 3.2 1B's shape (d_model 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192) with a 32k vocab
LLAMA_1B = LlamaConfig(vocab=32000, d_model=2048, layers=16, heads=32, kv_heads=8, hidden=8192, max_seq=4096)
GIB = 2**30
WEIGHT_DECAY = 0.01

StepFn = Callable[[Tensor, Tensor], Tensor]


@dataclass
class RankResult:
    """What one rank measured; written as JSON for the harness."""

    system: str
    rank: int
    world_size: int
    device: str = ""
    params: int = 0
    layers: int = 0
    tokens_per_step: int = 0
    precision: str = ""
    warmup_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    warmup_losses: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    peak_bytes: int | None = None  # max_memory_allocated over the timed steps
    warmup_peak_bytes: int | None = None  # over building and the warm-up steps
    peak_reserved_bytes: int | None = None
    memory_cap_bytes: int | None = None
    peak_rss_mib: float | None = None  # host: VmHWM over the timed steps
    pcie_bytes: dict[str, int] | None = None  # one step after the timed ones (--pcie): host<->device copies
    notes: list[str] = field(default_factory=list)  # what the system ran as (DeepSpeed's host optimizer, say)
    error: str | None = None


def model_config(layers: int | None) -> LlamaConfig:
    """``LLAMA_1B``, or its shape with ``layers`` decoder layers (the offload case sizes the model this way)."""
    return LLAMA_1B if layers is None else dataclasses.replace(LLAMA_1B, layers=layers)


def params_of(config: LlamaConfig) -> int:
    """Parameters of a ``Llama`` of ``config`` (the offload case's sizing; equals ``count_params`` of one)."""
    head_dim = config.d_model // config.heads
    attention = 2 * config.d_model * config.heads * head_dim + 2 * config.d_model * config.kv_heads * head_dim
    layer = attention + 3 * config.d_model * config.hidden + 2 * config.d_model
    return 2 * config.vocab * config.d_model + config.layers * layer + config.d_model


# ------------------------------------------------------------------------------------------------ training
def forward_loss(model: nn.Module, idx: Tensor, tgt: Tensor, autocast: bool) -> Tensor:
    """The forward (under bf16 autocast when asked), then the loss in float32."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(idx)
    return lm_loss(logits.float(), tgt)


def make_step(autocast: bool) -> Callable:
    """The plain step every torch-based system runs (zgraph compiles exactly this function)."""

    def train_step(model: nn.Module, opt: torch.optim.Optimizer, idx: Tensor, tgt: Tensor) -> Tensor:
        loss = forward_loss(model, idx, tgt, autocast)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return train_step


def adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)


# ------------------------------------------------------------------------------------------------ systems
def build_ddp(model: nn.Module, args: argparse.Namespace, device: torch.device) -> StepFn:
    wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    opt, step = adamw(model.parameters(), args.lr), make_step(args.precision == "autocast")
    return lambda idx, tgt: step(wrapped, opt, idx, tgt)


def build_fsdp2(model: nn.Module, args: argparse.Namespace, device: torch.device, variant: str = "") -> StepFn:
    """FSDP2 on every decoder layer, then the root; ``variant``: ``compiled`` (``torch.compile`` on the model) or
    ``offload`` (``CPUOffloadPolicy``: sharded parameters, gradients and the optimizer on the host)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    options: dict[str, Any] = {"mesh": mesh}
    if variant == "offload":
        options["offload_policy"] = CPUOffloadPolicy()
    for layer in model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    opt, step = adamw(model.parameters(), args.lr), make_step(args.precision == "autocast")
    run = torch.compile(model) if variant == "compiled" else model
    return lambda idx, tgt: step(run, opt, idx, tgt)


def deepspeed_config(args: argparse.Namespace, offload: bool) -> dict[str, Any]:
    """ZeRO-3, or ZeRO-Offload (stage 2, optimizer states and update on the host); DeepSpeed's bf16 mixed
    precision under ``--precision autocast``; AdamW as the other systems have it; no gradient clipping (DeepSpeed's
    default clips at 1.0, which the other systems do not)."""
    zero: dict[str, Any] = {"stage": 3}
    if offload:
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": WEIGHT_DECAY},
        },
        "bf16": {"enabled": args.precision == "autocast"},
        "fp16": {"enabled": False},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def cpu_adam_builds() -> str | None:
    """None where DeepSpeed's CPU Adam extension builds (just in time: ninja and a C++ compiler), else why not."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
    except Exception as err:  # any failure of the build: the fallback runs and the row says why
        return f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
    return None


def build_deepspeed(
    model: nn.Module, args: argparse.Namespace, device: torch.device, offload: bool, notes: list[str]
) -> StepFn:
    """DeepSpeed's engine; with ``offload`` its CPU Adam, or torch's CPU AdamW where that does not build."""
    import deepspeed

    config, optimizer = deepspeed_config(args, offload), None
    if args.precision == "autocast":  # DeepSpeed's bf16 casts parameters only: the rotary tables too, else the
        model.cos, model.sin = model.cos.bfloat16(), model.sin.bfloat16()  # attention gets fp32 q, k and bf16 v
    why = cpu_adam_builds() if offload else None
    if offload:
        notes.append("host optimizer: DeepSpeedCPUAdam" if why is None else f"host optimizer: torch AdamW ({why})")
    if why is not None:
        config.pop("optimizer")
        config["zero_force_ds_cpu_optimizer"] = False
        optimizer = adamw(model.parameters(), args.lr)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, optimizer=optimizer
    )

    def step(idx: Tensor, tgt: Tensor) -> Tensor:
        loss = lm_loss(engine(idx).float(), tgt)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def build_zgraph(model: nn.Module, args: argparse.Namespace, device: torch.device, backend: str) -> StepFn:
    """``zgraph.distribute(Config(...))(train_step)``; zgraph starts the process group itself (NCCL: the model is on
    a GPU). ``backend`` ``offload`` / ``host`` / ``host-overlap``: the eager backend with ``offload_optimizer="cpu"``
    at stage 1, the update on the device / on the host / on the host one step late."""
    import zgraph

    opt = adamw(model.parameters(), args.lr)
    has_update = "offload_update" in {f.name for f in dataclasses.fields(zgraph.Config)}
    offload = {
        "offload": {"offload_update": "device"} if has_update else {},
        "host": {"offload_update": "host"},
        "host-overlap": {"offload_update": "host", "offload_overlap": "one_step"},
    }
    if backend in offload:
        config = zgraph.Config(stage=1, backend="eager", offload_optimizer="cpu", **offload[backend])
    else:
        config = zgraph.Config(stage=args.zgraph_stage, backend=backend)
    step = zgraph.distribute(config)(make_step(args.precision == "autocast"))
    return lambda idx, tgt: step(model, opt, idx, tgt)


def build_system(
    name: str, model: nn.Module, args: argparse.Namespace, device: torch.device, notes: list[str]
) -> StepFn:
    builders: dict[str, Callable[[], StepFn]] = {
        "ddp": lambda: build_ddp(model, args, device),
        "fsdp2": lambda: build_fsdp2(model, args, device),
        "fsdp2-compiled": lambda: build_fsdp2(model, args, device, "compiled"),
        "fsdp2-offload": lambda: build_fsdp2(model, args, device, "offload"),
        "deepspeed-z3": lambda: build_deepspeed(model, args, device, False, notes),
        "deepspeed-offload": lambda: build_deepspeed(model, args, device, True, notes),
        "zgraph-eager": lambda: build_zgraph(model, args, device, "eager"),
        "zgraph-inductor": lambda: build_zgraph(model, args, device, "inductor"),
        "zgraph-offload": lambda: build_zgraph(model, args, device, "offload"),
        "zgraph-host": lambda: build_zgraph(model, args, device, "host"),
        "zgraph-host-overlap": lambda: build_zgraph(model, args, device, "host-overlap"),
    }
    if name not in builders:
        raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
    return builders[name]()


# ------------------------------------------------------------------------------------------------ running
def local_batches(args: argparse.Namespace, rank: int, world: int, count: int, device: torch.device) -> list:
    """This rank's rows of ``count`` global batches of next-token windows of zgraph's corpus (byte tokens, which
    fit the vocabulary), the same on every rank and in every system."""
    from zgraph.demos.data import batch, corpus_tokens

    tokens = corpus_tokens()
    generator = torch.Generator().manual_seed(args.seed)
    rows = slice(rank * args.micro_batch, (rank + 1) * args.micro_batch)
    out = []
    for _ in range(count):
        idx, tgt = batch(tokens, args.micro_batch * world, args.seq, generator)
        out.append((idx[rows].to(device), tgt[rows].to(device)))
    return out


def sync(device: torch.device) -> None:
    """Wait for the GPU, then for the other ranks (once a group exists: zgraph starts its own on its first call)."""
    torch.cuda.synchronize(device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(device_ids=[device.index])


def timed_call(step: StepFn, idx: Tensor, tgt: Tensor, device: torch.device) -> tuple[float, float]:
    """One step between synchronisations: seconds and the loss."""
    sync(device)
    start = time.perf_counter()
    loss = step(idx, tgt)
    sync(device)
    return time.perf_counter() - start, float(loss.float().item())


def run(args: argparse.Namespace, result: RankResult) -> None:
    """Build the system, warm up, reset the peaks, run the timed steps, measure."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    result.device = torch.cuda.get_device_name(device)
    if args.memory_cap_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        cap = min(int(args.memory_cap_gib * GIB), total)
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
        result.memory_cap_bytes = cap
    if not args.system.startswith("zgraph"):  # zgraph starts its own from the environment
        dist.init_process_group("nccl", device_id=device)
    config = model_config(args.layers)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = Llama(config)
    result.params, result.layers = count_params(model), config.layers
    result.tokens_per_step = args.micro_batch * args.seq * result.world_size
    result.precision = args.precision
    batches = local_batches(args, result.rank, result.world_size, args.warmup + args.steps, device)
    step = build_system(args.system, model, args, device, result.notes)
    del model
    for i in range(args.warmup):
        seconds, loss = timed_call(step, *batches[i], device)
        result.warmup_s.append(seconds)
        result.warmup_losses.append(loss)
    sync(device)
    result.warmup_peak_bytes = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    reset_peak_rss()
    for i in range(args.warmup, args.warmup + args.steps):
        seconds, loss = timed_call(step, *batches[i], device)
        result.step_s.append(seconds)
        result.losses.append(loss)
    result.peak_bytes = torch.cuda.max_memory_allocated(device)
    result.peak_reserved_bytes = torch.cuda.max_memory_reserved(device)
    result.peak_rss_mib = peak_rss_mib()
    if args.pcie:
        from benchmarks.gpu_pcie import profiled_bytes

        result.pcie_bytes = profiled_bytes(lambda: step(*batches[args.warmup]), lambda: sync(device))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", required=True, choices=SYSTEMS)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: LLAMA_1B's 16)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--precision", choices=("autocast", "fp32"), default="autocast")
    parser.add_argument("--zgraph-stage", type=int, choices=(0, 1, 2, 3), default=3)
    parser.add_argument("--memory-cap-gib", type=float, default=0.0, help="limit the caching allocator (0: none)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pcie", action="store_true", help="one more step, profiled: bytes between host and device")
    parser.add_argument("--out", required=True, help="where this rank writes its JSON result")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one rank; the JSON result is written even when the system fails (with ``error`` set)."""
    args = parse_args(argv)
    result = RankResult(
        system=args.system, rank=int(os.environ.get("RANK", "0")), world_size=int(os.environ.get("WORLD_SIZE", "1"))
    )
    return run_and_report(lambda: run(args, result), result, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
