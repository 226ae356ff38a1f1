"""The fault matrix's slow cases (issue 25, item 5), outside the default suite: each runs a few times and prints
its outcome and how long every rank took to end.

* ``disk-full``: two ranks at ZeRO-3 on the NVMe tier; rank 1's disk fills up during the write-backs (ENOSPC on
  the I/O thread): rank 1 raises ``OffloadError`` naming the file and the cause, rank 0 ``RankFailedError``
  naming rank 1's error; rank 1's current copies and the checkpoint saved before are the last committed state.
* ``ray-actor``: ``zgraph demo --multimodal --launcher ray`` with one actor killed (SIGKILL) mid-run: the demo
  must exit 1 with ``zgraph demo: the <side> rank <r> actor ... failed``, never hang (needs ``zgraph[ray]``).

    python -m benchmarks.faults [--case disk-full|ray-actor|all] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


def disk_full() -> str:
    sys.path.insert(0, TESTS)
    from test_faults import _records

    import zgraph  # noqa: F401

    class Path(str):
        def __truediv__(self, name: str) -> str:
            return os.path.join(self, name)

    with tempfile.TemporaryDirectory() as directory:
        start = time.monotonic()
        codes, (rank0, rank1) = _records(Path(directory), "offload_disk_full", directory)
        first = lambda r: next((a for a in (r["step"], r["again"]) if a["error"]), None)
        e0, e1 = first(rank0), first(rank1)
        whole = rank1["copies_after"] == rank1["copies"]
        return (
            f"exit {codes}; rank 1: {e1['error'][0]} in {e1['seconds']:.1f} s; rank 0: {e0['error'][0]} in "
            f"{e0['seconds']:.1f} s; rank 1's current copies whole: {whole}; run {time.monotonic() - start:.0f} s"
        )


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below ``pid`` (from /proc)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append((int(entry), command))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def ray_actor(limit: float = 400) -> str:
    """Kill one SideActor a few seconds into training; how the demo ends and how long after the kill."""
    command = [sys.executable, "-m", "zgraph.cli", "demo", "--multimodal", "--launcher", "ray", "--steps", "400"]
    demo = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(demo.stdout), daemon=True).start()
    start, killed = time.monotonic(), None
    while demo.poll() is None and time.monotonic() - start < limit:
        actors = [p for p, c in _descendants(demo.pid) if c.startswith("ray::SideActor")]
        if killed is None and len(actors) == 4 and any("(Ray)" in line for line in lines[-5:]):
            time.sleep(3)  # a few steps in
            killed = (actors[int(time.time()) % 4], time.monotonic())
            os.kill(killed[0], signal.SIGKILL)
        time.sleep(0.5)
    hung = demo.poll() is None
    if hung:
        os.killpg(demo.pid, signal.SIGKILL)
    demo.wait()
    named = next((line.strip()[:110] for line in lines if line.startswith("zgraph demo:")), "no zgraph demo: line")
    after = f"{time.monotonic() - killed[1]:.1f} s after the kill" if killed else "no actor killed"
    return f"{'HUNG, killed' if hung else f'exit {demo.returncode}'} {after}: {named}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=["disk-full", "ray-actor", "all"], default="all")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cases = {"disk-full": disk_full, "ray-actor": ray_actor}
    for name, case in cases.items():
        if args.case not in (name, "all"):
            continue
        if name == "ray-actor" and __import__("importlib").util.find_spec("ray") is None:
            print(f"{name}: skipped (Ray is not installed: pip install 'zgraph[ray]')")
            continue
        for run in range(args.runs):
            print(f"{name} run {run + 1}: {case()}", flush=True)


if __name__ == "__main__":
    main()
