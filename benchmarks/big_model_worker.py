"""The ranks of ``benchmarks.big_model``: one spawned process per rank (gloo, one thread), running one route's
phases on a Llama built on the meta device, each phase measured by ``probe`` (time, resident-set peaks).

Routes (``spec["route"]``):

- ``zgraph``: per repeat, the read baselines (``read_bytes``) then ``zgraph.load_pretrained(meta model, dir,
  config=Config(stage=3))``; then, ``save_repeats`` times, the write baseline (``write_bytes``) and
  ``zgraph.save_pretrained`` of the last loaded model.
- ``fsdp2``: ``fully_shard`` on each decoder layer and the root of a meta model, ``to_empty(device="cpu")``, rank 0
  reads the safetensors files into a full state dict, ``set_model_state_dict(full_state_dict=True,
  broadcast_from_rank0=True)``; save: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` and rank 0
  writes the same files with ``safetensors.torch.save_file``.
- ``hf``: ``LlamaForCausalLM.from_pretrained(dir)`` on every rank (the whole model in each), once; then every
  parameter read once (``touch``).

Each rank writes its measurements to ``<out>.<rank>`` (JSON).
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

READ_CHUNK = 16 << 20  # bytes per read() of the read baselines
SAMPLE_S = 0.01  # the RssAnon / RssFile sampler's period


def status_bytes(*fields: str) -> dict[str, int]:
    """Fields of ``/proc/self/status`` (kB values) in bytes."""
    with open("/proc/self/status") as f:
        text = f.read()
    out = {}
    for field in fields:
        found = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
        out[field] = int(found.group(1)) * 1024 if found else -1
    return out


class Sampler(threading.Thread):
    """Samples RssAnon and RssFile every ``SAMPLE_S`` (there is no high-water mark of either): their maxima. A
    lower bound of the true peaks, as the thread runs only when the measured code releases the GIL."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.peak = {"RssAnon": 0, "RssFile": 0}

    def run(self) -> None:
        while not self.stop.is_set():
            now = status_bytes("RssAnon", "RssFile")
            for key, value in now.items():
                self.peak[key] = max(self.peak[key], value)
            self.stop.wait(SAMPLE_S)


def probe(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, dict[str, float]]:
    """Run ``fn(*args, **kwargs)`` between two barriers: its result and ``{seconds: wall from the first barrier to
    the second (the slowest rank), own_s: this rank's own time, rss_before, hwm: VmHWM after resetting it right
    before, anon_before, anon_peak / file_peak: sampled, anon_after, file_after}`` (bytes)."""
    gc.collect()
    dist.barrier()
    before = status_bytes("VmRSS", "RssAnon")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    sampler = Sampler()
    sampler.start()
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    own = time.perf_counter() - start
    dist.barrier()
    wall = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    after = status_bytes("VmHWM", "RssAnon", "RssFile")
    peaks = sampler.peak
    return result, {
        "seconds": wall,
        "own_s": own,
        "rss_before": before["VmRSS"],
        "anon_before": before["RssAnon"],
        "hwm": after["VmHWM"],
        "anon_peak": max(peaks["RssAnon"], after["RssAnon"]),
        "file_peak": max(peaks["RssFile"], after["RssFile"]),
        "anon_after": after["RssAnon"],
        "file_after": after["RssFile"],
    }


def checkpoint_files(directory: str) -> list[str]:
    """The safetensors files of the checkpoint in ``directory`` (its index's, in order)."""
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    return [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]


def read_bytes(files: list[str], part: int = 0, parts: int = 1) -> int:
    """The read baseline: the bytes ``[part/parts, (part+1)/parts)`` of every file read into one reused buffer
    (``readinto``, ``READ_CHUNK`` at a time), nothing kept. ``parts=1``: every byte of every file."""
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    total = 0
    for path in files:
        size = os.path.getsize(path)
        start, stop = size * part // parts, size * (part + 1) // parts
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            while total_left := stop - f.tell():
                n = f.readinto(view[: min(READ_CHUNK, total_left)])
                if not n:
                    break
                total += n
    return total


def write_bytes(directory: str, sizes: list[int], writing: bool) -> int:
    """The write baseline: rank 0 (``writing``) writes files of ``sizes`` bytes from one reused buffer
    (``READ_CHUNK`` at a time), each fsynced and renamed into place, as ``save_pretrained`` writes its files."""
    if not writing:
        return 0
    os.makedirs(directory, exist_ok=True)
    buffer = memoryview(bytearray(b"\x01" * READ_CHUNK))
    for i, size in enumerate(sizes):
        path = os.path.join(directory, f"baseline-{i}.bin")
        with open(f"{path}.tmp", "wb", buffering=0) as f:
            for start in range(0, size, READ_CHUNK):
                f.write(buffer[: min(READ_CHUNK, size - start)])
            os.fsync(f.fileno())
        os.replace(f"{path}.tmp", path)
    shutil.rmtree(directory)
    return sum(sizes)


def meta_model(spec: dict) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**spec["config"])
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec["dtype"]))


def zgraph_route(rank: int, world: int, spec: dict) -> dict[str, list[dict]]:
    """Per repeat: read everything, read this rank's 1/world, load into a fresh meta model; then save."""
    import zgraph

    files = checkpoint_files(spec["dir"])
    out: dict[str, list[dict]] = {"read_all": [], "read_part": [], "load": [], "write_all": [], "save": []}
    sizes = [os.path.getsize(path) for path in files]
    read_bytes(files)  # untimed: the page cache warm (and the writer's dirty pages settled) before the first timing
    model = None
    for _ in range(spec["repeats"]):
        model = None  # the previous repeat's model freed before the next is laid out
        _, m = probe(read_bytes, files)
        out["read_all"].append(m)
        _, m = probe(read_bytes, files, rank, world)
        out["read_part"].append(m)
        model = meta_model(spec)
        _, m = probe(zgraph.load_pretrained, model, spec["dir"], config=zgraph.Config(stage=3))
        out["load"].append(m)
    for _ in range(spec["save_repeats"]):
        _, m = probe(write_bytes, spec["save_dir"] + "-baseline", sizes, rank == 0)
        out["write_all"].append(m)
        _, m = probe(zgraph.save_pretrained, model, spec["save_dir"], max_shard_size=spec["shard_bytes"])
        out["save"].append(m)
    return out


def fsdp2_shard(spec: dict, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = meta_model(spec)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp2_load(model: torch.nn.Module, files: list[str], rank: int) -> None:
    """FSDP2's meta-device route: storage for the shards, rank 0 reads the files, the values broadcast from it."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device="cpu")
    full: dict[str, torch.Tensor] = {}
    if rank == 0:
        for path in files:
            full.update(load_file(path))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)


def fsdp2_save(model: torch.nn.Module, spec: dict, files: list[str], rank: int) -> None:
    """FSDP2's documented save: the full state dict gathered to rank 0 on the host, written as the source's files."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    if rank != 0:
        return
    from safetensors import safe_open

    os.makedirs(spec["save_dir"], exist_ok=True)
    for path in files:
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
        target = os.path.join(spec["save_dir"], os.path.basename(path))
        save_file({n: full[n] for n in names}, target, metadata={"format": "pt"})
        with open(target, "rb") as f:
            os.fsync(f.fileno())  # as zgraph.save_pretrained does: the time to disk, not to the page cache
    index = os.path.join(os.path.dirname(files[0]), "model.safetensors.index.json")
    shutil.copy(index, spec["save_dir"])


def fsdp2_route(rank: int, world: int, spec: dict) -> dict[str, list[dict]]:
    files = checkpoint_files(spec["dir"])
    out: dict[str, list[dict]] = {"load": [], "save": []}
    model = None
    for _ in range(spec["repeats"]):
        model = None
        model = fsdp2_shard(spec, world)
        _, m = probe(fsdp2_load, model, files, rank)
        out["load"].append(m)
    for _ in range(spec["save_repeats"]):
        _, m = probe(fsdp2_save, model, spec, files, rank)
        out["save"].append(m)
    return out


def touch(model: torch.nn.Module) -> float:
    """Read every parameter once (a sum each), as a first step would: mapped file pages become resident."""
    with torch.no_grad():
        return float(sum(p.sum().float() for p in model.parameters()))


def hf_route(rank: int, world: int, spec: dict) -> dict[str, list[dict]]:
    """The issue's complaint: ``from_pretrained`` on every rank, each holding the whole model; then every
    parameter read once (transformers maps the safetensors files: its load reads nothing until then)."""
    from transformers import LlamaForCausalLM

    dtype = getattr(torch, spec["dtype"])
    model, load = probe(LlamaForCausalLM.from_pretrained, spec["dir"], dtype=dtype)
    _, touched = probe(touch, model)
    del model
    return {"load": [load], "touch": [touched]}


ROUTES = {"zgraph": zgraph_route, "fsdp2": fsdp2_route, "hf": hf_route}


def rank_main(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    """Entry of a spawned rank: the group, the route's phases, this rank's measurements written to ``out.rank``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    os.environ.update(HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = ROUTES[spec["route"]](rank, world, spec)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
