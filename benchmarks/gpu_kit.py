"""The GPU kit: what our GPU machines lack for ``benchmarks.gpu``, as wheels in one folder of at most 60 MiB.

Those machines have Python 3.12 and torch 2.11 with CUDA, and no network. The kit holds DeepSpeed (its own wheel,
built here with ``DS_BUILD_OPS=0``: pure Python, its ops built just in time there), DeepSpeed's and zgraph's
requirements that torch 2.11 does not bring (``TORCH_REQUIRES``), ninja (DeepSpeed's JIT builds), and zgraph (a
wheel of this checkout), each a Python 3.12 manylinux x86-64 wheel, and ``manifest.json`` (names, versions,
sha256, sizes).

    python -m benchmarks.gpu_kit DIR              # here, PyPI reachable: build DIR (refused over 60 MiB)
    python -m benchmarks.gpu_kit --install DIR    # there, offline: check DIR against its manifest, install it

``--install`` runs ``pip install --no-index --find-links DIR`` on every requirement of the kit (pip's configuration
files ignored, so DIR is the only source), then zgraph with ``--no-deps``: zgraph declares torch>=2.13, the GPU
machines have 2.11 (``benchmarks/results/gpu-2026-11-27.md``). ``benchmarks.gpu --kit DIR`` installs zgraph from
the checkout it runs in instead (editable, as that run measures the checkout).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
LIMIT_BYTES = 60 * MIB
MANIFEST = "manifest.json"
DEEPSPEED = "deepspeed==0.19.8"
EXTRA = ("ninja",)  # DeepSpeedCPUAdam's just-in-time build runs ninja
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
# torch 2.11.0's requirements (its cp312 wheel's METADATA), and torch: present wherever that torch is. numpy is not
# among them. A package of the kit's that also needs one of these (typing-extensions, by pydantic) brings its own.
TORCH_REQUIRES = frozenset(
    (
        "torch filelock typing-extensions setuptools sympy networkx jinja2 fsspec cuda-toolkit cuda-bindings "
        "nvidia-cudnn-cu13 nvidia-cusparselt-cu13 nvidia-nccl-cu13 nvidia-nvshmem-cu13 triton"
    ).split()
)
TARGET_MARKERS = {"python_version": PYTHON, "python_full_version": PYTHON + ".0", "sys_platform": "linux"}
TARGET_MARKERS |= {"platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython"}


class KitError(RuntimeError):
    """The kit cannot be built or installed as asked: what was wrong, and what to do."""


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def wheel_name(path: Path) -> tuple[str, str]:
    """``(project, version)`` from a wheel's file name (``name-version[-build]-python-abi-platform.whl``)."""
    parts = path.name[: -len(".whl")].split("-")
    if not path.name.endswith(".whl") or len(parts) < 5:
        raise KitError(f"{path.name} is not a wheel's file name (name-version-python-abi-platform.whl)")
    return canonical(parts[0]), parts[1]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest(kit: Path, limit: int = LIMIT_BYTES) -> dict:
    """The wheels of ``kit`` (name, version, file, sha256, bytes) and their total; a KitError over ``limit``
    bytes, naming the largest wheels, or where ``kit`` holds no wheel or two versions of one project."""
    wheels = sorted(kit.glob("*.whl"))
    if not wheels:
        raise KitError(f"{kit} holds no wheel: build the kit first (python -m benchmarks.gpu_kit {kit})")
    entries = []
    for path in wheels:
        name, version = wheel_name(path)
        entries.append({"name": name, "version": version, "file": path.name, "sha256": sha256(path)})
        entries[-1]["bytes"] = path.stat().st_size
    names = [e["name"] for e in entries]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise KitError(f"{kit} holds two versions of {', '.join(twice)}: pip would refuse; keep one of each")
    total = sum(e["bytes"] for e in entries)
    if total > limit:
        biggest = sorted(entries, key=lambda e: -e["bytes"])[:3]
        largest = ", ".join(f"{e['file']} {e['bytes'] / MIB:.1f} MiB" for e in biggest)
        raise KitError(
            f"the kit in {kit} is {total / MIB:.1f} MiB, over its limit of {limit / MIB:.0f} MiB (what one call to a "
            f"GPU machine may carry beside the repository); largest: {largest}"
        )
    return {"python": PYTHON, "platforms": list(PLATFORMS), "total_bytes": total, "wheels": entries}


def write_manifest(kit: Path, limit: int = LIMIT_BYTES) -> dict:
    """``manifest(kit)`` written to ``kit/manifest.json`` (nothing written when it is refused)."""
    data = manifest(kit, limit)
    (kit / MANIFEST).write_text(json.dumps(data, indent=1) + "\n")
    return data


# ------------------------------------------------------------------------------------------------ building
def pip(*args: str, env: dict[str, str] | None = None) -> None:
    command = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise KitError(f"`{' '.join(command)}` failed ({proc.returncode}):\n{tail}")


def requirements(wheel: Path) -> list[str]:
    """A wheel's requirements that hold on the GPU machines (Python 3.12, Linux x86-64, no extras), less torch's."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        metadata = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(zf.read(metadata).decode())
    out = []
    for line in message.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({**TARGET_MARKERS, "extra": ""}):
            continue
        if canonical(req.name) not in TORCH_REQUIRES:
            out.append(str(req))
    return out


def tracked_copy(dest: Path) -> Path:
    """The checkout's tracked files (as they are in the working tree) copied to ``dest``: zgraph's wheel is built
    from them, never from a stale ``build/`` or untracked files."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def build(kit: Path, limit: int = LIMIT_BYTES) -> dict:
    """Build the kit into the empty or new folder ``kit``; its manifest."""
    kit.mkdir(parents=True, exist_ok=True)
    if any(kit.iterdir()):
        raise KitError(f"{kit} is not empty: give a new or empty folder")
    with tempfile.TemporaryDirectory(prefix="zgraph-kit-") as tmp:
        built = Path(tmp)
        env = {**os.environ, "DS_BUILD_OPS": "0"}
        pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(built), DEEPSPEED, env=env)
        pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(built), str(tracked_copy(built / "src")))
        ours = sorted(built.glob("*.whl"))
        impure = [p.name for p in ours if not p.name.endswith("-py3-none-any.whl")]
        if impure:
            raise KitError(f"built {impure}, not pure-Python wheels: the GPU machines need py3-none-any ones")
        wanted = sorted({r for wheel in ours for r in requirements(wheel)} | set(EXTRA))
        target = ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp"]
        target += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        pip("download", *target, "-d", str(kit), *wanted)
        for wheel in ours:
            (kit / wheel.name).write_bytes(wheel.read_bytes())
    return write_manifest(kit, limit)


# ------------------------------------------------------------------------------------------------ installing
def check(kit: Path) -> dict:
    """``kit``'s manifest, each wheel checked against it (present, same size and sha256)."""
    path = kit / MANIFEST
    if not path.exists():
        raise KitError(f"{kit} has no {MANIFEST}: not a kit built by python -m benchmarks.gpu_kit")
    data = json.loads(path.read_text())
    for entry in data["wheels"]:
        wheel = kit / entry["file"]
        if not wheel.exists() or wheel.stat().st_size != entry["bytes"] or sha256(wheel) != entry["sha256"]:
            raise KitError(f"{wheel} is missing or differs from {MANIFEST}: rebuild the kit")
    return data


def install_commands(kit: Path, checkout: Path | None = None, python: str = sys.executable) -> list[list[str]]:
    """The pip commands that install ``kit`` offline: every project but zgraph, resolved against what is installed
    (torch among it), then zgraph without its requirements: the kit's wheel, or ``checkout`` editable."""
    data = check(kit)
    names = [e["name"] for e in data["wheels"] if e["name"] != "zgraph"]
    base = [python, "-m", "pip", "install", "--no-index", "--find-links", str(kit), "--no-cache-dir"]
    zgraph = next(e["file"] for e in data["wheels"] if e["name"] == "zgraph")
    ours = ["--no-build-isolation", "-e", str(checkout)] if checkout else [str(kit / zgraph)]
    return [[*base, *names], [*base, "--no-deps", *ours]]


def install(kit: Path, checkout: Path | None = None) -> None:
    """Run ``install_commands``, pip's configuration files ignored (``PIP_CONFIG_FILE`` the null device)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    for command in install_commands(kit, checkout):
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
            raise KitError(f"`{' '.join(command)}` failed ({proc.returncode}):\n{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="the kit's folder")
    parser.add_argument("--install", action="store_true", help="install the kit in DIR (offline) into this Python")
    args = parser.parse_args(argv)
    try:
        if args.install:
            install(args.dir)
            print(f"installed the kit in {args.dir}")
            return 0
        data = build(args.dir)
    except KitError as err:
        print(f"gpu_kit: {err}", file=sys.stderr)
        return 1
    for e in data["wheels"]:
        print(f"{e['name']:24} {e['version']:14} {e['bytes'] / MIB:7.2f} MiB  {e['file']}")
    print(f"{len(data['wheels'])} wheels, {data['total_bytes'] / MIB:.1f} MiB (limit {LIMIT_BYTES / MIB:.0f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
