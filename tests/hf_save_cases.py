"""A tiny Hugging Face GPT-2 trained at ZeRO-3 on 2 ranks, then saved with ``save_pretrained`` (run by
``test_models_save.py``; needs transformers)."""

from __future__ import annotations

import os

import torch
from hf_cases import _lm_batches, _local, gpt2, train_step
from transformers import GPT2LMHeadModel

import zgraph


def save_pretrained_at_stage3(rank: int, world: int, out_dir: str) -> None:
    """Without gathering, save_pretrained raises zgraph's ShardedParameterError naming what to do; with
    ``state_dict=zgraph.full_state_dict(model)`` rank 0 writes a checkpoint that loads with no zgraph and equals
    the gathered parameters."""
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = zgraph.distribute(stage=3, param_persistence_threshold=0, backend="eager")(train_step)
    for batch in _lm_batches()[:2]:
        step(model, opt, *_local(batch, rank, world))
    try:  # transformers writes on rank 0 only; there the sharded tensors reach safetensors
        model.save_pretrained(os.path.join(out_dir, "raw"))
    except zgraph.ShardedParameterError as error:
        assert rank == 0 and "zgraph.full_state_dict" in str(error) and "gather" in str(error), error
    else:
        assert rank != 0, "save_pretrained wrote a sharded model without an error"
    state = zgraph.full_state_dict(model)
    whole = os.path.join(out_dir, "whole")
    if rank == 0:
        model.save_pretrained(whole, state_dict=state)
    torch.distributed.barrier()
    loaded = GPT2LMHeadModel.from_pretrained(whole)
    for name, value in loaded.state_dict().items():
        if name in state:
            torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)
