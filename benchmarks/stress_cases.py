"""The multi-rank programs ``benchmarks.stress`` loops over (each one process that starts its ranks).

    python -m benchmarks.stress_cases parity WORLD [STAGES]   # zero_cases at the stages (default 0,3)
    python -m benchmarks.stress_cases split WORLD [STAGES]    # split_cases (backward outside the step)
    python -m benchmarks.stress_cases offload WORLD           # stage 3, bf16, parameters and states in files
    python -m benchmarks.stress_cases gpt STEPS               # stage 3 GPT, bf16 states, global-norm clip

``parity``, ``split`` and ``offload`` run the test suite's workers (``tests/``) through its harness (spawned
ranks, faulthandler on, a deadline) and exit 1 if a case recorded an error (``offload`` checks bitwise
equality itself). ``gpt`` is the program of the CI SIGABRT: two spawned ranks that end through the
interpreter's own exit, no ``destroy_process_group``; it prints each rank's exit code or signal.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path.insert(0, TESTS)

from dist_harness import free_port, run_ranks  # noqa: E402


def run_workers(world: int, target: str, stages: list[int], names: list[str]) -> None:
    """``target`` (a ``run_cases``-like worker) on ``world`` ranks; exit 1 naming the cases that failed."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "results.pt")
        run_ranks(world, target, path, stages, names, timeout=900)
        results = torch.load(path, weights_only=False)
    failed = {key: r["error"] for key, r in results.items() if isinstance(r, dict) and "error" in r}
    for key, error in failed.items():
        print(f"case {key} failed:\n{error}", file=sys.stderr)
    print(f"{len(results) - len(failed)}/{len(results)} cases ran")
    sys.exit(1 if failed else 0)


def gpt_rank(rank: int, world: int, port: int, steps: int) -> None:
    """One rank of the stage-3 bf16 GPT with a global-norm clip; returns (the interpreter then exits)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import zgraph
    from zgraph.demos.models import GPT, GPTConfig, lm_loss

    shape = GPTConfig(vocab=256, d_model=64, layers=2, heads=4, seq=32)
    torch.manual_seed(0)
    model = GPT(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bf16 = torch.bfloat16
    config = zgraph.Config(stage=3, backend="eager", param_persistence_threshold=0, param_dtype=bf16)
    config = config.replace(optimizer_state_dtype=bf16, autocast_dtype=bf16)

    @zgraph.distribute(config)
    def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor, tgt: torch.Tensor):
        loss = lm_loss(model(idx), tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    idx = torch.randint(0, shape.vocab, (4, shape.seq), generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        loss = train_step(model, opt, idx, idx.roll(-1, 1))
    if not torch.isfinite(loss):
        raise RuntimeError(f"rank {rank}: loss {loss}")


def gpt(steps: int, world: int = 2) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    context = mp.start_processes(gpt_rank, (world, free_port(), steps), nprocs=world, join=False, start_method="spawn")
    for process in context.processes:
        process.join(600)
        if process.exitcode is None:
            process.kill()
            process.join()
    codes = [process.exitcode for process in context.processes]
    print("rank exits:", " ".join(str(c) for c in codes))
    sys.exit(0 if all(c == 0 for c in codes) else 1)


def main(argv: list[str]) -> None:
    what, number = argv[0], int(argv[1])
    stages = [int(s) for s in argv[2].split(",")] if len(argv) > 2 else [0, 3]
    if what == "parity":
        from zero_cases import CASES

        run_workers(number, "zero_cases.run_cases", stages, list(CASES))
    elif what == "split":
        from split_cases import CASES

        run_workers(number, "split_cases.run_split_cases", stages, list(CASES))
    elif what == "offload":
        run_ranks(number, "offload_cases.compare_params_ranks", "bf16", True, timeout=600)
    elif what == "gpt":
        gpt(number)
    else:
        sys.exit(f"unknown case {what!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
