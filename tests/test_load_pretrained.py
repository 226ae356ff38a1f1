"""``zgraph.load_pretrained`` (issue 27, item 2): Hugging Face safetensors (one file, a sharded index) and DCP
directories read into a plain model, and at 2 ranks into ZeRO-3 shards after a step's first call, each rank
reading only its rows; mismatches refused with a report, the model unchanged. The Hugging Face cases need the
``models`` extra (transformers)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_harness import run_ranks
from load_pretrained_cases import linears, tiny_llama
from safetensors.torch import load_file
from safetensors_files import save_file
from torch import nn

import zgraph
from zgraph.weights.report import PretrainedMismatchError

DEADLINE = 120  # seconds: a hang guard for a 2-rank run (each takes under 30 s on an idle 2-core machine)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


def _equal(model: nn.Module, want: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def _dcp_save(state: dict[str, torch.Tensor], path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)


def test_plain_module_from_safetensors_file_and_dcp(tmp_path):
    source = _model(0).state_dict()
    save_file(source, str(tmp_path / "model.safetensors"))
    _dcp_save(source, str(tmp_path / "dcp"))
    for where in (tmp_path, tmp_path / "model.safetensors", tmp_path / "dcp"):
        model = _model(1)
        loaded = zgraph.load_pretrained(model, where)
        _equal(model, source)
        assert loaded.loaded == list(source) and not loaded.match


def test_dtype_converted_to_the_model(tmp_path):
    source = _model(0).state_dict()
    save_file(
        {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in source.items()},
        str(tmp_path / "m.safetensors"),
    )
    model = _model(1)
    zgraph.load_pretrained(model, tmp_path / "m.safetensors")
    assert model[0].weight.dtype == torch.float32
    assert torch.equal(model[0].weight, source["0.weight"].to(torch.bfloat16).float())


def test_zgraph_checkpoint_model_part(tmp_path):
    source = _model(0)
    opt = torch.optim.Adam(source.parameters())
    zgraph.save(tmp_path / "ckpt", source, opt)
    model = _model(1)
    zgraph.load_pretrained(model, tmp_path / "ckpt")
    _equal(model, source.state_dict())


def test_mismatches_refused_and_the_model_unchanged(tmp_path):
    source = _model(0).state_dict()
    missing = {k: v for k, v in source.items() if k != "2.bias"}
    save_file(missing, str(tmp_path / "missing.safetensors"))
    misshaped = dict(source, **{"2.weight": torch.zeros(5, 8)}, extra=torch.zeros(2))
    save_file(misshaped, str(tmp_path / "misshaped.safetensors"))
    model = _model(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PretrainedMismatchError, match="nothing was loaded") as caught:
        zgraph.load_pretrained(model, tmp_path / "missing.safetensors")
    assert "2.bias" in str(caught.value) and "MISSING" in str(caught.value)
    assert caught.value.match.missing == ["2.bias"]
    _equal(model, before)
    for strict in (True, False):
        with pytest.raises(zgraph.CheckpointError) as caught:
            zgraph.load_pretrained(model, tmp_path / "misshaped.safetensors", strict=strict)
        assert "2.weight" in str(caught.value) and "ckpt: (5, 8) vs model: (3, 8)" in str(caught.value)
        _equal(model, before)
    with pytest.warns(RuntimeWarning, match=r"(?s)2\.bias +\| MISSING.*left as they are") as record:
        loaded = zgraph.load_pretrained(model, tmp_path / "missing.safetensors", strict=False)
    assert len(record) == 1 and loaded.match.missing == ["2.bias"]
    assert torch.equal(model[2].bias, before["2.bias"]) and torch.equal(model[2].weight, source["2.weight"])


def test_nothing_readable_named(tmp_path):
    with pytest.raises(zgraph.CheckpointError, match="no model.safetensors"):
        zgraph.load_pretrained(_model(0), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(zgraph.CheckpointError, match="outside its directory"):
        zgraph.load_pretrained(_model(0), tmp_path)
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(zgraph.CheckpointError, match="not a safetensors file"):
        zgraph.load_pretrained(_model(0), tmp_path / "bad.safetensors")


def test_meta_model_materialised_then_filled(tmp_path):
    source = _model(0).state_dict()
    save_file(source, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = _model(1)
    with pytest.raises(zgraph.CheckpointError, match="meta device.*config="):
        zgraph.load_pretrained(model, tmp_path)
    assert model[0].weight.is_meta
    zgraph.load_pretrained(model, tmp_path, config=zgraph.Config(stage=3))
    _equal(model, source)
    with torch.device("meta"):
        model = _model(1)
    save_file({k: v for k, v in source.items() if k != "2.bias"}, str(tmp_path / "missing.safetensors"))
    with pytest.warns(RuntimeWarning, match="newly initialized"):
        zgraph.load_pretrained(model, tmp_path / "missing.safetensors", config=zgraph.Config(), strict=False)
    assert not model[2].bias.is_meta and torch.equal(model[2].weight, source["2.weight"])


def _hf_checkpoints(root: str, tied: bool) -> None:
    """The checkpoints the stage-3 case reads: transformers' own sharded index, a DCP directory, and two broken
    ones (a missing key; a wrong shape)."""
    source = tiny_llama(tied, seed=0)
    source.save_pretrained(os.path.join(root, "hf"), max_shard_size="20KB")
    state = source.state_dict()
    _dcp_save(state, os.path.join(root, "dcp"))
    os.makedirs(os.path.join(root, "missing"))
    os.makedirs(os.path.join(root, "misshaped"))
    save_file({k: v.clone() for k, v in state.items()}, os.path.join(root, "source.safetensors"))
    whole = {k: v.clone().contiguous() for k, v in state.items() if k != "lm_head.weight" or not tied}
    save_file(
        {k: v for k, v in whole.items() if k != "model.norm.weight"}, os.path.join(root, "missing", "model.safetensors")
    )
    whole["model.layers.1.mlp.up_proj.weight"] = torch.zeros(256, 64)
    save_file(whole, os.path.join(root, "misshaped", "model.safetensors"))


@pytest.mark.hf
@pytest.mark.parametrize("tied", [True, False])
def test_hf_llama_sharded_index_single_process(tmp_path, tied):
    pytest.importorskip("transformers")
    _hf_checkpoints(str(tmp_path), tied)
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json")
    files = {f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")}
    assert len(files) > 1
    saved = {k for f in files for k in load_file(str(tmp_path / "hf" / f))}
    assert ("lm_head.weight" in saved) is not tied  # a tied checkpoint holds the embedding only
    source = tiny_llama(tied, seed=0).state_dict()
    for where in (tmp_path / "hf", tmp_path / "hf" / "model.safetensors.index.json", tmp_path / "dcp"):
        model = tiny_llama(tied, seed=1)
        zgraph.load_pretrained(model, where)
        _equal(model, source)
        if tied:
            assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.device("meta"):
        model = tiny_llama(tied, seed=1)
    zgraph.load_pretrained(model, tmp_path / "hf", config=zgraph.Config(stage=3))
    _equal(model, source)
    assert not any(b.is_meta for b in model.buffers())


@pytest.mark.hf
@pytest.mark.parametrize("tied", [True, False])
def test_hf_llama_into_stage3_shards(tmp_path, tied):
    pytest.importorskip("transformers")
    _hf_checkpoints(str(tmp_path), tied)
    run_ranks(2, "load_pretrained_cases.hf_stage3", str(tmp_path), tied, timeout=DEADLINE)


def test_each_rank_reads_only_its_rows(tmp_path):
    """The peak-memory check: at 2 ranks, the bytes each rank reads are its shards (half the model), the largest
    single read at most one tensor (reading whole tensors it does not own reads the whole model: refused)."""
    save_file(linears(seed=0).state_dict(), str(tmp_path / "model.safetensors"))
    run_ranks(2, "load_pretrained_cases.memory", str(tmp_path), timeout=DEADLINE)


def test_whole_tensors_at_stage1_a_rank_that_fails_and_a_meta_model(tmp_path):
    save_file(linears(seed=0).state_dict(), str(tmp_path / "model.safetensors"))
    run_ranks(2, "load_pretrained_cases.whole_and_failing", str(tmp_path), timeout=DEADLINE)
