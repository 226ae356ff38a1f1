"""zgraph: shard a whole PyTorch training step — forward, backward, optimizer — as compiler passes over one graph.

import zgraph

@zgraph.distribute(zgraph.Config(stage=3))
def train_step(model, opt, batch):
    loss = loss_fn(model(batch.x), batch.y)
    loss.backward()
    opt.step(); opt.zero_grad()
    return loss

The house, bottom to top (each floor imports only the floors below it; ``tests/test_imports.py`` checks it)::

    graph.py ops.py sequence_ops.py host_ops.py errors.py tree.py version.py   the contract: what a step graph
                   means, zgraph's ops (sequence parallelism's all-to-alls, the update on the host's copies and
                   partitions among them), errors; sizes.py: symbolic sizes in a graph; graph_copy.py: the copy of a
                   graph a pass edits
    runtime/ (zgraph.runtime), passes/ (zgraph.passes)   process groups and state; the graph passes
    deepspeed/     DeepSpeed JSON configs read as plain values
    checkpoint/    zgraph.save / load / consolidate, zgraph.gather, full_state_dict, stream_state_dict
    config.py config_checks.py config_docs.py config_loss_scale.py config_deprecated.py   zgraph.Config
    capture/       the step traced into one functional aten graph (the capture protocol)
    binding/       the state a call reaches, bound once and laid out; the guard key
    compile/       a captured graph through the passes, lowered, and run against the live state
    inspect/       explain, dump, estimate, liveness
    weights/       big models: meta-device materialisation, load_pretrained, save_pretrained (streamed)
    dispatch.py step.py   one call along the data's way; @zgraph.distribute, the object that replaces the step
    sequence.py    zgraph.shard_sequence: a rank's slice of each sequence (Config.sequence_parallel)
    pipeline_data.py  zgraph.pipeline_batch: a rank's pipeline's rows of the batch (Config.pipeline_parallel, P x D)
    demos/ cli/    the demos and their models; the zgraph command (users of the library)
    integrations/  Hugging Face Trainer, accelerate and TRL run as zgraph steps (users of the library)
"""

from zgraph.binding.dynamic import mark_dynamic
from zgraph.checkpoint.gather import full_state_dict, gather, stream_state_dict
from zgraph.checkpoint.save_load import consolidate, load, save
from zgraph.config import Config, DynamicLossScale
from zgraph.deepspeed.optim import optimizer_from_deepspeed
from zgraph.errors import (
    CaptureError,
    CheckpointError,
    MemoryBudgetError,
    PassError,
    PipelineError,
    RankFailedError,
    RankMismatchError,
    ShardedParameterError,
    ZGraphError,
)
from zgraph.inspect.estimate import Estimate, EstimateError
from zgraph.inspect.pipeline_estimate import StageEstimate
from zgraph.pipeline_data import pipeline_batch
from zgraph.sequence import shard_sequence
from zgraph.step import DistributedStep, distribute
from zgraph.version import __version__ as __version__
from zgraph.weights.load import load_pretrained
from zgraph.weights.materialize import materialize
from zgraph.weights.save import save_pretrained

__all__ = [
    "shard_sequence",
    "CaptureError",
    "CheckpointError",
    "Config",
    "DistributedStep",
    "DynamicLossScale",
    "Estimate",
    "EstimateError",
    "MemoryBudgetError",
    "PassError",
    "PipelineError",
    "RankFailedError",
    "RankMismatchError",
    "ShardedParameterError",
    "StageEstimate",
    "ZGraphError",
    "consolidate",
    "distribute",
    "full_state_dict",
    "gather",
    "load",
    "load_pretrained",
    "mark_dynamic",
    "materialize",
    "optimizer_from_deepspeed",
    "pipeline_batch",
    "save",
    "save_pretrained",
    "stream_state_dict",
]
