"""``zgraph demo --multimodal``: the seeds' disaggregated multimodal training (``zgraph.demos.multimodal``) on two
groups of ranks, each sharding its own model with ZeRO over its own process group.

* With Ray installed (``pip install 'zgraph[ray]'``) the demo starts a local Ray cluster (or joins the running one
  at ``--ray-address`` / ``RAY_ADDRESS``: several machines) and two groups of actors, each packed on one node
  where it fits; each group runs its own ``torch.distributed`` world (gloo, NCCL on GPUs). The embeddings and their
  gradients travel between the groups as Ray objects, as in the seeds' pseudo-code.
* Without Ray (or with ``--launcher processes``, or under torchrun) the ranks are ``torch.multiprocessing``
  processes of one world, split into two subgroups; the tensors travel by point-to-point send/recv.

The ranks train on GPUs (``cuda:<local rank>``, NCCL) where CUDA has one for every rank, else on the CPU (gloo).
Either way the losses are compared with the same combined model trained by plain PyTorch in one process, on the
same kind of device as the ranks (a GPU's kernels round differently from the CPU's).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from zgraph.demos.models import count_params
from zgraph.demos.multimodal import MultimodalConfig, TextSide, VisionSide, build_models, eager_losses
from zgraph.demos.ranks import (
    DemoRankError,
    device_note,
    free_port,
    local_rank_and_size,
    rank_device,
    spawn_ranks,
    unsharded_state_bytes,
)
from zgraph.inspect.explain import human_bytes
from zgraph.runtime.devices import default_backend, served_backend
from zgraph.runtime.memory import state_bytes as held_state_bytes
from zgraph.runtime.process_group import ensure_process_group

LOSS_TOLERANCE = 1e-4  # largest |zgraph - eager| loss difference reported as a match (float32 round-off, same device)


def config_from(args: argparse.Namespace) -> MultimodalConfig:
    sp = args.sequence_parallel or 1
    return MultimodalConfig(per_rank=args.batch, lr=args.lr, stage=args.stage, seed=args.seed, sequence_parallel=sp)


def check_sequence_parallel(config: MultimodalConfig, per_group: int) -> None:
    """``SystemExit`` naming what ``--sequence-parallel`` must divide, where it does not."""
    sp = config.sequence_parallel
    for what, count in (("LM group's ranks (--nproc)", per_group), ("LM's heads", config.heads)):
        if count % sp:
            raise SystemExit(f"zgraph demo --multimodal: --sequence-parallel {sp} must divide the {what}: {count}")


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run the multimodal demo; returns the summary where it is printed (None on the other ranks)."""
    config = config_from(args)
    if "RANK" in os.environ or (dist.is_available() and dist.is_initialized()):
        summary = train_rank(config, args.steps)  # one rank of torchrun's world
    else:
        per_group = args.nproc or 2
        check_sequence_parallel(config, per_group)
        use_ray = args.launcher == "ray" or (args.launcher == "auto" and importlib.util.find_spec("ray") is not None)
        if args.launcher == "ray" and importlib.util.find_spec("ray") is None:
            raise SystemExit("zgraph demo: --launcher ray needs Ray: pip install 'zgraph[ray]'")
        if use_ray:
            summary = run_ray(config, args.steps, per_group, args.ray_address)
        else:
            summary = _run_processes(args, per_group)
    if summary is not None:
        device = _reference_device(summary["device"])
        summary["eager_losses"] = eager_losses(config, summary["per_group"], args.steps, device)
        print(report(summary, config))
    return summary


def _reference_device(kind: str) -> torch.device:
    """Where the eager reference runs: this process's current GPU when the ranks trained on GPUs, else the CPU."""
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------------- processes: one world
def _run_processes(args: argparse.Namespace, per_group: int) -> dict[str, Any]:
    return spawn_ranks(args, 2 * per_group, _train_spawned)


def _train_spawned(args: argparse.Namespace) -> dict[str, Any] | None:
    return train_rank(config_from(args), args.steps)


def train_rank(config: MultimodalConfig, steps: int) -> dict[str, Any] | None:
    """This rank's part: the first half of the world is the vision group, the second the language group; rank
    ``r`` of one group trades tensors with rank ``r`` of the other. The language group's rank 0 returns the
    summary."""
    owns_group = not dist.is_initialized()  # started here from torchrun's environment: this rank ends it
    if owns_group:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    else:
        rank, world = dist.get_rank(), dist.get_world_size()
    local_rank, local_size = local_rank_and_size(rank, world)
    chosen = rank_device(local_rank, local_size)
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    note = device_note(local_size, _fitting_groups())
    if rank == 0 and note is not None:
        print(f"zgraph demo --multimodal: {note}")
    info = ensure_process_group(device_of=lambda: chosen)  # NCCL for GPUs, gloo for the CPU
    rank, world = info.rank, info.world_size
    if world < 2 or world % 2:
        raise SystemExit(f"zgraph demo --multimodal: needs an even number of ranks (two equal groups), got {world}")
    n = world // 2
    check_sequence_parallel(config, n)
    groups = [dist.new_group(list(range(n))), dist.new_group(list(range(n, world)))]  # every rank makes both
    on_gpu = chosen.type == "cuda" and served_backend(info.backend, "cuda") is not None
    device = str(chosen) if on_gpu else "cpu"  # a group started elsewhere may serve only the CPU
    losses: list[float] = []
    sp = config.sequence_parallel
    if rank < n:
        side = VisionSide(config, rank, n, groups[0], device)
        text = [n + rank - rank % sp + s for s in range(sp)]  # the LM ranks of the sequence group its rows go to
        rows = (sp * config.per_rank, (config.patches + config.text) // sp, config.d_model)  # a slice's gradient
        for i in range(steps):
            emb = side.forward(i).to(device)
            grads = [torch.empty(rows, device=device) for _ in text]
            _trade([(emb, t) for t in text], list(zip(grads, text)))
            side.backward(grads)
        model, opt = side.encoder, side.opt
    else:
        side = TextSide(config, rank - n, n, groups[1], device)
        vision = [rank - n - (rank - n) % sp + s for s in range(sp)]  # the vision ranks of its sequence group's rows
        shape = (config.per_rank, config.patches, config.d_model)
        for i in tqdm(range(steps), desc=f"zgraph multimodal ZeRO-{config.stage}", disable=rank != n):
            embs = [torch.empty(shape, device=device) for _ in vision]
            _trade([], list(zip(embs, vision)))
            loss, grad = side.step(i, torch.cat(embs))
            _trade([(grad.to(device), v) for v in vision], [])
            losses.append(loss)
        model, opt = side.lm, side.opt
    mean = torch.tensor(losses or [0.0] * steps, dtype=torch.float64, device=device)
    dist.all_reduce(mean)  # the vision ranks add zeros
    held = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_gather_single(held, torch.tensor([held_state_bytes(model, opt)["total"]], device=device))
    summary = None
    if rank == n:
        transport = "torch.multiprocessing, one world in two subgroups"
        summary = _summary((mean / n).tolist(), held.tolist(), n, transport, torch.device(device).type)
    if owns_group:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def _trade(sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]]) -> None:
    """Every send and receive (tensor, peer rank) posted at once, then waited for: no order between peers."""
    works = [dist.isend(t, peer) for t, peer in sends] + [dist.irecv(t, peer) for t, peer in receives]
    for work in works:
        work.wait()


def _summary(losses: list[float], held: list[int], per_group: int, transport: str, device: str) -> dict[str, Any]:
    return {"losses": losses, "state_bytes": held, "per_group": per_group, "transport": transport, "device": device}


def _fitting_groups() -> str | None:
    """The ``--nproc`` (ranks per group) that fits this host's GPUs, for the note when there are too few."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"--nproc {count // 2}" if count >= 2 else None


# ------------------------------------------------------------------------------------- Ray: two worlds
class SideActor:
    """A Ray actor: one rank of one side, in that side's own ``torch.distributed`` world."""

    def __init__(self, role: str, config: MultimodalConfig, rank: int, ranks: int, device: str):
        self.role, self.config, self.rank, self.ranks = role, config, rank, ranks
        self.device = device  # "cuda": Ray gave the actor a GPU of its own (its device 0); else "cpu"
        self.side: VisionSide | TextSide | None = None

    def rendezvous(self) -> tuple[str, int]:
        """Where this actor (the side's rank 0) serves its world's store: its node's address and a free port."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, host: str, port: int) -> None:
        """Join the side's world at rank 0's ``host:port`` (every actor of the side must be in ``setup`` at once)
        and build the side."""
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        torch.set_num_threads(1)
        backend = default_backend(torch.device(self.device))
        device = "cuda:0" if self.device == "cuda" else "cpu"  # Ray gives each actor its own GPU as device 0
        if self.device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, rank=self.rank, world_size=self.ranks)
        kind = VisionSide if self.role == "vision" else TextSide
        self.side = kind(self.config, self.rank, self.ranks, None, device)

    def forward(self, i: int) -> torch.Tensor:
        return self.side.forward(i)

    def backward(self, *grads: torch.Tensor) -> None:
        self.side.backward(list(grads))

    def step(self, i: int, *embeddings: torch.Tensor) -> tuple[float, torch.Tensor]:
        return self.side.step(i, torch.cat(embeddings))

    def state_bytes(self) -> int:
        side = self.side
        model = side.encoder if isinstance(side, VisionSide) else side.lm
        return held_state_bytes(model, side.opt)["total"]

    def close(self) -> None:
        dist.barrier()
        dist.destroy_process_group()


def run_ray(config: MultimodalConfig, steps: int, per_group: int, address: str | None = None) -> dict[str, Any]:
    """Two actor groups on a local Ray cluster, or on the running cluster at ``address`` (``ray start``'s; also
    ``RAY_ADDRESS``): each group's actors in a placement group packed on one node where it fits, as a node's
    ranks under torchrun. The driver moves each step's tensors between them."""
    import ray

    gpus = 1 if torch.cuda.is_available() and torch.cuda.device_count() >= 2 * per_group else 0
    device = "cuda" if gpus else "cpu"
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        on_cpu = f"CPU (gloo): {count} GPU(s) for {2 * per_group} Ray actors, and NCCL needs one GPU per actor"
        print(f"zgraph demo --multimodal: device: {'one GPU per Ray actor (NCCL)' if gpus else on_cpu}")
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=2 * per_group, include_dashboard=False, log_to_driver=True)
    try:
        groups = {role: _actor_group(role, config, per_group, device, gpus) for role in ("vision", "text")}
        try:
            losses, held = _train_actors(groups, steps, config)
        except ray.exceptions.RayError as error:  # an actor died, or raised: name it, no Ray traceback
            raise _actor_failure(error, groups) from None
    finally:
        ray.shutdown()  # ends every actor, the ones waiting for a dead one included
    return _summary(losses, held, per_group, "Ray actors, one torch.distributed world per group", device)


def _actor_group(role: str, config: MultimodalConfig, per_group: int, device: str, gpus: int) -> list:
    """One side's actors, in a placement group packed on one node where it fits (``PACK``: spread over nodes
    rather than wait where no node has room), each given its rank and the rendezvous of its rank 0."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": 1, "GPU": 1} if gpus else {"CPU": 1}
    group = placement_group([bundle] * per_group, strategy="PACK")
    ray.get(group.ready(), timeout=RAY_PLACEMENT_TIMEOUT)
    actor = ray.remote(num_cpus=1, num_gpus=gpus)(SideActor)
    actors = [
        actor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
        ).remote(role, config, rank, per_group, device)
        for rank in range(per_group)
    ]
    host, port = ray.get(actors[0].rendezvous.remote())
    ray.get([a.setup.remote(host, port) for a in actors])
    return actors


RAY_PLACEMENT_TIMEOUT = 300  # seconds a group may wait for room on the cluster before the demo gives up


def _train_actors(groups: dict[str, list], steps: int, config: MultimodalConfig) -> tuple[list[float], list[int]]:
    """The driver's loop: each step's embeddings from the vision actors to the text actors (of a sequence group:
    all of its ranks' rows to each), their gradients back; returns the mean loss of each step and each actor's
    model state bytes."""
    import ray

    everyone, sp, per_group = groups["vision"] + groups["text"], config.sequence_parallel, len(groups["text"])
    group_of = [range(r - r % sp, r - r % sp + sp) for r in range(per_group)]  # rank r's sequence group
    losses = []
    for i in tqdm(range(steps), desc=f"zgraph multimodal ZeRO-{config.stage} (Ray)"):
        embeddings = [v.forward.remote(i) for v in groups["vision"]]
        results = [
            t.step.options(num_returns=2).remote(i, *[embeddings[q] for q in group_of[r]])
            for r, t in enumerate(groups["text"])
        ]
        ray.get([v.backward.remote(*[results[q][1] for q in group_of[r]]) for r, v in enumerate(groups["vision"])])
        losses.append(sum(ray.get([loss for loss, _ in results])) / per_group)
    held = ray.get([a.state_bytes.remote() for a in everyone])
    ray.get([a.close.remote() for a in everyone])
    return losses, held


def _actor_failure(error: Exception, groups: dict[str, list]) -> DemoRankError:
    """``DemoRankError`` naming the actor (side and rank) a Ray error reports dead or failing, and why."""
    text = str(error)
    names = {a._actor_id.hex(): f"{role} rank {r}" for role, actors in groups.items() for r, a in enumerate(actors)}
    named = [names[i] for i in re.findall(r"actor_id[=: ]+([0-9a-f]+)", text) if i in names]
    who = f"the {named[-1]} actor" if named else "an actor"
    cause = getattr(error, "cause", None)
    kind = type(cause if isinstance(cause, BaseException) else error).__name__
    return DemoRankError(
        f"{who} of the Ray actor groups failed ({kind}); the demo stopped every actor. Ray's report:\n{text}"
    )


# ------------------------------------------------------------------------------------------------ report
def _ulysses(config: MultimodalConfig) -> str:
    sp = config.sequence_parallel
    return f", Ulysses sequence parallelism over groups of {sp} LM ranks" if sp > 1 else ""


def report(summary: dict[str, Any], config: MultimodalConfig) -> str:
    """The closing lines: models and groups, losses beside eager's, model state per rank."""
    n = summary["per_group"]
    encoder, lm = build_models(config)
    losses, eager = summary["losses"], summary["eager_losses"]
    worst = max(abs(a - b) for a, b in zip(losses, eager))
    verdict = "matches" if worst <= LOSS_TOLERANCE and all(map(math.isfinite, losses)) else "DIFFERS FROM"
    where = "" if summary.get("device", "cpu") == "cpu" else f" on {summary['device']}, as the ranks"
    lines = [
        f"vision encoder ({count_params(encoder) / 1e3:.0f} K parameters) on ranks 0-{n - 1}, caption LM "
        f"({count_params(lm) / 1e6:.2f} M parameters) on ranks {n}-{2 * n - 1}; ZeRO-{config.stage} inside each "
        f"group{_ulysses(config)}; tensors cross by {summary['transport']}",
        f"loss (mean over the LM ranks): {losses[0]:.4f} -> {losses[-1]:.4f} after {len(losses)} steps",
        f"eager PyTorch, one process{where}, same combined model and global batch: {eager[0]:.4f} -> {eager[-1]:.4f}",
        f"zgraph {verdict} eager: largest loss difference over the steps {worst:.2e}",
        "model state per rank (params + grads + AdamW state) vs the side's unsharded state:",
    ]
    for rank, held in enumerate(summary["state_bytes"]):
        side, whole = ("vision", unsharded_state_bytes(encoder)) if rank < n else ("LM", unsharded_state_bytes(lm))
        lines.append(f"  rank {rank} ({side}): {human_bytes(held)} of {human_bytes(whole)} ({held / whole:.2f}x)")
    return "\n".join(lines)
