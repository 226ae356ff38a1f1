"""``Config(memory_budget=...)`` on a ~100M GPT (issue 29): what the planner chooses at five budgets, the peak it
predicts against the peak measured, and the step time against plain, selective and full remat; 2 gloo ranks, stage 3.

The parent estimates, without running anything (``zgraph.inspect.budget.prepare_plan`` once, then
``estimate_variant`` / ``plan_prepared``): the plain step's peak (the unconstrained peak) and the smallest peak of
the combinations the planner may choose; the five budgets are evenly spaced between them, and each budget's plan is
made there. Then 2 ranks (``tests/dist_harness.py``'s ``run_ranks``, with a deadline) run, one configuration after
the other on a fresh model and AdamW: ``remat=None``, ``"selective"``, ``"full"`` (no budget) and each budget's plan
(``MemoryPlan.config``'s fields, planned in the parent: planning again on each rank's first call would cost ~100 s
per budget on 2 shared cores; ``tests/test_memory_budget.py`` runs that path); a plan equal to a configuration
already run is not run again. Per configuration: the first call (capture) is untimed, then ``--steps`` timed calls
(min / median / max), then one call measured by the live-tensor tracker (``estimate_cases.holding``: model state,
optimizer state and batch counted before the call, everything the call allocates; its ``.peak``), and the
resident-set high-water mark (VmHWM reset with ``/proc/self/clear_refs`` after the first call, read after the
last). Rank 0 saves after each configuration: a run past its deadline keeps what it measured.

``--compile`` (on by default; ``--no-compile`` skips it) adds one process, no process group: the plain PyTorch
step with ``torch.compile(model)`` (inductor), under ``torch._functorch.config.activation_memory_budget`` 1.0, 0.5
and 0.2, against the same eager step: time, and activation bytes at the peak (resident-set high-water mark above
the resident set before the call; the tracker does not see inside inductor's kernels). ``--compile-model`` picks
its model (default ``bench``: the 100M model's cold compile on one thread takes minutes per budget).

Timings are ratios measured side by side in one run on a shared machine: noisy, reported, never asserted.

    python -m benchmarks.memory_budget [--quick] [--model bench|100m] [--micro-batch 12] [--steps 3]
                                       [--no-compile] [--compile-model bench|100m] [--timeout 1500]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import zgraph
from benchmarks.compare_worker import reset_peak_rss, status_kib
from zgraph.binding.arguments import StepCall
from zgraph.demos.models import BENCH_GPT, GPT, GPT_100M, count_params, lm_loss
from zgraph.inspect.budget import candidates, plan_prepared, prepare_plan
from zgraph.inspect.estimate import estimate_variant

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"bench": BENCH_GPT, "100m": GPT_100M}
BUDGETS = 5
WORLD = 2
MiB = 2**20


def train_step(model, opt, idx, tgt):
    loss = lm_loss(model(idx), tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def base_config() -> zgraph.Config:
    return zgraph.Config(stage=3, backend="eager")


def batch(model_name: str, micro_batch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    config = MODELS[model_name]
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, config.vocab, (micro_batch, config.seq), generator=g)
    return idx, torch.randint(0, config.vocab, (micro_batch, config.seq), generator=g)


def build(model_name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(MODELS[model_name])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


# --- the parent: estimates and plans, nothing runs -------------------------------------------------------------


def plan_budgets(model_name: str, micro_batch: int) -> dict:
    """The unconstrained and smallest estimated peaks per rank, the five budgets and each one's plan."""
    model, opt = build(model_name)
    call = StepCall.of(train_step, (model, opt, *batch(model_name, micro_batch, 0)), {})
    config = base_config()
    start = time.perf_counter()
    prepared = prepare_plan(call, config, WORLD)
    combos = {repr(c): estimate_variant(prepared, config.replace(**c)) for c in candidates(config, "cpu", True)}
    fixed = {name: estimate_variant(prepared, config.replace(remat=name)) for name in (None, "selective", "full")}
    high = fixed[None].peak_bytes
    low = min(e.peak_bytes for e in combos.values())
    budgets = [int(high - i * (high - low) / (BUDGETS - 1)) for i in range(BUDGETS)]
    plans = []
    for budget in budgets:
        plan = plan_prepared(prepared, config, budget)
        e = plan.chosen.estimate
        plans.append(
            {
                "budget": budget,
                "chosen": plan.chosen.describe(),
                "changes": _jsonable(plan.chosen.changes),
                "estimated_peak": e.peak_bytes,
                "estimated_step_s": e.step_seconds,
                "considered": plan.considered,
                "lines": plan.lines(),
            }
        )
    state = fixed[None].model_state_bytes
    return {
        "params": count_params(model),
        "model_state_bytes_per_rank": state,
        "unconstrained_peak": high,
        "smallest_peak": low,
        "smallest_combination": min(combos, key=lambda k: combos[k].peak_bytes),
        "fixed": {
            str(k): {"estimated_peak": e.peak_bytes, "estimated_step_s": e.step_seconds} for k, e in fixed.items()
        },
        "plans": plans,
        "planning_s": time.perf_counter() - start,
    }


def _jsonable(changes: dict) -> dict:
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in changes.items()}


# --- the ranks ---------------------------------------------------------------------------------------------------


def ranks(rank: int, world: int, out: str, model_name: str, micro_batch: int, steps: int, runs: list) -> None:
    """Worker (``run_ranks``): every ``[name, config fields]`` of ``runs`` one after the other; rank 0 writes
    every rank's measurements as JSON to ``out``."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dist_harness import all_gather_values

    results = {}
    for name, fields in runs:
        mine = measure(rank, model_name, micro_batch, steps, base_config().replace(**fields))
        results[name] = {"fields": fields, "ranks": all_gather_values(mine)}
        if rank == 0:  # after each configuration: a run past its deadline keeps what it measured
            with open(out, "w") as f:
                json.dump(results, f)
        torch.distributed.barrier()


def measure(rank: int, model_name: str, micro_batch: int, steps: int, config: zgraph.Config) -> dict:
    """One configuration on this rank: first call untimed, ``steps`` timed calls, one call tracked."""
    from estimate_cases import holding

    model, opt = build(model_name)
    idx, tgt = batch(model_name, micro_batch, rank)
    step = zgraph.distribute(config)(train_step)
    gc.collect()
    start = time.perf_counter()
    losses = [float(step(model, opt, idx, tgt))]
    first = time.perf_counter() - start
    gc.collect()
    reset_peak_rss()
    rss_before = status_kib("VmRSS") * 1024
    times = []
    for _ in range(steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        losses.append(float(step(model, opt, idx, tgt)))
        times.append(time.perf_counter() - start)
    gc.collect()
    tracker = holding(model, opt, idx, tgt)
    with tracker:
        losses.append(float(step(model, opt, idx, tgt)))
    plan = step.memory_plan
    result = {
        "first_call_s": first,
        "times": times,
        "losses": losses,
        "peak": tracker.peak,
        "rss_before": rss_before,
        "rss_hwm": status_kib("VmHWM") * 1024,
        "plan": None if plan is None else plan.chosen.describe(),
        "plan_estimated_peak": None if plan is None else plan.chosen.estimate.peak_bytes,
    }
    del step, model, opt
    gc.collect()
    return result


# --- one process: torch.compile under activation_memory_budget --------------------------------------------------


def compiled(model_name: str, micro_batch: int, steps: int, fraction: float | None) -> dict:
    """In a fresh process (``--compiled-child``): the plain step, eager (``fraction`` None) or with
    ``torch.compile(model)`` under ``activation_memory_budget=fraction``; time and activation bytes at the peak."""
    import torch._functorch.config as functorch_config

    torch.set_num_threads(1)
    model, opt = build(model_name)
    idx, tgt = batch(model_name, micro_batch, 0)
    run = model
    if fraction is not None:
        functorch_config.activation_memory_budget = fraction
        run = torch.compile(model)
    start = time.perf_counter()
    for _ in range(2):  # compile (forward, then backward), and the optimizer's state made
        train_step(run, opt, idx, tgt)
    warm = time.perf_counter() - start
    times, rise = [], 0
    for _ in range(steps):
        gc.collect()
        reset_peak_rss()
        before = status_kib("VmRSS") * 1024
        start = time.perf_counter()
        train_step(run, opt, idx, tgt)
        times.append(time.perf_counter() - start)
        rise = max(rise, status_kib("VmHWM") * 1024 - before)
    return {"fraction": fraction, "warmup_s": warm, "times": times, "peak_rss_rise": rise}


def compiled_runs(model_name: str, micro_batch: int, steps: int, timeout: float) -> list[dict]:
    """Eager, then compiled at fractions 1.0, 0.5, 0.2: each in its own process (a fresh resident set)."""
    rows = []
    for fraction in (None, 1.0, 0.5, 0.2):
        cmd = [sys.executable, "-m", "benchmarks.memory_budget", "--compiled-child", str(fraction)]
        cmd += ["--compile-model", model_name, "--compile-micro-batch", str(micro_batch), "--steps", str(steps)]
        # freed blocks of 64 KiB and more go back to the system at once: the resident set follows the live bytes
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        except (subprocess.SubprocessError, ValueError, IndexError) as e:
            rows.append({"fraction": fraction, "error": f"{type(e).__name__}: {str(e)[-500:]}"})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# --- the report --------------------------------------------------------------------------------------------------


def summarize(plans: dict, measured: dict) -> list[dict]:
    """One row per configuration: estimate, measured peak (max over ranks), RSS, step time, checks."""
    estimates = {f"remat={k}": v["estimated_peak"] for k, v in plans["fixed"].items()}
    budgets = {f"budget {i}": p for i, p in enumerate(plans["plans"])}
    full = measured["remat=full"]
    full_median = statistics.median([statistics.median(r["times"]) for r in full["ranks"]])
    named = [(k, measured[k], None) for k in estimates if k in measured]
    named += [(k, measured[p["run"]], p) for k, p in budgets.items() if p["run"] in measured]
    rows = []
    for name, run, plan in named:
        rs = run["ranks"]
        estimated = plan["estimated_peak"] if plan else estimates[name]
        peak = max(r["peak"] for r in rs)
        medians = [statistics.median(r["times"]) for r in rs]
        median = statistics.median(medians)
        row = {
            "name": name,
            "budget": plan["budget"] if plan else None,
            "plan": plan["chosen"] if plan else None,
            "run": plan["run"] if plan else name,
            "estimated_peak": estimated,
            "measured_peak_per_rank": [r["peak"] for r in rs],
            "estimate_error": (peak - estimated) / estimated,
            "rss_hwm_per_rank": [r["rss_hwm"] for r in rs],
            "rss_before_per_rank": [r["rss_before"] for r in rs],
            "first_call_s": max(r["first_call_s"] for r in rs),
            "min_median_max_s": [min(min(r["times"]) for r in rs), median, max(max(r["times"]) for r in rs)],
            "losses_rank0": rs[0]["losses"],
        }
        if plan:
            row["measured_within_budget"] = peak <= plan["budget"]
            if plans["fixed"]["full"]["estimated_peak"] <= plan["budget"]:
                row["time_over_full"] = median / full_median
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    out = [
        "| run | budget MiB | plan | est. peak MiB | measured peak MiB (r0, r1) | error | fits | "
        "VmHWM MiB (r0, r1) | step s min / median / max | / full |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = f"{r['budget'] / MiB:.0f}" if r["budget"] else "-"
        fits = {True: "yes", False: "**NO**"}.get(r.get("measured_within_budget"), "-")
        over = f"{r['time_over_full']:.2f}" if "time_over_full" in r else "-"
        if r["name"] == "remat=full":
            over = "1.00"
        plan = r["plan"] or "-"
        if r["run"] != r["name"]:
            plan += f" (= the {r['run']} run)"
        out.append(
            f"| {r['name']} | {budget} | {plan} | {r['estimated_peak'] / MiB:.0f} | "
            + ", ".join(f"{p / MiB:.0f}" for p in r["measured_peak_per_rank"])
            + f" | {r['estimate_error']:+.2%} | {fits} | "
            + ", ".join(f"{p / MiB:.0f}" for p in r["rss_hwm_per_rank"])
            + " | "
            + " / ".join(f"{t:.2f}" for t in r["min_median_max_s"])
            + f" | {over} |"
        )
    return "\n".join(out)


def compiled_table(rows: list[dict]) -> str:
    out = ["| step | activation budget | warm-up s | step s min / median / max | peak RSS rise MiB |"]
    out.append("|---|---|---|---|---|")
    for r in rows:
        name = "eager" if r["fraction"] is None else "torch.compile"
        if "error" in r:
            out.append(f"| {name} | {r['fraction']} | error: {r['error'][:120]} | | |")
            continue
        t = r["times"]
        out.append(
            f"| {name} | {r['fraction'] if r['fraction'] is not None else '-'} | {r['warmup_s']:.1f} | "
            f"{min(t):.2f} / {statistics.median(t):.2f} / {max(t):.2f} | {r['peak_rss_rise'] / MiB:.0f} |"
        )
    return "\n".join(out)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def run_ranks_for(args: argparse.Namespace, plans: dict) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dist_harness import run_ranks

    runs = [[f"remat={r}", {"remat": r}] for r in (None, "selective", "full")]
    for i, p in enumerate(plans["plans"]):  # the plan's config as the ranks run it; one already run is not rerun
        same = [name for name, fields in runs if fields == p["changes"]]
        p["run"] = same[0] if same else f"budget {i}"
        if not same:
            runs.append([p["run"], p["changes"]])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        try:
            run_ranks(
                WORLD,
                "benchmarks.memory_budget.ranks",
                out,
                args.model,
                args.micro_batch,
                args.steps,
                runs,
                timeout=args.timeout,
            )
        except (TimeoutError, RuntimeError) as e:
            print(f"the ranks did not finish ({e}); keeping what they measured", flush=True)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the bench GPT, micro-batch 8, 2 timed steps")
    parser.add_argument("--model", choices=sorted(MODELS), default="100m")
    parser.add_argument("--micro-batch", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1500, help="seconds for all the ranks' runs")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--compile-model", choices=sorted(MODELS), default="bench")
    parser.add_argument("--compile-micro-batch", type=int, default=32)
    parser.add_argument("--compile-only", action="store_true", help="add the compile part to the saved results")
    parser.add_argument("--compiled-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.compiled_child is not None:
        fraction = None if args.compiled_child == "None" else float(args.compiled_child)
        print(json.dumps(compiled(args.compile_model, args.compile_micro_batch, args.steps, fraction)))
        return
    if args.quick:
        args.model, args.micro_batch, args.steps, args.compile_micro_batch = "bench", 8, 2, 8
    name = "memory_budget_quick" if args.quick else "memory_budget"
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"{name}.json")
    torch.set_num_threads(1)
    if args.compile_only:
        with open(out) as f:
            result = json.load(f)
    else:
        result = planned_runs(args)
    if args.compile or args.compile_only:
        load = {"before": uptime()}
        rows = compiled_runs(args.compile_model, args.compile_micro_batch, args.steps, 900)
        load["after"] = uptime()
        result["compiled"] = {"model": args.compile_model, "micro_batch": args.compile_micro_batch, "rows": rows}
        result["compiled"]["load"] = load
        print(compiled_table(rows), flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    with open(out[: -len(".json")] + ".md", "w") as f:
        f.write(report(result))


def planned_runs(args: argparse.Namespace) -> dict:
    """The plans, then the ranks' runs; the results and the machine's load before and after."""
    load = {"before": uptime()}
    plans = plan_budgets(args.model, args.micro_batch)
    for p in plans["plans"]:
        print("\n".join(p["lines"]), flush=True)
    measured = run_ranks_for(args, plans)
    rows = summarize(plans, measured)
    print(table(rows), flush=True)
    load["after"] = uptime()
    return {
        "model": args.model,
        "stage": 3,
        "world": WORLD,
        "micro_batch": args.micro_batch,
        "seq": MODELS[args.model].seq,
        "steps": args.steps,
        "planning": plans,
        "rows": rows,
        "load": load,
    }


def report(result: dict) -> str:
    p = result["planning"]
    head = (
        f"{result['model']} GPT ({p['params'] / 1e6:.0f}M parameters), {result['world']} gloo ranks, stage 3, "
        f"micro-batch {result['micro_batch']} x {result['seq']} tokens; model state per rank (estimated) "
        f"{p['model_state_bytes_per_rank']['total'] / MiB:.0f} MiB; unconstrained peak "
        f"{p['unconstrained_peak'] / MiB:.0f} MiB, smallest {p['smallest_peak'] / MiB:.0f} MiB "
        f"({p['smallest_combination']}); planning {p['planning_s']:.0f} s.\n"
        f"Load: before `{result['load']['before']}`, after `{result['load']['after']}`.\n\n"
    )
    body = head + table(result["rows"]) + "\n"
    if "compiled" in result:
        c = result["compiled"]
        body += f"\nOne process, {c['model']} GPT, micro-batch {c['micro_batch']} "
        body += f"(load: before `{c['load']['before']}`, "
        body += f"after `{c['load']['after']}`):\n\n" + compiled_table(c["rows"]) + "\n"
    return body


if __name__ == "__main__":
    main()
