"""Crafted checkpoints: nothing a checkpoint holds runs as code, in ``zgraph.load`` or ``zgraph consolidate``.

Each attack is a real checkpoint directory forged the way an attacker can: a genuine ``zgraph.save``, then a
pickle payload put where the old format (or DCP) would unpickle it — a byte item for ``extra``, a module's
extra state, optimizer hyper-parameters or the scheduler's state; a tensor file whose ``torch.save`` payload
runs code, for ``extra``'s tensor, optimizer state or a model weight; a replaced ``.metadata`` pickle. The
forger also rewrites the manifest's sizes and sha256s (an attacker can), so that the checksums do not stop
the attack and the loader's own defences are what is tested. The payload would create a marker file; it must
never exist, and every attack must end in ``CheckpointError`` (the CLI: exit status 1, one line).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys

import checkpoint_cases as cc
import pytest
import torch

import zgraph
from zgraph.checkpoint import io as cio

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


class Payload:
    """Unpickled, creates the file ``marker`` (what a real attack would do with ``os.system``)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def make_state():
    model, opt, scheduler = cc.make_state(cc.NetWithExtra())
    cc.train((model, opt, scheduler), cc.classify_step, cc.batches()[:1])
    return model, opt, scheduler


def genuine(path) -> None:
    model, opt, scheduler = make_state()
    zgraph.save(path, model, opt, scheduler=scheduler, extra={"epoch": 3, "tokens": torch.arange(4)})


def _chunk_index(metadata, key):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(key, metadata.state_dict_metadata[key].chunks[0].offsets)


def forge(path, attack: str, marker: str) -> None:
    """Turn the genuine checkpoint at ``path`` into the ``attack`` one; manifest checksums kept consistent."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    path = str(path)
    manifest = cio.read_marker(path)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # the genuine file zgraph just wrote
    evil = os.path.join(path, "r0", "evil.distcp")
    if attack.endswith("_item"):  # a byte item, which DCP reads with torch.load(weights_only=False)
        key = {
            "extra_item": "zgraph.extra",
            "module_extra_state_item": "model._extra_state",
            "optimizer_item": "optim.0.param_groups",
            "scheduler_item": "zgraph.scheduler",
        }[attack]
        raw = pickle.dumps(Payload(marker))
        with open(evil, "wb") as f:
            f.write(raw)
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
        metadata.storage_data[MetadataIndex(key)] = _StorageInfo("r0/evil.distcp", 0, len(raw))
    elif attack.endswith("_payload"):  # a tensor's bytes replaced by a torch.save of a code-running object
        key = {
            "extra_tensor_payload": _extra_tensor_key(manifest),
            "optimizer_state_payload": "optim.0.state.l1.weight.exp_avg",
            "model_payload": "model.l1.weight",
        }[attack]
        with open(evil, "wb") as f:
            torch.save(Payload(marker), f)
        index = _chunk_index(metadata, key)
        metadata.storage_data[index] = dataclasses.replace(
            metadata.storage_data[index], relative_path="r0/evil.distcp", offset=0, length=os.path.getsize(evil)
        )
    if attack == "metadata":
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(Payload(marker), f)
    elif attack != "none":
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(metadata, f)
    names = [n for n in (".metadata", "r0/evil.distcp") if os.path.exists(os.path.join(path, n))]
    manifest["files"].update(cio.digests(path, names))
    cio.write_marker(path, manifest)


def _extra_tensor_key(manifest) -> str:
    return manifest["extra"]["tokens"]["__z_tensor"]


ATTACKS = [
    "extra_item",
    "module_extra_state_item",
    "optimizer_item",
    "scheduler_item",
    "extra_tensor_payload",
    "optimizer_state_payload",
    "model_payload",
    "metadata",
]
# what consolidate reads: the model's tensors and extra state, and the metadata (a byte item anywhere in it
# makes the metadata unreadable)
CONSOLIDATE_REFUSES = {a for a in ATTACKS if a.endswith("_item")} | {"model_payload", "metadata"}


def test_payload_runs_code_when_unpickled(tmp_path):
    """The payload is real: plain ``pickle.loads`` creates the marker."""
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(Payload(str(marker))))
    assert marker.exists()


def test_forged_control_loads(tmp_path):
    """The forger itself leaves a loadable checkpoint when it injects nothing."""
    genuine(tmp_path / "ck")
    forge(tmp_path / "ck", "none", str(tmp_path / "pwned"))
    model, opt, scheduler = cc.make_state(cc.NetWithExtra())
    extra = zgraph.load(tmp_path / "ck", model, opt, scheduler=scheduler)
    assert extra["epoch"] == 3 and torch.equal(extra["tokens"], torch.arange(4))


def snapshot(model, opt, scheduler):
    return (
        {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
        {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()},
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        scheduler.state_dict(),
        model.tag,
    )


def assert_unchanged(before, after):
    assert before[0].keys() == after[0].keys()
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert before[1].keys() == after[1].keys()
    for p, fields in before[1].items():
        assert all(torch.equal(fields[k], after[1][p][k]) for k in fields)
    assert before[2:] == after[2:]


@pytest.mark.parametrize("attack", ATTACKS)
def test_load_runs_no_code(tmp_path, attack):
    marker = tmp_path / "pwned"
    genuine(tmp_path / "ck")
    forge(tmp_path / "ck", attack, str(marker))
    model, opt, scheduler = make_state()
    model.tag = "mine"
    before = snapshot(model, opt, scheduler)
    with pytest.raises(zgraph.CheckpointError) as raised:
        zgraph.load(tmp_path / "ck", model, opt, scheduler=scheduler)
    assert not marker.exists()
    assert_unchanged(before, snapshot(model, opt, scheduler))
    if attack == "metadata" or attack.endswith("_item"):
        assert ".metadata" in str(raised.value)


@pytest.mark.parametrize("attack", ATTACKS)
def test_consolidate_cli_runs_no_code(tmp_path, attack):
    marker = tmp_path / "pwned"
    genuine(tmp_path / "ck")
    forge(tmp_path / "ck", attack, str(marker))
    out = tmp_path / "out.pt"
    done = subprocess.run(
        [sys.executable, "-m", "zgraph.cli", "consolidate", str(tmp_path / "ck"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONWARNINGS="ignore::UserWarning"),  # torch's own "NumPy is not available"
    )
    assert not marker.exists()
    if attack in CONSOLIDATE_REFUSES:
        assert done.returncode == 1, done.stdout + done.stderr
        lines = [line for line in done.stderr.splitlines() if line.startswith("zgraph consolidate:")]
        assert len(lines) == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "Traceback" not in done.stderr
        assert not out.exists()
    else:  # consolidate does not read the poisoned item: the model is genuine
        assert done.returncode == 0, done.stderr


def test_manifest_with_an_unknown_tag_is_refused(tmp_path):
    """A manifest value tagged as something no zgraph writes (a smuggled pickle, say) is refused."""
    genuine(tmp_path / "ck")
    manifest = cio.read_marker(str(tmp_path / "ck"))
    manifest["extra"]["epoch"] = {"__z_pickle": pickle.dumps(Payload(str(tmp_path / "pwned"))).hex()}
    cio.write_marker(str(tmp_path / "ck"), manifest)
    model, opt, scheduler = make_state()
    with pytest.raises(zgraph.CheckpointError, match="unknown tag"):
        zgraph.load(tmp_path / "ck", model, opt, scheduler=scheduler)
    assert not (tmp_path / "pwned").exists()


def test_metadata_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    """A ``.metadata`` that points DCP at a file the manifest does not list (``../secret``) is refused."""
    genuine(tmp_path / "ck")
    path = str(tmp_path / "ck")
    (tmp_path / "secret").write_bytes(b"x" * 100)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    index = _chunk_index(metadata, "model.l1.weight")
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], relative_path="../secret")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    manifest = cio.read_marker(path)
    manifest["files"].update(cio.digests(path, [".metadata"]))
    cio.write_marker(path, manifest)
    model, opt, scheduler = make_state()
    with pytest.raises(zgraph.CheckpointError, match="the manifest does not list: '../secret'"):
        zgraph.load(path, model, opt, scheduler=scheduler)


def test_module_extra_state_and_values_round_trip_as_data(tmp_path):
    """Module extra state, tuples, inf and nan, nested dicts and tensors survive as data."""
    model, opt, scheduler = make_state()
    model.tag = "saved"
    extra = {"t": (1, (2.0, "x")), "inf": float("-inf"), "nan": float("nan"), "__z_tuple": [None, True]}
    zgraph.save(tmp_path / "ck", model, opt, scheduler=scheduler, extra=extra)
    other, other_opt, other_scheduler = cc.make_state(cc.NetWithExtra())
    got = zgraph.load(tmp_path / "ck", other, other_opt, scheduler=other_scheduler)
    assert other.tag == "saved"
    assert got["t"] == (1, (2.0, "x")) and got["inf"] == float("-inf") and got["nan"] != got["nan"]
    assert got["__z_tuple"] == [None, True]
    assert other_opt.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
    assert isinstance(other_opt.param_groups[0]["betas"], tuple)
    state = zgraph.consolidate(tmp_path / "ck", tmp_path / "out.pt")
    assert state["_extra_state"] == {"tag": "saved", "history": (1, 2.5, float("inf"))}
