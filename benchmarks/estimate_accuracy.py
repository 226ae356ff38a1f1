"""``step.estimate`` against real steps: the bench GPT at 1, 2 and 4 ranks, every stage, fp32 and the bf16 recipe.

    python benchmarks/estimate_accuracy.py [--worlds 1 2 4] [--model gpt-bench] [--cases 1:bf16 3:fp32 ...]
        [--out benchmarks/results/estimate_accuracy.json]

Each case runs the step for real (gloo ranks spawned by ``tests/dist_harness.py``), estimates its next call on the
same state and measures that call (``tests/estimate_cases.py``): model state between steps (``state_bytes``),
the live-tensor tracker's peak, the graph's collectives. Prints a markdown table (``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [[stage, recipe] for recipe in ("fp32", "bf16") for stage in range(4)]


def run(worlds: list[int], model: str = "gpt-bench", cases: list[list] = CASES) -> list[dict]:
    """Measure and estimate every ``[stage, recipe]`` of ``cases`` on ``model`` at each world size; prints rows."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import estimate_cases
    from dist_harness import run_ranks

    rows = []
    for world in worlds:
        if world == 1:
            results = [estimate_cases.compare(stage, recipe, model_name=model) for stage, recipe in cases]
        else:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "cases.json")
                run_ranks(world, "estimate_cases.ranks", [[*case, model] for case in cases], out, timeout=3600)
                with open(out) as f:
                    results = json.load(f)
        for case in results:
            rows.append({"world": world, **case})
            print(row(rows[-1]), flush=True)
    return rows


def row(case: dict) -> str:
    m, e = case["measured"], case["estimated"]
    state = e["model_state_bytes"]["total"] - e["model_state_bytes"]["buffers"]
    held = m["state"]["total"]
    exact = "yes" if e["comm_bytes"] == m["comm_bytes"] and e["comm_count"] == m["comm_count"] else "NO"
    comm = sum(m["comm_bytes"].values())
    return (
        f"| {case['world']} | {case['stage']} | {case['recipe']} | {held / 2**20:.2f} | {state / 2**20:.2f} | "
        f"{(state - held) / held:+.2%} | {m['peak'] / 2**20:.2f} | {e['peak_bytes'] / 2**20:.2f} | "
        f"{(e['peak_bytes'] - m['peak']) / m['peak']:+.2%} | {comm / 2**20:.2f} | {exact} |"
    )


HEADER = (
    "| ranks | stage | recipe | state MiB (measured) | state MiB (estimated) | error | peak MiB (measured) | "
    "peak MiB (estimated) | error | comm MiB/step | comm exact |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--model", choices=["gpt-bench", "gpt-100m"], default="gpt-bench")
    parser.add_argument("--cases", nargs="+", metavar="STAGE:RECIPE", help="default: stages 0-3, fp32 and bf16")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "estimate_accuracy.json"))
    args = parser.parse_args()
    cases = [[int(c.split(":")[0]), c.split(":")[1]] for c in args.cases] if args.cases else CASES
    print(HEADER, flush=True)
    rows = run(args.worlds, args.model, cases)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
