"""What ``benchmarks.gpu`` learns of the machine before it runs anything: the GPUs (probed in a fresh process),
which systems cannot run here and why (DeepSpeed, Triton, zgraph's host-update options), the machine's facts for
the report, and the GPU kit installed (``benchmarks.gpu_kit``)."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.compare_machine import cpu_model, last_lines, zgraph_revision
from benchmarks.gpu_report import GIB

ROOT = Path(__file__).resolve().parent.parent
DEEPSPEED = ("deepspeed-z3", "deepspeed-offload")
HOST_UPDATE = {"zgraph-host": ("offload_update",), "zgraph-host-overlap": ("offload_update", "offload_overlap")}
COMPILED = ("zgraph-inductor", "fsdp2-compiled")


_PROBE = """
import json, torch
count = torch.cuda.device_count()
props = torch.cuda.get_device_properties(0)
free, total = torch.cuda.mem_get_info(0)
print(json.dumps({"card": props.name, "count": count, "total": total, "free": free, "cuda": torch.version.cuda,
                  "torch": torch.__version__, "capability": list(torch.cuda.get_device_capability(0))}))
"""


def probe_gpus(timeout: float = 120) -> dict[str, Any]:
    """The GPUs as a fresh process sees them (this process keeps no CUDA context of its own, so the systems get
    the memory)."""
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError("probing the GPUs failed: " + last_lines(proc.stderr, 3))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def missing_options() -> dict[str, str]:
    """zgraph's host-update rows whose ``Config`` options this zgraph lacks, and why they cannot run."""
    import dataclasses

    import zgraph

    fields = {f.name for f in dataclasses.fields(zgraph.Config)}
    return {
        system: f"this zgraph's Config has no {', '.join(o for o in options if o not in fields)} (issue 43, items 1-3)"
        for system, options in HOST_UPDATE.items()
        if not set(options) <= fields
    }


def unavailable(deepspeed_why: str | None) -> dict[str, str]:
    """Systems that cannot run here, and why."""
    why: dict[str, str] = {s: deepspeed_why for s in DEEPSPEED if deepspeed_why}
    why.update(missing_options())
    if importlib.util.find_spec("triton") is None:
        why.update({s: "Triton is not installed (inductor compiles GPU kernels with it)" for s in COMPILED})
    return why


def host_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError):
        return float("nan")


def machine_facts(gpus: dict[str, Any], deepspeed: str) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "card": gpus["card"],
        "count": gpus["count"],
        "memory_gib": gpus["total"] / GIB,
        "free_gib": gpus["free"] / GIB,
        "capability": gpus.get("capability"),
        "torch": gpus["torch"],
        "cuda": gpus["cuda"],
        "deepspeed": deepspeed,
        "zgraph": zgraph_revision(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "host_gib": host_gib(),
        "python": platform.python_version(),
    }


def install_kit(kit: Path) -> str:
    """Install the GPU kit (zgraph from this checkout); what happened, for the report (a failure ends nothing)."""
    from benchmarks.gpu_kit import KitError, install

    try:
        install(kit, checkout=ROOT)
    except KitError as err:
        print(f"[kit ] not installed: {err}", flush=True)
        return f"not installed: {last_lines(str(err), 1)}"
    print(f"[kit ] installed {kit}", flush=True)
    return f"installed from {kit}"
