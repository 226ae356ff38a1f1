"""Third-party serializers on a stage-3 model (issue 16): reading a sharded tensor's storage raises
``zgraph.ShardedParameterError`` naming ``zgraph.full_state_dict`` and ``zgraph.gather`` (before: safetensors
failed with torch's ``invalid python storage``); whole tensors from either save and load back as eager's."""

from __future__ import annotations

import os

import pytest
import torch
from dist_harness import run_ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("serializers")
    os.environ["SERIALIZER_DIR"] = str(directory)  # read by the spawned ranks
    path = directory / "results.pt"
    run_ranks(2, "serializer_cases.run", str(path), ["stage3"], timeout=300)
    results = torch.load(path, weights_only=False)["stage3"]
    assert "error" not in results, results.get("error")
    return results, directory


@pytest.mark.parametrize("how", ["untyped_storage", "storage", "optimizer_state"])
def test_reading_a_sharded_tensors_storage_names_what_to_do(ranks, how):
    message = ranks[0][how]
    assert message.startswith("ShardedParameterError:"), message
    assert "zgraph.full_state_dict(model)" in message and "zgraph.gather(model)" in message
    assert "save_pretrained(path, state_dict=state)" in message


def test_local_shards_torch_save_and_deepcopy_keep_working(ranks):
    """zgraph and torch.distributed.checkpoint read the local tensor; torch.save and copy.deepcopy of a DTensor
    call data_ptr(), which is left alone."""
    for how in ("local_data_ptr", "data_ptr", "torch_save", "deepcopy"):
        assert ranks[0][how] == "no error", (how, ranks[0][how])


def test_safetensors_refuses_a_sharded_state_dict_with_zgraphs_error(ranks):
    pytest.importorskip("safetensors")
    message = ranks[0]["safetensors_sharded"]
    assert message.startswith("ShardedParameterError:") and "zgraph.full_state_dict" in message, message


@pytest.mark.parametrize("how", ["full_state_dict", "gathered"])
def test_safetensors_saves_whole_tensors_from_full_state_dict_or_inside_gather(ranks, how):
    safetensors = pytest.importorskip("safetensors.torch")
    results, directory = ranks
    outcome = results[f"save_{how}"]
    if "No module named 'numpy'" in outcome:
        pytest.skip("safetensors saves through numpy, which is not installed (the models extra brings it)")
    assert outcome == "no error", outcome
    loaded = safetensors.load_file(str(directory / f"0.{how}"))
    assert loaded.keys() == results["whole"].keys()
    for key, value in results["whole"].items():
        assert torch.equal(loaded[key], value), key
        assert torch.equal(results["inside_gather"][key], value), key
