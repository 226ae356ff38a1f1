"""zgraph: shard a whole PyTorch training step — forward, backward, optimizer — as compiler passes over one graph.

import zgraph

@zgraph.distribute(zgraph.Config(stage=3))
def train_step(model, opt, batch):
    loss = loss_fn(model(batch.x), batch.y)
    loss.backward()
    opt.step(); opt.zero_grad()
    return loss
"""

from zgraph.checkpoint.gather import full_state_dict, gather
from zgraph.checkpoint.save_load import consolidate, load, save
from zgraph.config import Config, DynamicLossScale
from zgraph.deepspeed.optim import optimizer_from_deepspeed
from zgraph.errors import (
    CaptureError,
    CheckpointError,
    PipelineError,
    RankFailedError,
    RankMismatchError,
    ShardedParameterError,
    ZGraphError,
)
from zgraph.inspect.estimate import Estimate, EstimateError
from zgraph.step import DistributedStep, distribute
from zgraph.version import __version__ as __version__

__all__ = [
    "CaptureError",
    "CheckpointError",
    "Config",
    "DistributedStep",
    "DynamicLossScale",
    "Estimate",
    "EstimateError",
    "PipelineError",
    "RankFailedError",
    "RankMismatchError",
    "ShardedParameterError",
    "ZGraphError",
    "consolidate",
    "distribute",
    "full_state_dict",
    "gather",
    "load",
    "optimizer_from_deepspeed",
    "save",
]
