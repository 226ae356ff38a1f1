"""Damaged checkpoints are refused before anything changes; optimizer mismatches and un-storable values are
refused; concurrent saves to one path do not break each other.

The damaged checkpoint is a real one saved at stage 3 on 2 ranks (a shard file per rank, plus ``.metadata``).
Every file gets bytes flipped at several offsets, is truncated, emptied and deleted in turn; each time
``zgraph.load`` (in one process, and on 2 ranks into a sharded model) raises ``CheckpointError`` naming the file,
the model and optimizer keep their state, and ``zgraph consolidate`` exits 1 with one line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import checkpoint_cases as cc
import pytest
import torch
from dist_harness import run_ranks

import zgraph
from zgraph.checkpoint import io as cio

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
OFFSETS = [0.0, 0.01, 0.37, 0.5, 0.93, 1.0]  # where in a file bytes are flipped (fraction of its size)


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("integrity") / "ck"
    run_ranks(2, "checkpoint_cases.save_stage3_worker", str(path), timeout=300)
    return path


def files_of(path) -> list[str]:
    return sorted(cio.read_marker(str(path))["files"])


@pytest.fixture
def copy(two_rank_checkpoint, tmp_path):
    shutil.copytree(two_rank_checkpoint, tmp_path / "ck")
    return tmp_path / "ck"


def snapshot(model, opt):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()},
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    )


def assert_unchanged(before, after):
    assert before[0].keys() == after[0].keys()
    for key, value in before[0].items():
        assert torch.equal(after[0][key], value), key
    assert before[1].keys() == after[1].keys()
    for p, fields in before[1].items():
        for key, value in fields.items():
            assert torch.equal(after[1][p][key], value), key
    assert before[2] == after[2]


def trained_state():
    state = cc.make_state()
    cc.train(state, cc.classify_step, cc.batches()[:2])
    return state


def assert_refused(path, name: str):
    """Load (refused, nothing changed, the file named) and consolidate (exit 1, one line) of a damaged copy."""
    model, opt, scheduler = trained_state()
    before = snapshot(model, opt)
    rng = torch.get_rng_state()
    with pytest.raises(zgraph.CheckpointError) as raised:
        zgraph.load(path, model, opt, scheduler=scheduler)
    assert name in str(raised.value)
    assert_unchanged(before, snapshot(model, opt))
    assert torch.equal(torch.get_rng_state(), rng) and scheduler.last_epoch == 2
    with pytest.raises(zgraph.CheckpointError):
        zgraph.consolidate(path, path.parent / "out.pt")
    assert not (path.parent / "out.pt").exists()


def flip(file, fraction: float) -> None:
    data = bytearray(file.read_bytes())
    at = min(int(len(data) * fraction), len(data) - 8)
    for i in range(at, at + 8):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def test_the_checkpoint_loads_intact(two_rank_checkpoint):
    names = files_of(two_rank_checkpoint)
    assert ".metadata" in names and any(n.startswith("r0/") for n in names) and any(n.startswith("r1/") for n in names)
    model, opt, scheduler = cc.make_state()
    assert zgraph.load(two_rank_checkpoint, model, opt, scheduler=scheduler) == {"step": 1}


def test_flipped_bytes_in_every_file_are_refused(two_rank_checkpoint, tmp_path):
    for name in files_of(two_rank_checkpoint):
        for fraction in OFFSETS:
            path = tmp_path / f"ck-{name.replace('/', '_')}-{fraction}"
            shutil.copytree(two_rank_checkpoint, path)
            flip(path / name, fraction)
            assert_refused(path, name)
            shutil.rmtree(path)


@pytest.mark.parametrize("damage", ["truncated", "empty", "deleted"])
def test_truncated_empty_and_deleted_files_are_refused(two_rank_checkpoint, tmp_path, damage):
    for name in files_of(two_rank_checkpoint):
        path = tmp_path / f"ck-{name.replace('/', '_')}"
        shutil.copytree(two_rank_checkpoint, path)
        file = path / name
        if damage == "deleted":
            file.unlink()
        else:
            file.write_bytes(file.read_bytes()[: file.stat().st_size // 2 if damage == "truncated" else 0])
        assert_refused(path, name)
        shutil.rmtree(path)


def test_damaged_marker_is_refused(copy):
    flip(copy / ".zgraph_complete", 0.5)
    model, opt, _ = trained_state()
    with pytest.raises(zgraph.CheckpointError, match=r"\.zgraph_complete"):
        zgraph.load(copy, model, opt)


def test_sizes_are_checked_without_sha256(copy):
    shard = next(n for n in files_of(copy) if n.startswith("r1/"))
    (copy / shard).write_bytes((copy / shard).read_bytes()[:-1])
    model, opt, _ = trained_state()
    with pytest.raises(zgraph.CheckpointError, match="the manifest says"):
        zgraph.load(copy, model, opt, verify=False)


def test_two_ranks_refuse_a_damaged_shard_together(copy, tmp_path):
    """On 2 ranks, into a sharded model: rank 1's shard is damaged; both ranks raise and keep their state."""
    shard = next(n for n in files_of(copy) if n.startswith("r1/"))
    flip(copy / shard, 0.5)
    run_ranks(2, "checkpoint_cases.damaged_load_worker", str(copy), str(tmp_path), timeout=300)
    for rank in range(2):
        assert (tmp_path / f"ok{rank}").exists()


@pytest.mark.parametrize("damage", ["deleted", "empty", "metadata", "not_a_checkpoint", "flipped"])
def test_consolidate_cli_one_line_exit_1(copy, damage):
    names = files_of(copy)
    shard = next(n for n in names if n.startswith("r0/"))
    target = copy
    if damage == "deleted":
        (copy / shard).unlink()
    elif damage == "empty":
        (copy / shard).write_bytes(b"")
    elif damage == "metadata":
        (copy / ".metadata").write_bytes(b"\x80\x04garbage")
    elif damage == "not_a_checkpoint":
        target = copy / "r0"
    else:
        flip(copy / shard, 0.37)
    done = subprocess.run(
        [sys.executable, "-m", "zgraph.cli", "consolidate", str(target), str(copy.parent / "out.pt")],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONWARNINGS="ignore::UserWarning"),  # torch's own "NumPy is not available"
    )
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("zgraph consolidate: "), done.stderr
    assert not (copy.parent / "out.pt").exists()


# --------------------------------------------------------------------------------------------- mismatches
def test_optimizer_class_mismatch_is_refused(tmp_path):
    model, opt, _ = trained_state()
    zgraph.save(tmp_path / "ck", model, opt)
    other = cc.Net()
    decay = [p for n, p in other.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in other.named_parameters() if n.endswith("bias")]
    sgd = torch.optim.SGD([{"params": decay}, {"params": no_decay}], lr=0.5, momentum=0.9)
    before = snapshot(other, sgd)
    with pytest.raises(zgraph.CheckpointError, match="optimizer 0 is a SGD, the checkpoint holds the state of a AdamW"):
        zgraph.load(tmp_path / "ck", other, sgd)
    assert_unchanged(before, snapshot(other, sgd))
    assert sgd.param_groups[0]["lr"] == 0.5


class Opaque:
    pass


@pytest.mark.parametrize(
    ("extra", "where", "kind"),
    [
        ({"fn": Opaque()}, "extra['fn']", "Opaque"),
        ({"a": [1, {"b": {1, 2}}]}, "extra['a'][1]['b']", "set"),
        ({"a": {3: "x"}}, "extra['a']", "key 3 of type int"),
    ],
)
def test_save_refuses_unstorable_extra_before_writing(tmp_path, extra, where, kind):
    model, opt, _ = trained_state()
    with pytest.raises(zgraph.CheckpointError) as raised:
        zgraph.save(tmp_path / "ck", model, opt, extra=extra)
    assert where in str(raised.value) and kind in str(raised.value)
    assert list(tmp_path.iterdir()) == []


def test_numpy_rng_state_is_optional_on_load(tmp_path, monkeypatch):
    """A checkpoint written where NumPy was imported loads where it is not (its NumPy state is then skipped)."""

    class FakeKeys:
        def tolist(self):
            return list(range(624))

    class FakeRandom:
        @staticmethod
        def get_state():
            return ("MT19937", FakeKeys(), 5, 0, 0.0)

    fake = type(sys)("numpy")
    fake.random = FakeRandom
    monkeypatch.setitem(sys.modules, "numpy", fake)
    model, opt, _ = trained_state()
    zgraph.save(tmp_path / "ck", model, opt)
    assert cio.read_marker(str(tmp_path / "ck"))["rng"]["0"]["numpy"]["keys"][:3] == [0, 1, 2]
    monkeypatch.delitem(sys.modules, "numpy")
    other, other_opt, _ = cc.make_state()
    zgraph.load(tmp_path / "ck", other, other_opt)
    assert torch.equal(other.l1.weight, model.l1.weight)


def test_plain_dcp_reads_the_checkpoint(two_rank_checkpoint):
    """The directory is a DCP checkpoint: torch.distributed.checkpoint reads it with its own reader."""
    import torch.distributed.checkpoint as dcp

    model, opt, _ = cc.make_state()
    zgraph.load(two_rank_checkpoint, model, opt)
    target = {"model.emb.weight": torch.empty(cc.VOCAB, 6), "model.l1.weight": torch.empty(11, 6)}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(two_rank_checkpoint)), no_dist=True)
    assert torch.equal(target["model.emb.weight"], model.emb.weight)
    assert torch.equal(target["model.l1.weight"], model.l1.weight)


# --------------------------------------------------------------------------------------------- concurrency
def test_concurrent_saves_to_one_path(tmp_path):
    path, start = tmp_path / "ck", tmp_path / "start"
    pythonpath = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::UserWarning")
    children = []
    for value in (1.0, 2.0):
        code = f"import checkpoint_cases as c; c.concurrent_saver({str(path)!r}, {value}, 6, {str(start)!r})"
        children.append(subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True))
    start.write_text("go")
    for child in children:
        _, err = child.communicate(timeout=240)
        assert child.returncode == 0, err
    model, opt, _ = cc.make_state()
    extra = zgraph.load(path, model, opt)
    assert extra["value"] in (1.0, 2.0) and extra["round"] == 5
    assert all(torch.all(p == extra["value"]) for p in model.parameters())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "start"]  # no temporaries left


def test_stale_temporaries_of_dead_processes_are_cleaned_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = os.path.basename(cio.temp_name(str(tmp_path / "ck"))).split(".tmp-")[1].rsplit("-", 2)[0]
        dead_temp = tmp_path / f"ck.tmp-{host}-{dead.pid}-0000"
        live_temp = tmp_path / f"ck.tmp-{host}-{live.pid}-1111"
        old_foreign = tmp_path / "ck.tmp-otherhost-1-2222"
        new_foreign = tmp_path / "ck.tmp-otherhost-1-3333"
        for d in (dead_temp, live_temp, old_foreign, new_foreign):
            d.mkdir()
            (d / "x").write_text("x")
        day_ago = time.time() - cio.STALE_AGE - 60
        os.utime(old_foreign, (day_ago, day_ago))
        model, opt, _ = trained_state()
        zgraph.save(tmp_path / "ck", model, opt)
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted(["ck", live_temp.name, new_foreign.name])
    finally:
        live.kill()
        live.wait()
