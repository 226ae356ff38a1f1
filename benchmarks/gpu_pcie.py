"""Bytes over PCIe in one step of a ``benchmarks.gpu`` system, measured with torch's profiler: every host<->device
copy the step makes (CUDA's ``Memcpy HtoD`` / ``Memcpy DtoH`` activities, from any thread of the process: a
system's host-update thread too), summed from the ``bytes`` of the profiler's Chrome trace. Device-to-device and
peer copies are not counted. Used by ``benchmarks.gpu_worker --pcie`` on one step after the timed ones.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

DIRECTIONS = {"HtoD": "host_to_device", "DtoH": "device_to_host"}


def copy_bytes(trace: dict[str, Any]) -> dict[str, int]:
    """Bytes copied each way in a Chrome trace (``{"host_to_device": n, "device_to_host": m}``)."""
    out = dict.fromkeys(DIRECTIONS.values(), 0)
    for event in trace.get("traceEvents", []):
        if event.get("cat") != "gpu_memcpy":
            continue
        for marker, key in DIRECTIONS.items():
            if marker in event.get("name", ""):
                out[key] += int(event.get("args", {}).get("bytes", 0))
    return out


def profiled_bytes(run_step: Callable[[], Any], synchronize: Callable[[], None]) -> dict[str, int]:
    """``run_step()`` once under the profiler (CPU and CUDA activities); the bytes it copied each way."""
    from torch.profiler import ProfilerActivity, profile

    synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_step()
        synchronize()
    with tempfile.TemporaryDirectory(prefix="zgraph-pcie-") as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return copy_bytes(json.loads(path.read_text()))
