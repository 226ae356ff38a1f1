"""``zgraph demo`` where CUDA is present: each rank on ``cuda:<local rank>`` when there is a GPU for every local rank
(NCCL), else on the CPU, saying so; the multimodal demo's eager reference on the ranks' kind of device."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device (torch.cuda.is_available() is False): the demo's device choice needs one",
)


def demo(tmp_path, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "zgraph.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_one_rank_trains_on_the_gpu(tmp_path):
    out = demo(tmp_path, "--nproc", "1", "--steps", "4", "--dump", str(tmp_path / "graphs"))
    assert "zgraph demo: device: cuda:0" in out and "device: cuda (one GPU per rank)" in out, out
    assert "ZeRO stage 3 on 1 rank(s)" in out


def test_two_ranks_take_a_gpu_each_or_say_why_not(tmp_path):
    out = demo(tmp_path, "--steps", "4", "--dump", str(tmp_path / "graphs"))
    if torch.cuda.device_count() >= 2:
        assert "device: cuda:0-1, one GPU per rank (NCCL)" in out and "device: cuda (one GPU per rank)" in out, out
    else:
        assert "device: CPU (gloo): 2 local ranks but 1 GPU(s)" in out, out
    ratios = [float(r) for r in re.findall(r"rank \d: .* \((\d\.\d+)x\)", out)]
    assert len(ratios) == 2 and all(0.45 <= r <= 0.55 for r in ratios), out


def test_multimodal_demo_compares_with_eager_on_the_ranks_device(tmp_path):
    """One rank per group (``--nproc 1``): on two GPUs the ranks and the eager reference run on CUDA; with one GPU
    the ranks run on the CPU, and so does the reference."""
    out = demo(tmp_path, "--multimodal", "--launcher", "processes", "--nproc", "1", "--steps", "3")
    worst = float(re.search(r"largest loss difference over the steps (\S+)", out).group(1))
    assert "zgraph matches eager" in out and worst <= 1e-4, out
    if torch.cuda.device_count() >= 2:
        assert "eager PyTorch, one process on cuda, as the ranks" in out, out
    else:
        assert "device: CPU (gloo)" in out and "eager PyTorch, one process, same combined model" in out, out
