"""Cost model of collectives (latency + bytes / bandwidth) and of compute, for bucket sizes and schedules.

``fit_cost_model`` times each collective kind on the real process group, taking the *fastest* of several calls
at each size: other work on the machine only ever adds time, so the minimum is the collective's own cost, and a
measurement taken while the machine is busy does not leave a model that puts every gradient into one bucket.
The latency is measured, not fitted: it is the fastest call of a one-element collective. A free least-squares
intercept over a few large sizes is dominated by their noise (on a 2-core machine it came out at or below zero,
so every ``"auto"`` bucket fell to the minimum size); the bandwidth is then fitted through that latency
(``seconds = latency + bytes / bandwidth``) at three sizes. It also times a
matmul and a copy for compute and memory speed. On CUDA every timed call ends with a device synchronisation
(collectives and kernels are queued, not run, when the call returns; timing the call alone would measure kernel
launches). The result is cached per machine, device type, the backend that serves that device (a mixed
``cpu:gloo,cuda:nccl`` group is NCCL for CUDA state) and world size (``$XDG_CACHE_HOME/zgraph``), so only the
first run on a machine pays the second or so it takes. Rank 0's numbers are broadcast, so every rank plans
identically.
``analytical_cost_model`` gives fixed defaults where measuring is off or impossible.

Two link classes: within a node (``collectives``: what is measured, or the analytical defaults) and across nodes
(``inter_node``). The across-node class is never measured: on one machine every rank shares its loopback or NVLink,
so a measurement would price it as the within-node class. It comes from arguments (``inter_node_costs``: the
link's Gbit/s per rank and a latency), else from ``INTER_NODE`` defaults — round guesses, not measurements.
Whether a collective's group crosses nodes is known from its ranks and the ranks per node
(``crossing_groups``); ``collective_seconds(kind, nbytes, crosses_nodes=True)`` prices it on the slower class.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch
import torch.fx as fx

from zgraph.graph import PRICED_AS, reduce_scatter_by_all_to_all
from zgraph.runtime.agreement import Channel
from zgraph.runtime.devices import served_backend, synchronize
from zgraph.runtime.hybrid import crosses_nodes
from zgraph.runtime.process_group import ProcessGroupInfo

KINDS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
LINK_CLASSES = ("intra_node", "inter_node")
# across-node defaults per backend: (Gbit/s of each rank's link, seconds of latency); guesses, pass your own
INTER_NODE = {"nccl": (100.0, 30e-6), None: (4.0, 300e-6)}


@dataclass(frozen=True)
class CollectiveCost:
    """``seconds(nbytes) = latency + nbytes / bandwidth``; ``nbytes`` is the whole (gathered) tensor's size."""

    latency: float
    bandwidth: float

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class CostModel:
    """Costs the planning passes use. ``source``: ``measured``, ``cached`` or ``analytical`` (of ``collectives``,
    the within-node class). ``inter_node``: collective costs across nodes (never measured: ``inter_node_costs``);
    None prices them as within a node."""

    collectives: dict[str, CollectiveCost]
    flops_per_second: float
    bytes_per_second: float
    source: str
    inter_node: dict[str, CollectiveCost] | None = None

    def collective_seconds(self, kind: str, nbytes: int, crosses_nodes: bool = False) -> float:
        """Seconds of collective ``kind`` on ``nbytes`` (the whole tensor), on the across-node link class where
        its group ``crosses_nodes``."""
        return self._link(crosses_nodes)[kind].seconds(nbytes)

    def bucket_bytes(self, kind: str, latency_share: float = 0.1, crosses_nodes: bool = False) -> int:
        """Smallest bucket whose latency is at most ``latency_share`` of its transfer time."""
        cost = self._link(crosses_nodes)[kind]
        return int(cost.latency * cost.bandwidth / latency_share)

    def _link(self, crosses_nodes: bool) -> dict[str, CollectiveCost]:
        return self.inter_node if crosses_nodes and self.inter_node is not None else self.collectives

    def to_json(self) -> dict:
        return {
            "collectives": {k: asdict(v) for k, v in self.collectives.items()},
            "flops_per_second": self.flops_per_second,
            "bytes_per_second": self.bytes_per_second,
        }

    @staticmethod
    def from_json(data: dict, source: str) -> CostModel:
        """The model ``to_json`` wrote; ``ValueError`` unless every kind and number is there, positive and finite."""
        try:
            collectives = {
                kind: CollectiveCost(
                    _positive(data["collectives"][kind]["latency"]), _positive(data["collectives"][kind]["bandwidth"])
                )
                for kind in KINDS
            }
            return CostModel(
                collectives, _positive(data["flops_per_second"]), _positive(data["bytes_per_second"]), source
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a zgraph cost model: {error!r}") from None


def _positive(value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
        raise ValueError(f"not a positive finite number: {value!r}")
    return float(value)


def analytical_cost_model(backend: str | None) -> CostModel:
    """Defaults: NCCL on one node (20 us, 100 GB/s; 100 TFLOP/s), or gloo over loopback TCP (150 us, 1 GB/s; a
    CPU core's 50 GFLOP/s); across nodes, ``INTER_NODE``'s (``inter_node_costs``)."""
    inter = inter_node_costs(backend)
    if backend == "nccl":
        link = CollectiveCost(20e-6, 100e9)
        return CostModel(dict.fromkeys(KINDS, link), 100e12, 1e12, "analytical", inter)
    link = CollectiveCost(150e-6, 1e9)
    return CostModel(dict.fromkeys(KINDS, link), 50e9, 5e9, "analytical", inter)


def inter_node_costs(
    backend: str | None, gbps: float | None = None, latency: float | None = None
) -> dict[str, CollectiveCost]:
    """Collective costs across nodes: ``gbps``, each rank's across-node link in Gbit/s, and ``latency``, seconds
    per collective (defaults: ``INTER_NODE[backend]``, else gloo's over TCP). A ring collective moves about the
    whole tensor through each rank's link, an all-reduce twice (a reduce-scatter, then an all-gather): its
    bandwidth is half the link's. ``ValueError`` unless ``gbps`` is positive and ``latency`` not negative."""
    default_gbps, default_latency = INTER_NODE.get(backend, INTER_NODE[None])
    gbps = default_gbps if gbps is None else gbps
    latency = default_latency if latency is None else latency
    if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not 0 < gbps < float("inf"):
        raise ValueError(f"inter_node_gbps must be a positive number of Gbit/s, got {gbps!r}")
    if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency < float("inf"):
        raise ValueError(f"the inter-node latency must be a non-negative number of seconds, got {latency!r}")
    link = gbps * 1e9 / 8
    return {kind: CollectiveCost(float(latency), link / 2 if kind == "all_reduce" else link) for kind in KINDS}


def with_inter_node(
    model: CostModel, backend: str | None, gbps: float | None = None, latency: float | None = None
) -> CostModel:
    """``model`` with its across-node class from ``inter_node_costs`` (kept where it has one and neither
    ``gbps`` nor ``latency`` is given)."""
    if model.inter_node is not None and gbps is None and latency is None:
        return model
    return dataclasses.replace(model, inter_node=inter_node_costs(backend, gbps, latency))


def collective_group(node: fx.Node) -> str | None:
    """The group a functional collective names: its last ``str`` argument."""
    names = [a for a in node.args if isinstance(a, str)]
    return names[-1] if names else None


def crossing_groups(group: ProcessGroupInfo, ranks_per_node: int | None = None) -> dict[str, bool]:
    """Whether each group a step on ``group`` names crosses nodes, by name: ``group`` itself (its ranks lie on more
    than one node of ``ranks_per_node`` consecutive ranks; ``hybrid.crosses_nodes``) and its axes."""
    ranks = list(group.ranks) if group.ranks is not None else list(range(group.world_size))
    crossing = {group.group_name: crosses_nodes(ranks, ranks_per_node)}
    for axis in (group.shard, group.replicate, group.secondary, group.sequence):
        if axis is not None:
            crossing[axis.name] = axis.crosses_nodes
    return crossing


def link_seconds(cost_model: object, kind: str, nbytes: int, crosses: bool) -> float:
    """``cost_model.collective_seconds`` on the link class ``crosses`` names (a model without link classes, any
    ``zgraph.graph.CostModel``, prices both alike); a kind of ``PRICED_AS`` as the kind it names."""
    kind = PRICED_AS.get(kind, kind)
    if crosses and isinstance(cost_model, CostModel):
        return cost_model.collective_seconds(kind, nbytes, crosses_nodes=True)
    return cost_model.collective_seconds(kind, nbytes)  # type: ignore[attr-defined]


def crosses(node: fx.Node, crossing: Mapping[str, bool] | None) -> bool:
    """Whether collective ``node``'s group crosses nodes per ``crossing`` (unknown groups: False)."""
    return bool(crossing) and bool(crossing.get(collective_group(node) or "", False))


_CACHE_VERSION = 5  # bumped when the measurement changes: older files are not read


def _cache_path(backend: str | None, device: str, world_size: int) -> str:
    """The cache file of ``backend`` (the one that serves ``device``) on ``device`` with ``world_size`` ranks."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = f"cost-v{_CACHE_VERSION}-{backend}-{device}-w{world_size}-{socket.gethostname()}.json"
    return os.path.join(root, "zgraph", name)


_SIZES = (64 * 1024, 1024 * 1024, 8 * 1024 * 1024)  # bytes of the whole tensor
_REPEATS = 7


def _fastest(fn: object, device: torch.device, sync: object = None, repeats: int = _REPEATS) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn`` (after one to warm up), each started together on
    every rank (after ``sync``) and timed until ``device`` has finished the work it queued."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if sync is not None:
            sync()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def _fit(latency: float, points: list[tuple[int, float]]) -> CollectiveCost:
    """``seconds = latency + bytes / bandwidth`` through the measured ``latency`` (at least a microsecond), the
    bandwidth by least squares over ``points``."""
    latency = max(latency, 1e-6)
    inverse = sum(b * (t - latency) for b, t in points) / sum(b * b for b, _ in points)
    if inverse <= 0:  # noise larger than the transfer: take the largest size's throughput
        inverse = points[-1][1] / points[-1][0]
    return CollectiveCost(latency, 1 / inverse)


def _collective(kind: str, nbytes: int, group: ProcessGroupInfo, device: torch.device) -> object:
    """One call of collective ``kind`` on a tensor of ``nbytes`` (the whole, gathered size), waited for."""
    c10d = torch.ops._c10d_functional
    world, name = group.world_size, group.group_name
    whole = torch.ones(nbytes // 4, device=device)
    shard = whole[: whole.numel() // world].clone()
    if kind == "all_gather_into_tensor":
        return lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(shard, world, name))
    if kind == "reduce_scatter_tensor" and reduce_scatter_by_all_to_all(served_backend(group.backend, device.type)):
        splits = [whole.numel() // world] * world
        table = whole[: splits[0] * world]
        chunks = lambda: c10d.wait_tensor(c10d.all_to_all_single(table, splits, splits, name)).view(world, -1)
        return lambda: chunks().sum(0).div_(world)
    if kind == "reduce_scatter_tensor":
        return lambda: c10d.wait_tensor(c10d.reduce_scatter_tensor(whole, "avg", world, name))
    return lambda: c10d.wait_tensor(c10d.all_reduce(whole, "avg", name))


def _measure(group: ProcessGroupInfo, device: torch.device) -> CostModel:
    c10d = torch.ops._c10d_functional
    flag = torch.zeros(1, device=device)
    sync = lambda: c10d.wait_tensor(c10d.all_reduce(flag, "sum", group.group_name))
    collectives = {}
    for kind in KINDS:
        latency = _fastest(_collective(kind, 4 * group.world_size, group, device), device, sync)  # a float per rank
        points = [(nbytes, _fastest(_collective(kind, nbytes, group, device), device, sync)) for nbytes in _SIZES]
        collectives[kind] = _fit(latency, points)
    a = torch.full((512, 512), 0.5, device=device)  # not drawn: the user's random generator stays as it was
    flops = 2 * 512**3 / _fastest(lambda: a @ a, device)
    big = torch.empty(8 * 1024 * 1024 // 4, device=device)
    bytes_per_s = 2 * big.numel() * 4 / _fastest(lambda: big.clone(), device)
    return CostModel(collectives, flops, bytes_per_s, "measured")


_FITTED: dict[tuple, CostModel] = {}


def fit_cost_model(
    group: ProcessGroupInfo, device: torch.device, measure: bool, channel: Channel | None = None
) -> CostModel:
    """The cost model for ``group``: cached file, fresh measurement, or analytical; identical on every rank.

    Collective: every rank of the group must call it at the same point. Rank 0's decision (its cached file, or
    its measurement) reaches the other ranks as JSON through ``channel``.
    """
    key = (group.group_name, group.world_size, str(device), measure)
    if key in _FITTED:
        return _FITTED[key]
    backend = served_backend(group.backend, device.type)
    if not group.distributed or not measure or channel is None:
        model = analytical_cost_model(backend)
    else:
        path = _cache_path(backend, device.type, group.world_size)
        cached = _read_cache(path) if group.rank == 0 else None
        decision = channel.broadcast("the collective cost model (cached?)", _encode(cached))
        model = _decode(decision, "cached")
        if model is None:
            measured = _measure(group, device)
            model = _decode(channel.broadcast("the collective cost model (measured)", _encode(measured)), "measured")
            if group.rank == 0:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path + ".tmp", "w") as f:
                    json.dump(model.to_json(), f)
                os.replace(path + ".tmp", path)
    model = with_inter_node(model, backend)
    _FITTED[key] = model
    return model


def _read_cache(path: str) -> CostModel | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return CostModel.from_json(json.load(f), "cached")
    except (OSError, ValueError):
        return None


def known_cost_model(backend: str, device_type: str, world_size: int) -> CostModel:
    """The cost model a step on ``world_size`` ranks of ``backend`` would use on this machine, without measuring:
    the cached measurement when one exists, else the analytical model (for estimates)."""
    cached = _read_cache(_cache_path(backend, device_type, world_size))
    return with_inter_node(cached, backend) if cached else analytical_cost_model(backend)


def _encode(model: CostModel | None) -> bytes:
    return b"" if model is None else json.dumps(model.to_json()).encode()


def _decode(payload: bytes, source: str) -> CostModel | None:
    return None if not payload else CostModel.from_json(json.loads(payload), source)
