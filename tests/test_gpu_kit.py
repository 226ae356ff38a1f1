"""The GPU kit (``benchmarks.gpu_kit``) on fake folders of small files, no network: its manifest, the refusals (over
the size limit, two versions of one project, no wheel, a wheel changed since), the requirements it takes from a
wheel, the offline install's commands; the bytes over PCIe read from a profiler trace (``benchmarks.gpu_pcie``); and
``python -m benchmarks.gpu --dry-run`` listing issue 43's offload rows."""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import gpu, gpu_kit  # noqa: E402
from benchmarks.gpu_kit import KitError  # noqa: E402
from benchmarks.gpu_pcie import copy_bytes  # noqa: E402

WHEELS = {
    "deepspeed-0.19.8-py3-none-any.whl": 300,
    "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.whl": 500,
    "zgraph-0.1.0-py3-none-any.whl": 200,
}


def fake_kit(folder: Path, wheels: dict[str, int] = WHEELS) -> Path:
    folder.mkdir(exist_ok=True)
    for name, size in wheels.items():
        (folder / name).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    return folder


def test_manifest_names_versions_hashes_and_sizes(tmp_path):
    kit = fake_kit(tmp_path / "kit")
    data = gpu_kit.write_manifest(kit)
    assert data == json.loads((kit / gpu_kit.MANIFEST).read_text())
    assert [(e["name"], e["version"], e["bytes"]) for e in data["wheels"]] == [
        ("deepspeed", "0.19.8", 300),
        ("pydantic-core", "2.50.5", 500),
        ("zgraph", "0.1.0", 200),
    ]
    first = data["wheels"][0]
    assert first["sha256"] == hashlib.sha256((kit / first["file"]).read_bytes()).hexdigest()
    assert data["total_bytes"] == 1000 and data["python"] == "3.12"


def test_a_kit_over_the_limit_is_refused_and_no_manifest_written(tmp_path):
    kit = fake_kit(tmp_path / "kit")
    with pytest.raises(KitError, match=r"over its limit of .* MiB.*largest: pydantic_core"):
        gpu_kit.write_manifest(kit, limit=999)
    assert not (kit / gpu_kit.MANIFEST).exists()
    assert gpu_kit.LIMIT_BYTES == 60 * 2**20


def test_two_versions_no_wheel_and_a_changed_wheel_are_refused(tmp_path):
    twice = fake_kit(tmp_path / "twice", {**WHEELS, "deepspeed-0.19.7-py3-none-any.whl": 10})
    with pytest.raises(KitError, match="two versions of deepspeed"):
        gpu_kit.manifest(twice)
    with pytest.raises(KitError, match="holds no wheel"):
        gpu_kit.manifest(fake_kit(tmp_path / "empty", {}))
    kit = fake_kit(tmp_path / "kit")
    gpu_kit.write_manifest(kit)
    (kit / "zgraph-0.1.0-py3-none-any.whl").write_bytes(b"y" * 200)  # same size, other bytes
    with pytest.raises(KitError, match="differs from manifest.json"):
        gpu_kit.install_commands(kit)
    with pytest.raises(KitError, match="no manifest.json"):
        gpu_kit.install_commands(fake_kit(tmp_path / "unbuilt"))


def test_install_is_offline_and_zgraph_goes_in_without_its_torch_requirement(tmp_path):
    kit = fake_kit(tmp_path / "kit")
    gpu_kit.write_manifest(kit)
    deps, ours = gpu_kit.install_commands(kit, python="py")
    assert deps[:4] == ["py", "-m", "pip", "install"] and "--no-index" in deps and str(kit) in deps
    assert deps[-2:] == ["deepspeed", "pydantic-core"]
    assert "--no-index" in ours and "--no-deps" in ours and ours[-1] == str(kit / "zgraph-0.1.0-py3-none-any.whl")
    _, editable = gpu_kit.install_commands(kit, checkout=tmp_path, python="py")
    assert editable[-2:] == ["-e", str(tmp_path)] and "--no-deps" in editable


def test_requirements_for_python_3_12_on_linux_less_torchs_own(tmp_path):
    wheel = tmp_path / "thing-1.0-py3-none-any.whl"
    lines = [
        "torch>=2.0",
        "sympy",
        "numpy",
        "pydantic>=2.0.0",
        'tomli; python_version < "3.11"',
        'pywin32; sys_platform == "win32"',
        'pytest; extra == "dev"',
    ]
    metadata = "Metadata-Version: 2.1\nName: thing\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in lines)
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("thing-1.0.dist-info/METADATA", metadata)
    assert gpu_kit.requirements(wheel) == ["numpy", "pydantic>=2.0.0"]
    with pytest.raises(KitError, match="not a wheel's file name"):
        gpu_kit.wheel_name(tmp_path / "thing.zip")


def test_pcie_bytes_counts_host_device_copies_only():
    trace = {
        "traceEvents": [
            {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "args": {"bytes": 4096}},
            {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "args": {"bytes": 1000}},
            {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "args": {"bytes": 4}},
            {"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "args": {"bytes": 10**9}},
            {"cat": "kernel", "name": "HtoD-looking kernel", "args": {"bytes": 7}},
        ]
    }
    assert copy_bytes(trace) == {"host_to_device": 4100, "device_to_host": 1000}


def test_dry_run_lists_the_offload_rows_of_issue_43(capsys):
    assert gpu.main(["--dry-run", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    offload = out.split("### One GPU")[1]
    for system in ("zgraph-host", "deepspeed-offload", "zgraph-host-overlap", "fsdp2-offload", "zgraph-offload"):
        assert f"| {gpu.LABELS[system]} |" in offload, system
    assert "PCIe GiB per step (bytes per parameter)" in offload and "host peak GiB" in offload
    assert "host optimizer: DeepSpeedCPUAdam" in offload
    assert "with offload_overlap=" in offload


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_profiled_bytes_runs_the_step_under_the_profiler():
    import torch

    from benchmarks.gpu_pcie import profiled_bytes

    ran = []
    moved = profiled_bytes(lambda: ran.append(torch.ones(8).sum()), lambda: None)
    assert len(ran) == 1 and moved == {"host_to_device": 0, "device_to_host": 0}  # a CPU step copies nothing
