"""zgraph's graph passes (installed as ``zgraph.passes``): each one file, ``fn(gm, ctx) -> gm``.

``default_passes()`` is the ordered list ``@zgraph.distribute`` runs; see each pass's module docstring for
what it does and what later passes may rely on.

Files::

    pass_list.py             named passes with contracts, run in order, each leaving a graph to inspect
    provenance.py            every node a pass creates is stamped with the pass's name, by a hook
    graph_utils.py           helpers the passes share: graph outputs and their roles, shard values
    cse.py                   ``cse``: merge nodes computing the same pure op on the same inputs
    sequence_parallel.py     ``sequence_parallel`` (Ulysses): all-to-alls around attention, positions moved
    remat.py                 ``remat``: forward values recomputed in the backward instead of kept
    offload_activations.py   ``offload_activations``: saved activations kept in a slower tier until the backward
    reduce_scatter_grads.py  ``reduce_scatter_grads``: local gradients become the global batch's
    shard_optimizer.py       ``shard_optimizer`` (stage >= 1): each rank updates only its shard
    shard_params.py          ``shard_params`` (stage 3): parameters enter and leave as this rank's shard
    clip_grad.py             ``clip_grad``: norms of sharded gradients from the shards, one all-reduce
    loss_scale.py            ``loss_scale``: the fp16 overflow check sees every rank's gradients
    cast.py                  ``cast``: dtype casts moved to where they save the most
    offload.py               ``offload``: optimizer states and parameter shards moved to a slower tier
    host_update.py           ``host_update``: the optimizer update of host-resident state placed on the host
    secondary_shards.py      ``secondary_shards`` (hpZ): the backward re-gathers within a group, from the forward
    bucket.py                ``bucket``: layout operators of one kind merged into buckets
    lower_collectives.py     ``lower_collectives``: layout operators become functional collectives
    schedule.py              ``schedule``: the lowered graph ordered so communication overlaps compute
    partition.py             a split step's joint graph cut into a forward and a backward graph
    micro_batch_loss.py      ``micro_batch_loss`` (pipeline parallelism): how the loss combines over micro-batches
    sample_flow.py           each forward value's batch dimension; the ops that combine samples
    token_mean.py            a cross_entropy token mean made a sum over another count (sequence, pipeline)
    token_count.py           a pipelined token mean's count from the step's inputs, before any micro-batch runs
    sizes_from_inputs.py     ``sizes_from_inputs`` (pipelines): symbolic sizes computed from the step's arguments
    stage_cut.py             ``stage_cut`` (pipeline parallelism): each node stamped with its stage and part
    stage_balance.py         the cut's balance: blocks' forward flops grouped into stages
    stage_totals.py          a global gradient norm or overflow check cut into per-stage partials and a total
    stage_graphs.py          a graph ``stage_cut`` stamped taken apart: each stage's forward, backward, update
    stage_grads.py           ``stage_grads`` (pipelines, ZeRO >= 1): a stage's update reduces its gradients itself
    stage_gather.py          ``stage_gather`` (pipelines, ZeRO 3): the graph gathering a stage's parameters per step
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from zgraph.passes.bucket import bucket
from zgraph.passes.cast import cast, cast_applies
from zgraph.passes.clip_grad import clip_grad, clip_grad_applies
from zgraph.passes.cse import eliminate_common_subexpressions
from zgraph.passes.host_update import host_update, host_update_applies
from zgraph.passes.loss_scale import loss_scale, loss_scale_applies
from zgraph.passes.lower_collectives import lower_collectives, lower_collectives_applies
from zgraph.passes.offload import offload, offload_applies
from zgraph.passes.offload_activations import offload_activations, offload_activations_applies
from zgraph.passes.pass_list import (
    CAPTURED_PROPERTIES,
    PROPERTY_CHECKS,
    Pass,
    PassContext,
    PassRecord,
    build_pass_list,
    check_contracts,
    run_passes,
    with_group,
)
from zgraph.passes.reduce_scatter_grads import reduce_scatter_grads
from zgraph.passes.remat import remat, remat_applies
from zgraph.passes.schedule import schedule
from zgraph.passes.secondary_shards import secondary_shards, secondary_shards_applies
from zgraph.passes.sequence_parallel import sequence_parallel, sequence_parallel_applies
from zgraph.passes.shard_optimizer import shard_optimizer, shard_optimizer_applies
from zgraph.passes.shard_params import shard_params, shard_params_applies

# each default pass's ``Pass.applies``: where its options and the context leave it nothing to do, it is not run
_APPLIES = {
    "sequence_parallel": sequence_parallel_applies,
    "remat": remat_applies,
    "offload_activations": offload_activations_applies,
    "shard_optimizer": shard_optimizer_applies,
    "shard_params": shard_params_applies,
    "cast": cast_applies,
    "clip_grad": clip_grad_applies,
    "loss_scale": loss_scale_applies,
    "offload": offload_applies,
    "host_update": host_update_applies,
    "secondary_shards": secondary_shards_applies,
    "bucket": with_group,
    "lower_collectives": lower_collectives_applies,
    "schedule": with_group,
}


def default_passes(
    *,
    stage: int = 0,
    max_reuse_distance: int = 0,
    allgather_bucket_bytes: int | str = "auto",
    reduce_bucket_bytes: int | str = "auto",
    prefetch_bytes: int | str = "auto",
    reduce_dtype: torch.dtype | None = None,
    cross_group_dtype: torch.dtype | None = None,
    offload_optimizer: str | None = None,
    offload_fraction: float = 1.0,
    offload_params: str | None = None,
    remat_policy: str | None = None,
    offload_activations_tier: str | None = None,
) -> list[Pass]:
    """The passes of a distributed step, in order, with their options bound (``functools.partial``).

    The options are ``zgraph.Config``'s (``Config.pass_options()``; the defaults are ``Config()``'s), except
    ``reduce_dtype``: the dtype gradients are reduced in (``Config.reduce_dtype``, else ``param_dtype``)."""
    bind, reduced = functools.partial, {"grads_reduced"}
    passes = [
        Pass("cse", eliminate_common_subexpressions),
        Pass("sequence_parallel", sequence_parallel, requires={"phases"}),
        Pass("remat", bind(remat, policy=remat_policy), requires={"phases"}),
        Pass("offload_activations", bind(offload_activations, tier=offload_activations_tier), requires={"phases"}),
        Pass("shard_optimizer", bind(shard_optimizer, stage=stage), requires={"phases"}),
        Pass(
            "reduce_scatter_grads",
            bind(reduce_scatter_grads, stage=stage),
            requires={"phases", "grad_markers"},
            provides={"grads_reduced"},
        ),
        Pass(
            "shard_params",
            bind(shard_params, stage=stage, max_reuse_distance=max_reuse_distance),
            requires={"phases"},
        ),
        Pass("cast", bind(cast, reduce_dtype=reduce_dtype, cross_group_dtype=cross_group_dtype), requires=reduced),
        Pass("clip_grad", clip_grad, requires={"grads_reduced"}),
        Pass("loss_scale", loss_scale, requires={"grads_reduced"}),
        Pass(
            "offload",
            bind(offload, tier=offload_optimizer, fraction=offload_fraction, params=offload_params),
            requires={"grads_reduced"},
        ),
        Pass("host_update", bind(host_update, offload_params=offload_params), requires={"grads_reduced"}),
        Pass("secondary_shards", bind(secondary_shards, stage=stage), requires={"phases"}),
        Pass(
            "bucket",
            bind(bucket, allgather_bytes=allgather_bucket_bytes, reduce_bytes=reduce_bucket_bytes),
            requires={"grads_reduced"},
        ),
        Pass("lower_collectives", lower_collectives, requires={"grads_reduced"}, provides={"collectives_lowered"}),
        Pass(
            "schedule",
            bind(schedule, prefetch_bytes=prefetch_bytes, allgather_bytes=allgather_bucket_bytes),
            requires={"collectives_lowered"},
        ),
    ]
    return [dataclasses.replace(p, applies=_APPLIES.get(p.name)) for p in passes]


__all__ = [
    "CAPTURED_PROPERTIES",
    "PROPERTY_CHECKS",
    "Pass",
    "PassContext",
    "PassRecord",
    "build_pass_list",
    "check_contracts",
    "default_passes",
    "run_passes",
]
