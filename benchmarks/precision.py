"""Low-precision model states: memory on the ~100M GPT, and convergence on the demo GPT.

    python -m benchmarks.precision memory        # ZeRO-3, 2 ranks: fp32 master vs bf16 master+grads+states
    python -m benchmarks.precision convergence   # demo GPT, 300 steps, 2 ranks: fp32 vs bf16 low precision
    python -m benchmarks.precision overlap       # the same run: update on the host, exact vs one step late

``memory``: model-state bytes per rank (parameters, gradients, optimizer state; counted from the live state and by
the dispatch-mode tracker of every allocation since the model was built) after two steps that leave ``.grad``, and
the process's peak resident memory (VmHWM). ``convergence``: the mean-over-ranks loss of every step, for both
settings, written to JSON and plotted to PNG. ``overlap``: the same convergence run with the optimizer update on the
host (``offload_optimizer="cpu", offload_update="host"``), exact against ``offload_overlap="one_step"`` (each
step's update applied one step late). Results go to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zgraph
from zgraph.demos.data import VOCAB, corpus_tokens
from zgraph.demos.gpt_demo import DEMO_GPT, rank_batch
from zgraph.demos.models import GPT, GPT_100M, count_params, lm_loss
from zgraph.runtime.memory import LiveTensorBytes, state_bytes

RESULTS = os.path.join(os.path.dirname(__file__), "results")

# The seeds' recipe: bf16 master weights, gradients and Adam states, with ``torch.autocast`` in the step.
SETTINGS = {
    "fp32": {"config": {}, "autocast": False},
    "bf16": {"config": {"master_dtype": torch.bfloat16, "optimizer_state_dtype": torch.bfloat16}, "autocast": True},
}
# The update on the host (issue 43): exact, and each step's update applied one step late (ZenFlow / SuperOffload).
HOST = {"offload_optimizer": "cpu", "offload_update": "host", "param_persistence_threshold": 0}  # all sharded
OVERLAP_SETTINGS = {
    "exact": {"config": HOST, "autocast": False},
    "one_step": {"config": {**HOST, "offload_overlap": "one_step"}, "autocast": False},
}


def _forward_loss(model, idx, tgt, autocast: bool):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return lm_loss(model(idx), tgt)


def _all_gather_json(value: dict) -> list:
    """Every rank's JSON-able ``value`` (as UTF-8 bytes in uint8 tensors: object collectives need numpy)."""
    mine = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)
    world = dist.get_world_size()
    sizes = torch.empty(world, dtype=torch.int64)
    dist.all_gather_into_tensor(sizes, torch.tensor([mine.numel()]))
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    padded[: mine.numel()] = mine
    rows = torch.empty(world * padded.numel(), dtype=torch.uint8)
    dist.all_gather_into_tensor(rows, padded)
    rows = rows.view(world, -1)
    return [json.loads(bytes(rows[r, : int(sizes[r])].tolist())) for r in range(world)]


def _vm_hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _step_keeping_grads(model, opt, idx, tgt, autocast: bool):
    loss = _forward_loss(model, idx, tgt, autocast)
    loss.backward()
    opt.step()
    return loss


def _train_step(model, opt, idx, tgt, autocast: bool):
    loss = _forward_loss(model, idx, tgt, autocast)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _rank_env(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def memory_rank(rank: int, world: int, port: int, setting: str, out: str) -> None:
    _rank_env(rank, world, port)
    config = zgraph.Config(stage=3, backend="eager", **SETTINGS[setting]["config"])
    autocast = SETTINGS[setting]["autocast"]
    tracker = LiveTensorBytes()
    with tracker:
        torch.manual_seed(0)
        model = GPT(GPT_100M)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = zgraph.distribute(config)(_step_keeping_grads)
        g = torch.Generator().manual_seed(rank)
        idx = torch.randint(0, GPT_100M.vocab, (2, GPT_100M.seq), generator=g)
        for _ in range(2):
            loss = float(step(model, opt, idx, idx.roll(-1, dims=1), autocast))
        gc.collect()
    held = state_bytes(model, opt)
    result = {
        "setting": setting,
        "params": count_params(model) if rank == 0 else None,
        "state_bytes": held,
        "tracked_bytes": tracker.current,
        "peak_tracked_bytes": tracker.peak,
        "vm_hwm_mib": _vm_hwm_mib(),
        "loss": loss,
    }
    everyone = _all_gather_json(result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)
    dist.barrier()
    dist.destroy_process_group()


def convergence_rank(rank: int, world: int, port: int, setting: str, steps: int, out: str) -> None:
    _rank_env(rank, world, port)
    settings = {**SETTINGS, **OVERLAP_SETTINGS}
    config = zgraph.Config(stage=3, backend="eager", **settings[setting]["config"])
    autocast = settings[setting]["autocast"]
    torch.manual_seed(0)
    model = GPT(DEMO_GPT)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    step = zgraph.distribute(config)(_train_step)
    tokens = corpus_tokens()
    generator = torch.Generator().manual_seed(0)
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        idx, tgt = rank_batch(tokens, 8, rank, world, generator)
        loss = step(model, opt, idx, tgt, autocast).detach().float().clone()
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"setting": setting, "losses": losses, "seconds": time.perf_counter() - start}, f)
    dist.barrier()
    dist.destroy_process_group()


def _spawn(fn, *args) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(fn, args=(2, port, *args), nprocs=2, start_method="spawn")


def memory() -> dict:
    results = {}
    for setting in SETTINGS:
        path = os.path.join(RESULTS, f"precision_memory_{setting}.json.tmp")
        _spawn(memory_rank, setting, path)
        with open(path) as f:
            results[setting] = json.load(f)
        os.remove(path)
    fp32, bf16 = results["fp32"][0], results["bf16"][0]
    reduction = 1 - bf16["state_bytes"]["total"] / fp32["state_bytes"]["total"]
    report = {"model": f"GPT {fp32['params'] / 1e6:.0f}M", "ranks": 2, "stage": 3, "results": results}
    report["model_state_reduction"] = reduction
    with open(os.path.join(RESULTS, "precision_memory.json"), "w") as f:
        json.dump(report, f, indent=2)
    lines = [
        f"{report['model']} parameters, ZeRO-3 on 2 ranks (gloo, 1 thread each), AdamW, 2 steps leaving .grad",
        "",
        "| setting | params MiB/rank | grads MiB/rank | optimizer MiB/rank | model state MiB/rank | tracker MiB | "
        "peak RSS MiB/rank |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for setting, ranks in results.items():
        r = ranks[0]
        s = r["state_bytes"]
        mib = 1024 * 1024
        lines.append(
            f"| {setting} | {s['params'] / mib:.1f} | {s['grads'] / mib:.1f} | {s['optimizer'] / mib:.1f} | "
            f"{s['total'] / mib:.1f} | {r['tracked_bytes'] / mib:.1f} | {max(x['vm_hwm_mib'] for x in ranks):.0f} |"
        )
    lines.append("")
    lines.append(f"model-state reduction, bf16 vs fp32: {reduction:.1%}")
    text = "\n".join(lines)
    with open(os.path.join(RESULTS, "precision_memory.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return report


def convergence(steps: int, settings: dict | None = None, name: str = "precision_convergence") -> dict:
    """The convergence run of each of ``settings`` (default: fp32 and bf16), reported as ``name`` (JSON, PNG,
    Markdown): the second setting's final loss against the first's."""
    settings = settings or SETTINGS
    runs = {}
    for setting in settings:
        path = os.path.join(RESULTS, f"{name}_{setting}.json.tmp")
        _spawn(convergence_rank, setting, steps, path)
        with open(path) as f:
            runs[setting] = json.load(f)
        os.remove(path)

    def tail_mean(losses: list[float]) -> float:
        tail = losses[-20:]
        return sum(tail) / len(tail)

    final = {s: tail_mean(r["losses"]) for s, r in runs.items()}
    first, second = list(runs)
    gap = final[second] / final[first] - 1
    report = {"steps": steps, "final_loss_mean_last_20": final, "relative_gap": gap, "runs": runs}
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=2)
    _plot(runs, os.path.join(RESULTS, f"{name}.png"))
    text = (
        f"demo GPT ({VOCAB}-token bytes, d_model {DEMO_GPT.d_model}, {DEMO_GPT.layers} layers), ZeRO-3 on 2 ranks, "
        f"{steps} steps, global batch 16 x {DEMO_GPT.seq}\n\n"
        "| setting | first loss | final loss (mean of last 20) | seconds |\n|---|---:|---:|---:|\n"
        + "\n".join(f"| {s} | {r['losses'][0]:.3f} | {final[s]:.4f} | {r['seconds']:.0f} |" for s, r in runs.items())
        + f"\n\n{_LABELS[second]} vs {_LABELS[first]}: {gap:+.2%} final loss\n"
    )
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)
    return report


_LABELS = {
    "fp32": "fp32 master, grads, Adam states",
    "bf16": "bf16 master, grads, Adam states + autocast",
    "exact": "update on the host, exact",
    "one_step": "update on the host, one step late",
}


def _plot(runs: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:  # the test environment has no numpy: the JSON and Markdown are written all the same
        print(f"matplotlib is not installed: {path} not drawn")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for setting, run in runs.items():
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], label=_LABELS[setting], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over 2 ranks)")
    ax.set_title("zgraph ZeRO-3, demo GPT on local text")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("memory", "convergence", "overlap"))
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    if args.what == "memory":
        memory()
    elif args.what == "overlap":
        convergence(args.steps, OVERLAP_SETTINGS, "host_update_overlap")
    else:
        convergence(args.steps)


if __name__ == "__main__":
    main()
