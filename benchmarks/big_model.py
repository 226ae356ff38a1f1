"""Big models loaded into and saved from shards (issue 27): a ~1.1B-parameter Llama at 1, 2 and 4 gloo ranks on
CPU — peak resident set per rank and time of ``zgraph.load_pretrained`` into a meta-device model at stage 3 and of
``zgraph.save_pretrained``, beside the model's size, the bytes of its files read once, FSDP2's meta-device route,
and ``from_pretrained`` on every rank.

    python -m benchmarks.big_model                      # ~1.1B Llama, bf16, worlds 1,2,4
    python -m benchmarks.big_model --quick              # a ~45M Llama, worlds 1,2, one repeat: a few minutes
    python -m benchmarks.big_model --worlds 2 --hidden 1024 --intermediate 2816 --layers 8 --routes zgraph

The checkpoint (sharded safetensors with an index and ``config.json``, random normal weights, norms at one) is
written once, a tensor at a time (never the whole model), into ``--dir``/``zgraph-big-model-<shape>``, reused by
later runs and removed at the end unless ``--keep``. Every route runs in fresh processes per world (one thread
each); the measured phases are described in ``benchmarks/big_model_worker.py`` and ``benchmarks/README.md``.
Results: ``benchmarks/results/big_model-<date>.md`` and ``.json`` (``--out-dir``; ``--no-write`` prints only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from benchmarks.big_model_report import markdown, summarize
from benchmarks.big_model_worker import checkpoint_files, rank_main

ROOT = Path(__file__).resolve().parent.parent
# TinyLlama-1.1B's shape: 1.100 B parameters
SHAPE = {"hidden": 2048, "intermediate": 5632, "layers": 22, "heads": 32, "kv_heads": 4, "vocab": 32000}
QUICK = {"hidden": 512, "intermediate": 1408, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 32000}


def llama_kwargs(shape: dict[str, int]) -> dict:
    return {
        "hidden_size": shape["hidden"],
        "intermediate_size": shape["intermediate"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "vocab_size": shape["vocab"],
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }


def _fill(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def write_checkpoint(directory: str, kwargs: dict, dtype: torch.dtype, shard_bytes: int) -> None:
    """Sharded safetensors + index + ``config.json`` of a meta-built Llama, one tensor in memory at a time."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zgraph.weights.safetensors_stream import Entry, StreamWriter, file_order
    from zgraph.weights.save import INDEX, METADATA, kept_names, split

    config = LlamaConfig(**kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = model.state_dict()
    names = kept_names(model, state)
    files = split([Entry(n, state[n].dtype, tuple(state[n].shape)) for n in names], shard_bytes)
    if len(files) == 1:  # always an index, as a checkpoint of this size has
        files = {"model-00001-of-00001.safetensors": next(iter(files.values()))}
    os.makedirs(directory, exist_ok=True)
    for filename, entries in files.items():
        with StreamWriter(os.path.join(directory, filename), entries, METADATA) as writer:
            for entry in file_order(entries):
                writer.write(entry.name, _fill(entry.name, entry.shape, entry.dtype, names.index(entry.name)))
    weight_map = {e.name: f for f, entries in files.items() for e in entries}
    total = sum(e.nbytes for entries in files.values() for e in entries)
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config.dtype = str(dtype).split(".")[1]
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(directory)


def checkpoint_dir(args: argparse.Namespace) -> tuple[str, float]:
    """The cached checkpoint's directory (written if absent or incomplete) and the seconds writing it took."""
    shape = "-".join(str(v) for v in args.shape.values())
    directory = os.path.join(args.dir, f"zgraph-big-model-{shape}-{args.dtype}-{args.shard_bytes}")
    done = os.path.join(directory, "COMPLETE")
    if os.path.exists(done):
        return directory, 0.0
    shutil.rmtree(directory, ignore_errors=True)
    start = time.perf_counter()
    write_checkpoint(directory, llama_kwargs(args.shape), getattr(torch, args.dtype), args.shard_bytes)
    Path(done).touch()
    return directory, time.perf_counter() - start


def same_tensors(source: str, saved: str) -> bool:
    """Whether the checkpoint ``saved`` holds exactly the tensors of ``source`` (read one at a time)."""
    from zgraph.weights.sources import Rows, open_source

    a, b = open_source(source), open_source(saved)
    try:
        if a.entries != b.entries:
            return False
        for name, entry in a.entries.items():
            whole = {name: Rows(None, None, entry.dtype)}
            if not torch.equal(a.read(whole)[name], b.read(whole)[name]):
                return False
        return True
    finally:
        a.close()
        b.close()


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return -1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, spec: dict, out: str, timeout: float) -> str | None:
    """``rank_main`` on ``world`` fresh ranks; None, or why they failed (a rank's error, or the deadline)."""
    context = mp.start_processes(
        rank_main, args=(world, free_port(), spec, out), nprocs=world, start_method="spawn", join=False
    )
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                return f"timed out after {timeout:.0f} s"
    except Exception as error:  # a rank raised: the others were ended by join
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        return " / ".join(lines[-2:])[-400:]
    return None


def run_route(args: argparse.Namespace, world: int, route: str, directory: str, scratch: str) -> dict:
    """One route on ``world`` ranks: every rank's measurements, the machine's load around it, the saved files
    checked against the source."""
    out = os.path.join(scratch, f"{route}-{world}.json")
    save_dir = os.path.join(scratch, f"saved-{route}-{world}")
    spec = {
        "route": route,
        "dir": directory,
        "save_dir": save_dir,
        "config": llama_kwargs(args.shape),
        "dtype": args.dtype,
        "repeats": args.repeats,
        "save_repeats": args.save_repeats,
        "shard_bytes": args.shard_bytes,
    }
    record: dict = {"world": world, "route": route, "loadavg_before": loadavg(), "mem_available": mem_available()}
    start = time.perf_counter()
    record["error"] = spawn(world, spec, out, args.timeout)
    record["wall_s"] = time.perf_counter() - start
    record["loadavg_after"] = loadavg()
    if record["error"] is None:
        record["ranks"] = []
        for rank in range(world):
            with open(f"{out}.{rank}") as f:
                record["ranks"].append(json.load(f))
        if route != "hf":
            record["saved_equal"] = same_tensors(directory, save_dir)
    shutil.rmtree(save_dir, ignore_errors=True)
    return record


def shard_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    text = text.strip().upper()
    return int(float(text[:-2]) * units[text[-2:]]) if text[-2:] in units else int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default=None, help="comma list of world sizes (default 1,2,4; --quick 1,2)")
    for key in SHAPE:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"default {SHAPE[key]}")
    parser.add_argument("--quick", action="store_true", help=f"a small Llama ({QUICK}) at worlds 1,2, 1 repeat")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="on disk and in memory")
    parser.add_argument("--shard-size", default="1GB", help="max bytes per safetensors file (decimal units)")
    parser.add_argument("--repeats", type=int, default=None, help="loads and saves per route (default 3; --quick 1)")
    parser.add_argument("--save-repeats", type=int, default=None, help="saves per route (default 2; --quick 1)")
    parser.add_argument("--routes", default="zgraph,fsdp2,hf", help="comma list of zgraph, fsdp2, hf")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one route at one world may take")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoint and saves go")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint for the next run")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tag", default="", help="results file big_model-<date>[-quick][-<tag>]")
    parser.add_argument("--no-write", action="store_true", help="print the table, write no results file")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else SHAPE
    args.shape = {k: getattr(args, k) if getattr(args, k) is not None else base[k] for k in SHAPE}
    args.worlds = [int(w) for w in (args.worlds or ("1,2" if args.quick else "1,2,4")).split(",")]
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.save_repeats = args.save_repeats or (1 if args.quick else 2)
    args.routes = args.routes.split(",")
    args.shard_bytes = shard_size(args.shard_size)
    unknown = set(args.routes) - {"zgraph", "fsdp2", "hf"}
    if unknown:
        parser.error(f"unknown routes {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    directory, write_s = checkpoint_dir(args)
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        model_bytes = json.load(f)["metadata"]["total_size"]
    files = len(checkpoint_files(directory))
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="zgraph-big-model-runs-", dir=args.dir) as scratch:
            for world in args.worlds:
                for route in args.routes:
                    runs.append(run_route(args, world, route, directory, scratch))
                    print(f"world {world} {route}: {runs[-1]['error'] or 'done'} ({runs[-1]['wall_s']:.0f} s)")
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    about = {
        "command": "python -m benchmarks.big_model " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": str(datetime.date.today()),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "shape": args.shape,
        "dtype": args.dtype,
        "model_bytes": model_bytes,
        "parameters": model_bytes // getattr(torch, args.dtype).itemsize,
        "files": files,
        "checkpoint_write_s": write_s,
        "repeats": args.repeats,
        "save_repeats": args.save_repeats,
    }
    summary = summarize(runs, model_bytes)
    text = markdown(about, summary)
    print(text)
    if not args.no_write:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        tag = ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else "")
        stem = args.out_dir / f"big_model-{about['date']}{tag}"
        stem.with_suffix(".md").write_text(text)
        stem.with_suffix(".json").write_text(json.dumps({"about": about, "summary": summary, "runs": runs}, indent=1))
        print(f"written to {stem}.md and .json")
    return {"about": about, "summary": summary, "runs": runs}


if __name__ == "__main__":
    main()
