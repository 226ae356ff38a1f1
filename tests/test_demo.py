"""The main job, ``zgraph demo``: starts its own ranks, trains, reports (short run)."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_trains_on_two_ranks_with_zero3(tmp_path):
    dump = tmp_path / "graphs"
    result = subprocess.run(
        [sys.executable, "-m", "zgraph.cli", "demo", "--steps", "4", "--dump", str(dump)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    assert "ZeRO stage 3 on 2 rank(s)" in out
    assert "loss (mean over ranks)" in out and "tokens/s" in out
    ratios = [float(r) for r in re.findall(r"rank \d: .* \((\d\.\d+)x\)", out)]
    # ZeRO-3 on 2 ranks: half the model state each, plus the small parameters kept whole
    # (param_persistence_threshold) and shard padding
    assert len(ratios) == 2 and all(0.45 <= r <= 0.55 for r in ratios), out
    assert "all_gather" in out and "reduce_scatter" in out
    assert len(list(dump.glob("*.py"))) >= 3
