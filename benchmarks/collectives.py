"""One collective at a time on 2 gloo ranks: what each way of reducing and gathering costs (wall and CPU).

    python -m benchmarks.collectives [--mib 4 15] [--calls 25]

Per size, rank 0 prints the median over ``--calls`` calls (after 5 warm-up calls, each started after a barrier)
of the wall time and the process CPU time (all threads: gloo's included) of:

- ``all_reduce``; ``reduce_scatter_tensor``; ``all_gather_into_tensor`` of the half;
- ``all_to_all_single`` + the sum of the two received chunks: zgraph's reduce-scatter on gloo
  (``zgraph.graph.reduce_scatter_by_all_to_all``);
- ``isend``/``irecv`` of the other half + add: a point-to-point reduce-scatter, for reference.

One thread per rank (``OMP_NUM_THREADS=1``), as ``benchmarks.compare``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.compare_machine import free_port

WARMUP = 5


def _ways(n: int, rank: int) -> dict:
    x = torch.randn(n)
    half = torch.empty(n // 2)
    whole = torch.empty(n)
    peer = 1 - rank

    def point_to_point() -> None:
        send = dist.isend(x.view(2, -1)[peer].contiguous(), peer)
        recv = dist.irecv(half, peer)
        send.wait()
        recv.wait()
        half.add_(x.view(2, -1)[rank])

    def all_to_all_and_sum() -> None:
        dist.all_to_all_single(whole, x)
        whole.view(2, -1).sum(0)

    return {
        "all_reduce": lambda: dist.all_reduce(x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(half, x),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(whole, half),
        "all_to_all_single + sum": all_to_all_and_sum,
        "isend/irecv + add": point_to_point,
    }


def _run(rank: int, port: int, sizes: list[float], calls: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for mib in sizes:
        for name, call in _ways(int(mib * 2**20) // 4 // 2 * 2, rank).items():
            wall, cpu = [], []
            for i in range(WARMUP + calls):
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                call()
                if i >= WARMUP:
                    wall.append(time.perf_counter() - start)
                    cpu.append(time.process_time() - start_cpu)
            if rank == 0:
                print(f"{mib:g} MiB  {name:24s} wall {statistics.median(wall) * 1e3:6.2f} ms  "
                      f"CPU {statistics.median(cpu) * 1e3:6.2f} ms", flush=True)  # fmt: skip
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[4, 15], help="sizes of the whole tensor")
    parser.add_argument("--calls", type=int, default=25)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_run, args=(free_port(), args.mib, args.calls), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
