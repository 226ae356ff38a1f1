"""``zgraph.save_pretrained`` (issue 27, item 3: export without a whole copy) and ``zgraph.stream_state_dict``.

- The streaming safetensors writer writes safetensors' own bytes (``save_file`` of the same tensors).
- In one process, on a plain module and a tiny Hugging Face Llama (tied and untied embeddings), a small
  ``max_shard_size`` gives the files, index and config transformers' ``save_pretrained`` writes, byte for byte, and
  ``from_pretrained`` of ours equals the model bitwise.
- On 2 gloo ranks after zgraph steps at stage 3 and 2, plain ``from_pretrained`` equals ``zgraph.full_state_dict``.
- A write failing on rank 0 raises on every rank and leaves no index.
- Memory: the writing rank never holds the whole model (live host bytes allocated during the call, on a model of
  many equal layers, stay under two of its tensors; ``full_state_dict``'s, measured alike, reach the model's).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import zgraph
from zgraph.weights.safetensors_stream import Entry, StreamWriter

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

DEADLINE = 120  # seconds for a 2-rank run (each takes well under 30 s alone)


def _files(directory) -> dict[str, bytes]:
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


def _read(directory) -> dict[str, torch.Tensor]:
    """Every tensor of a saved directory, through its index (or the one file), read with safetensors."""
    index = os.path.join(directory, "model.safetensors.index.json")
    files = set(json.load(open(index))["weight_map"].values()) if os.path.exists(index) else {"model.safetensors"}
    out = {}
    for name in files:
        with safe_open(os.path.join(directory, name), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


# ------------------------------------------------------------------------------------------ the writer
@pytest.mark.hf  # safetensors' save_file, the reference, needs numpy (which the models extra brings)
def test_stream_writer_writes_safetensors_own_bytes(tmp_path):
    pytest.importorskip("numpy")
    tensors = {
        "z": torch.randn(3, 4),
        "a": torch.randn(2, 3).bfloat16(),
        "b": torch.arange(3),
        "c": torch.ones(5, dtype=torch.uint8),
        "d": torch.randn(2).half(),
        "e": torch.tensor([True, False]),
        "f": torch.ones(2, dtype=torch.int32),
        "g": torch.randn(2, dtype=torch.float64),
        "h": torch.ones(2, dtype=torch.int8),
        "i": torch.ones(2, dtype=torch.int16),
        "j": torch.ones(2, dtype=torch.float8_e4m3fn),
        "empty": torch.ones(0, 3),
        "scalar": torch.tensor(2.5),
        "transposed": torch.randn(4, 3).t(),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "want", metadata={"format": "pt"})
    entries = [Entry(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    with StreamWriter(str(tmp_path / "got"), entries, {"format": "pt"}) as writer:
        for entry in writer.order:
            writer.write(entry.name, tensors[entry.name])
    assert (tmp_path / "got").read_bytes() == (tmp_path / "want").read_bytes()


def test_stream_writer_leaves_nothing_when_a_tensor_is_missing_or_wrong(tmp_path):
    entries = [Entry("a", torch.float32, (2,)), Entry("b", torch.float32, (3,))]
    with pytest.raises(ValueError, match="expected"):
        with StreamWriter(str(tmp_path / "x"), entries) as writer:
            writer.write("a", torch.ones(3))
    with pytest.raises(ValueError, match="never written"):
        with StreamWriter(str(tmp_path / "x"), entries) as writer:
            writer.write("a", torch.ones(2))
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------------ one process
@pytest.mark.hf  # huggingface_hub writes with safetensors' save_file, which needs numpy
def test_plain_module_several_files_as_huggingface_hub_writes_them(tmp_path):
    pytest.importorskip("numpy")
    hub = pytest.importorskip("huggingface_hub")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)], nn.BatchNorm1d(16))
    model[0].register_buffer("scratch", torch.ones(3), persistent=False)
    zgraph.save_pretrained(model, tmp_path / "ours", max_shard_size=1200)
    (tmp_path / "hub").mkdir()
    hub.save_torch_state_dict(model.state_dict(), tmp_path / "hub", max_shard_size=1200)
    ours = _files(tmp_path / "ours")
    assert len([n for n in ours if n.endswith(".safetensors")]) > 2
    hub_files = _files(tmp_path / "hub")
    assert ours.keys() == hub_files.keys()
    for name in ours:  # the index: the same JSON (huggingface_hub writes it unsorted, transformers sorted)
        assert (
            json.loads(ours[name]) == json.loads(hub_files[name])
            if name.endswith(".json")
            else ours[name] == hub_files[name]
        )
    _equal(_read(tmp_path / "ours"), model.state_dict())
    assert "0.scratch" not in _read(tmp_path / "ours")


def test_plain_module_tied_weight_written_once_under_its_first_name(tmp_path):
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    zgraph.save_pretrained(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    _equal(_read(tmp_path), {"0.weight": model[0].weight.detach()})


def test_stream_state_dict_yields_the_state_dict_one_entry_at_a_time():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    streamed = zgraph.stream_state_dict(model)
    assert next(streamed)[0] == "0.weight"
    assert [k for k, _ in streamed] == list(model.state_dict())[1:]
    full = zgraph.full_state_dict(model)
    assert all(full[k] is v or torch.equal(full[k], v) for k, v in zgraph.stream_state_dict(model))


@pytest.mark.hf
@pytest.mark.parametrize("tied", [True, False])
def test_llama_several_files_byte_for_byte_as_transformers_writes_them(tmp_path, tied):
    pytest.importorskip("transformers")
    import save_pretrained_cases as cases
    from transformers import AutoModelForCausalLM

    model = cases.llama(tied)
    model.save_pretrained(tmp_path / "transformers", max_shard_size=cases.SHARD)
    zgraph.save_pretrained(model, tmp_path / "zgraph", max_shard_size=cases.SHARD)
    ours, theirs = _files(tmp_path / "zgraph"), _files(tmp_path / "transformers")
    assert "model.safetensors.index.json" in ours and len(ours) > 5
    assert ours.keys() == theirs.keys()
    for name in ours:
        if name.endswith(".json"):
            assert json.loads(ours[name]) == json.loads(theirs[name]), name
        else:
            assert ours[name] == theirs[name], name
    assert ("lm_head.weight" in _read(tmp_path / "zgraph")) is not tied
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "zgraph")
    _equal(loaded.state_dict(), model.state_dict())


def test_a_single_file_replaces_an_earlier_sharded_save(tmp_path):
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    zgraph.save_pretrained(model, tmp_path, max_shard_size=1200)
    assert "model.safetensors.index.json" in os.listdir(tmp_path)
    zgraph.save_pretrained(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    zgraph.save_pretrained(model, tmp_path, max_shard_size="1.2KB")
    assert "model.safetensors" not in os.listdir(tmp_path)
    _equal(_read(tmp_path), model.state_dict())


def test_a_failed_write_leaves_no_index_and_no_partial_file(tmp_path):
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    zgraph.save_pretrained(model, tmp_path, max_shard_size=1200)  # an earlier, complete save
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    (tmp_path / "model-00002-of-00003.safetensors").mkdir()  # the second file cannot be put in place
    with pytest.raises(OSError):
        zgraph.save_pretrained(model, tmp_path, max_shard_size=1200)
    left = sorted(os.listdir(tmp_path))
    assert "model.safetensors.index.json" not in left and not any(".tmp-" in name for name in left), left


# ------------------------------------------------------------------------------------------ 2 ranks
@pytest.mark.hf
@pytest.mark.parametrize(("stage", "tied"), [(3, True), (2, False)])
def test_trained_on_two_ranks_loads_with_plain_transformers_and_no_rank_held_the_model(tmp_path, stage, tied):
    """One 2-rank run: the tiny Llama after two steps at ``stage``, saved; then ``layers()`` likewise, measured."""
    pytest.importorskip("transformers")
    from dist_harness import run_ranks
    from transformers import LlamaForCausalLM

    run_ranks(2, "save_pretrained_cases.saved_after_steps", str(tmp_path), stage, tied, timeout=DEADLINE)
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    saved = _read(tmp_path / "zgraph")
    assert ("lm_head.weight" in saved) is not tied and len(os.listdir(tmp_path / "zgraph")) > 5
    _equal(LlamaForCausalLM.from_pretrained(tmp_path / "zgraph").state_dict(), state)
    _check_memory(tmp_path, stage)


def _check_memory(tmp_path, stage: int) -> None:
    rank0, rank1 = (torch.load(tmp_path / f"memory.{stage}.{r}.pt", weights_only=True) for r in (0, 1))
    model_bytes, largest = rank0["model_bytes"], rank0["largest"]
    assert model_bytes == 8 * largest
    _equal(_read(tmp_path / "layers"), rank0["state"])
    # rank 0 holds the tensor being written (gathered whole) and a copy of its own shard at most
    assert rank0["save_peak"] <= 2 * largest + 4096, rank0
    assert rank0["save_peak"] < model_bytes / 2
    assert rank1["save_peak"] <= largest + 4096, rank1
    # a write that failed on rank 0 raised on every rank (its own error there, CheckpointError elsewhere)
    assert (rank0["failed"], rank1["failed"]) == ("IsADirectoryError", "CheckpointError")
    assert rank0["left"] == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"], rank0["left"]
    if stage == 3:  # the measure sees gathered tensors: full_state_dict keeps them all
        assert rank0["full_peak"] >= model_bytes and rank1["full_peak"] <= largest + 4096, (rank0, rank1)
