"""The ranks' side of the GPU checks (``tests/gpu/test_gpu_checks.py``), started by ``tests/dist_harness.py``.

A *transport* is how a check's ranks talk (``transports``):

- ``gloo-2``: 2 ranks sharing the GPU (``cuda:rank % device_count``) in a default group the harness starts with
  ``"cpu:gloo,cuda:gloo"``, so CUDA tensors go through gloo: this checks zgraph's device path (state, graphs,
  collectives on device tensors), not NCCL — NCCL refuses two ranks on one GPU;
- ``nccl-1``: 1 rank; zgraph starts the group itself on its first call from torchrun's variables, with the backend
  for the model's device (NCCL for a CUDA model);
- ``nccl-all``: one rank per GPU under NCCL, likewise (only where ``torch.cuda.device_count() > 1``).

Every check (``CHECKS``) runs on every rank of the transport's group, one after the other; rank 0 saves
``{check: result}`` (host tensors only), a failed check as ``{"error": traceback}``. ``group``, ``parity`` and
``split`` are here with the set-up they share; ``fp16``, ``offload`` and ``estimate`` in ``gpu_memory_cases``:

- ``group``: the group's backend and where the model is (started by zgraph or the harness);
- ``parity``: a small GPT, AdamW, ``STEPS`` steps on the same global batches: one process eager (and again with
  the batch's rows rotated: reduction order alone), DDP, and zgraph at stages 0-3, in fp32 and with
  ``param_dtype=torch.bfloat16`` (every parameter cast: ``keep_fp32_modules=()``; the eager and DDP references
  cast a float32 master copy the same way and reduce bf16 gradients, as zgraph does);
- ``split``: a step returning the logits with a ``grad_fn``, ``out.backward(gradient=g)`` outside it, the update in
  a second step; eager, DDP and zgraph at stages 0-3;
- ``fp16``: ``param_dtype=torch.float16`` with dynamic loss scaling, an ``inf`` in the last rank's batch at call
  ``OVERFLOW_CALL`` (every rank must skip that update and halve the scale), and DeepSpeed's defaults
  (``loss_scale="dynamic"``);
- ``offload``: ``offload_optimizer="cpu"`` (stage 1), ``offload_params="cpu"`` and both (stage 3) against the same
  run without offload: losses and every parameter and optimizer state, bitwise;
- ``estimate``: ``step.estimate(..., device="cuda")`` against the peak of a real call,
  ``torch.cuda.max_memory_allocated``;
- ``meta`` (``gpu_meta_cases``): a GPT built on the meta device, made real by ``zgraph.materialize`` at stage 3:
  its shards on the rank's GPU under NCCL, equal bitwise to the GPT built there from the same seed.

``ZGRAPH_GPU_QUICK=1`` (``python -m benchmarks.gpu``) checks stages 0 and 3 only. On the GPU every rank runs
deterministic kernels (``torch.use_deterministic_algorithms``, cuBLAS workspace config,
the math attention kernel, no TF32), so the measured noise is reduction order, not run-to-run variation.
``ZGRAPH_GPU_TESTS_ON_CPU=1`` runs the same checks on the CPU over gloo where there is no GPU: a rehearsal of the
tests' own logic, not a GPU check.
"""

from __future__ import annotations

import copy
import gc
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import zgraph
from zgraph.demos.models import GPT, GPTConfig, lm_loss

ON_CPU_ENV = "ZGRAPH_GPU_TESTS_ON_CPU"
SKIP_REASON = (
    "no CUDA device (torch.cuda.is_available() is False): the GPU checks need one "
    f"({ON_CPU_ENV}=1 rehearses them on the CPU)"
)
QUICK = os.environ.get("ZGRAPH_GPU_QUICK") == "1"  # python -m benchmarks.gpu's quick form: stages 0 and 3
STAGES = (0, 3) if QUICK else (0, 1, 2, 3)
STEPS = 5
GLOBAL_BATCH = 8
LR = 1e-3
SMALL = GPTConfig(vocab=64, d_model=32, layers=2, heads=4, seq=16)
ESTIMATE_GPT = GPTConfig(vocab=8192, d_model=512, layers=6, heads=8, seq=256)  # ~27 M parameters
ESTIMATE_BATCH = 8  # sequences per rank
DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
OVERFLOW_CALL = 3
OFFLOAD: dict[str, tuple[int, dict[str, str]]] = {  # the states brought to the device for the update
    "optimizer-z1": (1, {"offload_optimizer": "cpu", "offload_update": "device"}),
    "params-z3": (3, {"offload_params": "cpu"}),
    "both-z3": (3, {"offload_optimizer": "cpu", "offload_params": "cpu", "offload_update": "device"}),
}
HOST_UPDATE: dict[str, tuple[int, dict[str, str]]] = {  # the update on the host (issue 43)
    "host-z1": (1, {"offload_optimizer": "cpu", "offload_update": "host"}),
    "host-z3": (3, {"offload_optimizer": "cpu", "offload_update": "host"}),
}


def device_type() -> str | None:
    """``"cuda"`` where CUDA is available, ``"cpu"`` for the rehearsal (``ZGRAPH_GPU_TESTS_ON_CPU=1``), else None."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get(ON_CPU_ENV) == "1":
        return "cpu"
    return None


@dataclass(frozen=True)
class Transport:
    """How a check's ranks talk: ``world`` ranks, the harness's ``init_group`` (a backend, or False: zgraph
    starts the group from the model's device)."""

    name: str
    world: int
    init_group: bool | str
    what: str


def shared_backend() -> str:
    """The backend of ``gloo-2``'s group: gloo for host and CUDA tensors (plain gloo in the CPU rehearsal)."""
    return "cpu:gloo,cuda:gloo" if device_type() == "cuda" else "gloo"


def transports() -> dict[str, Transport]:
    """The transports this machine offers (``nccl-all`` needs two or more GPUs)."""
    found = {
        "gloo-2": Transport("gloo-2", 2, shared_backend(), "2 ranks sharing the GPU, CUDA tensors through gloo"),
        "nccl-1": Transport("nccl-1", 1, False, "1 rank, group started by zgraph (NCCL for a CUDA model)"),
    }
    count = torch.cuda.device_count() if device_type() == "cuda" else 0
    if count > 1:
        found["nccl-all"] = Transport("nccl-all", count, False, f"{count} ranks, one GPU each, NCCL")
    return found


# ------------------------------------------------------------------------------------------------ set-up
def setup_rank(rank: int) -> torch.device:
    """This rank's device (its GPU current), with deterministic kernels."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # leave torch.empty as it is
    if device_type() != "cuda":
        return torch.device("cpu")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    return device


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def lm_batches() -> list[tuple[Tensor, Tensor]]:
    g = generator(4)
    shape = (GLOBAL_BATCH, SMALL.seq)
    return [
        (torch.randint(0, SMALL.vocab, shape, generator=g), torch.randint(0, SMALL.vocab, shape, generator=g))
        for _ in range(STEPS)
    ]


def local(t: Tensor, rank: int, world: int) -> Tensor:
    """Rank ``rank``'s rows of a global batch tensor."""
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def rotate(t: Tensor, parts: int) -> Tensor:
    """The rows of ``t`` with the first of ``parts`` equal slices moved last: the same batch, summed in another
    order."""
    chunks = t.chunk(parts)
    return torch.cat([*chunks[1:], chunks[0]])


def make_model(device: torch.device, config: GPTConfig = SMALL) -> GPT:
    torch.manual_seed(0)
    return GPT(config).to(device)


def lm_step(model: nn.Module, opt: torch.optim.Optimizer, idx: Tensor, tgt: Tensor) -> Tensor:
    loss = lm_loss(model(idx), tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def mean_loss(loss: Tensor, world: int) -> float:
    """The loss averaged over the ranks (every rank's slice is the same size): the global batch's."""
    total = loss.detach().float().clone()
    if world > 1:
        dist.all_reduce(total)
    return float(total) / world


def _flatten(model_state: dict, opt_state: dict) -> dict[str, Tensor]:
    out = {f"param {k}": v.detach().cpu().clone() for k, v in model_state.items()}
    for index, state in opt_state["state"].items():
        for key, value in state.items():
            if isinstance(value, Tensor):
                out[f"opt {index} {key}"] = value.detach().cpu().clone()
    return out


def host_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Tensor]:
    """Parameters, buffers and optimizer state of an eager model, as host tensors keyed by name."""
    return _flatten(model.state_dict(), opt.state_dict())


def zgraph_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Tensor]:
    """The same, whole, of a model and optimizer trained by zgraph (``zgraph.full_state_dict``)."""
    model_state, opt_state = zgraph.full_state_dict(model, opt)
    return _flatten(model_state, opt_state)


def config(stage: int, dtype: torch.dtype | None = None, **fields: Any) -> zgraph.Config:
    """The checks' config: the eager backend, every parameter sharded at stage 3 (the checks are of sharding, not
    of the threshold), every parameter cast with ``dtype``."""
    if dtype is not None:
        fields = {"param_dtype": dtype, "keep_fp32_modules": (), **fields}
    return zgraph.Config(stage=stage, backend="eager", param_persistence_threshold=0, **fields)


def guarded(fn: Callable, *args: Any, **kwargs: Any) -> dict:
    try:
        return fn(*args, **kwargs)
    except Exception:
        return {"error": traceback.format_exc()}


# ------------------------------------------------------------------------------------------------ group
def group(rank: int, world: int, device: torch.device) -> dict:
    """Start the group as the transport does (a first zgraph call where the harness started none) and report it."""
    started_by = "harness"
    if not dist.is_initialized():
        model = make_model(device)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        idx, tgt = (local(t, rank, world).to(device) for t in lm_batches()[0])
        zgraph.distribute(config(0))(lm_step)(model, opt, idx, tgt)
        started_by = "zgraph"
    current = torch.cuda.current_device() if device.type == "cuda" else None
    return {"backend": dist.get_backend(), "started_by": started_by, "device": str(device), "current": current}


# ------------------------------------------------------------------------------------------------ parity
def _forward(model: nn.Module, idx: Tensor, dtype: torch.dtype | None) -> Tensor:
    """The model's output with its parameters read in ``dtype`` (autograd carries the gradients to the float32
    parameters), as ``Config(param_dtype=dtype)`` reads them."""
    if dtype is None:
        return model(idx)
    params = {name: p.to(dtype) for name, p in model.named_parameters()}
    return torch.func.functional_call(model, params, (idx,))


def eager_run(device: torch.device, dtype: torch.dtype | None, parts: int = 1) -> dict:
    """One process on the global batches (``parts`` > 1: rows rotated by one of ``parts`` slices)."""
    model = make_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for idx, tgt in lm_batches():
        if parts > 1:
            idx, tgt = rotate(idx, parts), rotate(tgt, parts)
        loss = lm_loss(_forward(model, idx.to(device), dtype), tgt.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach().float()))
    return {"losses": losses, "state": host_state(model, opt)}


def _ddp(module: nn.Module, device: torch.device) -> nn.parallel.DistributedDataParallel:
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(module, device_ids=device_ids)


def ddp_run(rank: int, world: int, device: torch.device, dtype: torch.dtype | None) -> dict:
    """DDP on each rank's rows. With ``dtype``: DDP over a copy of the model in ``dtype`` (its bf16 gradients
    averaged by DDP), the float32 master copy stepped by AdamW and copied back into it."""
    master = make_model(device)
    opt = torch.optim.AdamW(master.parameters(), lr=LR)
    compute = master if dtype is None else copy.deepcopy(master).to(dtype)
    wrapped = _ddp(compute, device)
    losses = []
    for idx, tgt in lm_batches():
        loss = lm_loss(wrapped(local(idx, rank, world).to(device)), local(tgt, rank, world).to(device))
        loss.backward()
        if dtype is not None:
            for m, c in zip(master.parameters(), compute.parameters(), strict=True):
                m.grad = c.grad.to(m.dtype)
                c.grad = None
        opt.step()
        opt.zero_grad()
        if dtype is not None:
            with torch.no_grad():
                for m, c in zip(master.parameters(), compute.parameters(), strict=True):
                    c.copy_(m)
        losses.append(mean_loss(loss, world))
    return {"losses": losses, "state": host_state(master, opt)}


def zgraph_run(rank: int, world: int, device: torch.device, stage: int, dtype: torch.dtype | None) -> dict:
    model = make_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    step = zgraph.distribute(config(stage, dtype))(lm_step)
    losses = []
    for idx, tgt in lm_batches():
        loss = step(model, opt, local(idx, rank, world).to(device), local(tgt, rank, world).to(device))
        losses.append(mean_loss(loss, world))
    return {"losses": losses, "state": zgraph_state(model, opt)}


def parity(rank: int, world: int, device: torch.device) -> dict:
    out = {}
    for name, dtype in DTYPES.items():
        runs: dict[Any, Any] = {}
        if rank == 0:
            runs["eager"] = guarded(eager_run, device, dtype)
            runs["rotated"] = guarded(eager_run, device, dtype, parts=max(world, 2))
        runs["ddp"] = guarded(ddp_run, rank, world, device, dtype)
        for stage in STAGES:
            runs[stage] = guarded(zgraph_run, rank, world, device, stage, dtype)
        out[name] = runs
    return out


# ------------------------------------------------------------------------------------------------ split
def _logits(model: nn.Module, idx: Tensor) -> Tensor:
    return model(idx)  # returned with a grad_fn: zgraph runs the backward when autograd reaches it


def _update(opt: torch.optim.Optimizer) -> None:
    opt.step()
    opt.zero_grad()


def split_batches() -> list[tuple[Tensor, Tensor]]:
    """Inputs and d(loss)/d(logits) of a mean over the global batch (1/B of a per-sample weight)."""
    g = generator(5)
    shape = (GLOBAL_BATCH, SMALL.seq)
    return [
        (
            torch.randint(0, SMALL.vocab, shape, generator=g),
            torch.randn((*shape, SMALL.vocab), generator=g) / GLOBAL_BATCH,
        )
        for _ in range(STEPS)
    ]


def split_run(kind: str, rank: int, world: int, device: torch.device, stage: int = 0, parts: int = 1) -> dict:
    """``kind``: ``eager`` (one process, global batch; ``parts`` > 1: rows rotated), ``ddp`` or ``zgraph`` (each
    rank's rows, the gradient scaled by the world size: DDP and zgraph average over the ranks)."""
    model = make_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    forward, update = _logits, _update
    if kind == "zgraph":
        forward, update = (zgraph.distribute(config(stage))(fn) for fn in (_logits, _update))
    elif kind == "ddp":
        wrapped = _ddp(model, device)
        forward = lambda _, idx: wrapped(idx)  # noqa: E731
    ranks = 1 if kind == "eager" else world
    losses, grad_fns = [], []
    for idx, g in split_batches():
        if kind != "eager":
            idx, g = local(idx, rank, world), local(g, rank, world) * world
        elif parts > 1:
            idx, g = rotate(idx, parts), rotate(g, parts)
        out = forward(model, idx.to(device))
        grad_fns.append(out.grad_fn is not None)
        out.backward(gradient=g.to(device))
        update(opt)
        losses.append(mean_loss(out.detach().float().pow(2).mean(), ranks))
    state = zgraph_state(model, opt) if kind == "zgraph" else host_state(model, opt)
    return {"losses": losses, "state": state, "grad_fns": grad_fns}


def split(rank: int, world: int, device: torch.device) -> dict:
    runs: dict[Any, Any] = {}
    if rank == 0:
        runs["eager"] = guarded(split_run, "eager", 0, 1, device)
        runs["rotated"] = guarded(split_run, "eager", 0, 1, device, parts=max(world, 2))
    runs["ddp"] = guarded(split_run, "ddp", rank, world, device)
    for stage in STAGES:
        runs[stage] = guarded(split_run, "zgraph", rank, world, device, stage)
    return runs


# ------------------------------------------------------------------------------------------------ worker
CHECKS = ("group", "parity", "split", "fp16", "offload", "estimate", "meta")  # group first: it starts nccl-*


def check_functions() -> dict[str, Callable[[int, int, torch.device], dict]]:
    """``CHECKS``' functions: ``group``, ``parity`` and ``split`` here, ``fp16``, ``offload`` and ``estimate`` in
    ``gpu_memory_cases``, ``meta`` in ``gpu_meta_cases`` (imported here, not at the top: they import this module's
    helpers)."""
    from gpu_memory_cases import estimate, fp16, offload
    from gpu_meta_cases import meta

    checks = {"group": group, "parity": parity, "split": split, "fp16": fp16, "offload": offload}
    return {**checks, "estimate": estimate, "meta": meta}


def run(rank: int, world: int, out_path: str, names: list[str]) -> None:
    """Worker: every named check on this rank, in order; rank 0 saves ``{check: result}``."""
    device = setup_rank(rank)
    checks = check_functions()
    results = {}
    for name in names:
        results[name] = guarded(checks[name], rank, world, device)
        if dist.is_initialized():
            dist.barrier()
        gc.collect()
    if rank == 0:
        torch.save(results, out_path)
