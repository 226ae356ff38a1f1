"""Rank bodies of ``test_load_pretrained.py``: ``zgraph.load_pretrained`` after a ZeRO-3 step's first call, on
spawned gloo ranks. The Hugging Face cases import transformers; the memory case does not."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from safetensors import safe_open as _safe_open
from safetensors.torch import load_file
from torch import nn

import zgraph

LAYERS = 4
WIDTH = 256  # 4 Linear(256, 256) without bias: 256 KiB each, 1 MiB in all


def tiny_llama(tied: bool, seed: int) -> nn.Module:
    """A tiny Llama (hidden 64, 2 layers, vocab 128), built from its config with ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def llama_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _stage3(model: nn.Module, step_fn: Callable[..., object], *args: object) -> None:
    """One zgraph ZeRO-3 step (every parameter sharded), so the model holds DTensor shards."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zgraph.distribute(stage=3, param_persistence_threshold=0, backend="eager")(step_fn)
    step(model, opt, *args)


def _equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def hf_stage3(rank: int, world: int, root: str, tied: bool) -> None:
    """After a stage-3 step: the sharded index, the DCP directory and a zgraph.save checkpoint load into the shards
    (the DTensor parameters stay the same objects); a missing key and a wrong shape are refused on every rank with
    the report naming them, and the model is unchanged."""
    source = load_file(os.path.join(root, "source.safetensors"))  # every name, tied ones too
    model = tiny_llama(tied, seed=1)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(rank))
    _stage3(model, llama_step, ids)
    params = {name: p for name, p in model.named_parameters()}
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in params.values())
    for checkpoint in ("hf", "dcp"):
        zgraph.load_pretrained(model, os.path.join(root, checkpoint))
        _equal(zgraph.full_state_dict(model), source)
        assert all(p is params[name] for name, p in model.named_parameters())
    zgraph.save(os.path.join(root, "zgraph"), model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    zgraph.load_pretrained(model, os.path.join(root, "zgraph"))
    _equal(zgraph.full_state_dict(model), source)
    before = zgraph.full_state_dict(model)
    for broken, names in (("missing", ["model.norm.weight"]), ("misshaped", ["model.layers.1.mlp.up_proj.weight"])):
        try:
            zgraph.load_pretrained(model, os.path.join(root, broken))
        except zgraph.CheckpointError as error:
            text = str(error)
            assert all(name in text for name in names), text
            assert "nothing was loaded" in text and "LOAD REPORT" in text, text
        else:
            raise AssertionError(f"load_pretrained accepted the {broken} checkpoint")
        _equal(zgraph.full_state_dict(model), before)
    assert "(256, 64) vs model: (128, 64)" in text, text


def linears(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def linear_step(model, opt, x):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()


class _Recording:
    """``safe_open`` as load_pretrained uses it, recording the bytes of every tensor it returns."""

    reads: list[int] = []

    def __init__(self, file: str, framework: str):
        self._handle = _safe_open(file, framework=framework)

    def keys(self) -> list[str]:
        return self._handle.keys()

    def get_slice(self, key: str) -> object:
        return _RecordingSlice(self._handle.get_slice(key))

    def get_tensor(self, key: str) -> torch.Tensor:
        return _record(self._handle.get_tensor(key))


class _RecordingSlice:
    def __init__(self, piece: object):
        self._piece = piece

    def get_shape(self) -> list[int]:
        return self._piece.get_shape()

    def get_dtype(self) -> str:
        return self._piece.get_dtype()

    def __getitem__(self, index: object) -> torch.Tensor:
        return _record(self._piece[index])


def _record(t: torch.Tensor) -> torch.Tensor:
    _Recording.reads.append(t.numel() * t.element_size())
    return t


def memory(rank: int, world: int, root: str) -> None:
    """Each rank reads its own rows only: the bytes read are this rank's shards (half the model at 2 ranks), the
    largest read at most one tensor; a rank reading whole tensors would read the whole model."""
    model = linears(seed=1)
    _stage3(model, linear_step, torch.randn(2, WIDTH))
    import safetensors

    original = safetensors.safe_open  # sources.py opens files through it
    safetensors.safe_open = _Recording
    try:
        zgraph.load_pretrained(model, root)
    finally:
        safetensors.safe_open = original
    own = sum(p._local_tensor.numel() * p._local_tensor.element_size() for p in model.parameters())
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    one = WIDTH * WIDTH * 4
    read = sum(_Recording.reads)
    assert read <= own, f"rank {rank} read {read} bytes; its shards hold {own} (the model {whole})"
    assert max(_Recording.reads) <= one and own <= whole // world, (_Recording.reads, own, whole)
    _equal(zgraph.full_state_dict(model), linears(seed=0).state_dict())


def whole_and_failing(rank: int, world: int, root: str) -> None:
    """At stage 1 (parameters whole on every rank) each rank reads whole tensors; a checkpoint one rank cannot
    read fails the call on every rank (rank 0 names rank 1) and changes nothing; a meta model is materialised
    into stage-3 shards (``config``) and filled, and a step then runs on it."""
    model = linears(seed=1)
    _step_at(model, stage=1)
    zgraph.load_pretrained(model, root)
    _equal(model.state_dict(), linears(seed=0).state_dict())
    model = linears(seed=1)
    _step_at(model, stage=3)
    before = zgraph.full_state_dict(model)
    where = root if rank == 0 else os.path.join(root, "nowhere")
    try:
        zgraph.load_pretrained(model, where)
    except zgraph.CheckpointError as error:
        assert ("rank 1 failed" in str(error)) if rank == 0 else ("no checkpoint at" in str(error)), error
    else:
        raise AssertionError("load_pretrained succeeded where rank 1 could not read")
    _equal(zgraph.full_state_dict(model), before)
    with torch.device("meta"):
        model = linears(seed=1)
    config = zgraph.Config(stage=3, param_persistence_threshold=0, backend="eager")
    zgraph.load_pretrained(model, root, config=config)  # laid out as the step will: this rank's shards only
    assert all(p._local_tensor.shape[0] == WIDTH // world for p in model.parameters())
    _equal(zgraph.full_state_dict(model), linears(seed=0).state_dict())
    step = zgraph.distribute(config)(linear_step)
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, WIDTH))  # the step keeps the layout


def _step_at(model: nn.Module, stage: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = zgraph.distribute(stage=stage, param_persistence_threshold=0, backend="eager")(linear_step)
    step(model, opt, torch.randn(2, WIDTH))
