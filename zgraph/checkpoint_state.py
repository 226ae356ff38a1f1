"""What a zgraph checkpoint holds, and how it is matched against a model and optimizers: the DCP state dict and
manifest ``save`` writes, the checks ``load`` makes before reading, and the staging tensors it reads into."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from zgraph.checkpoint_data import Encoder, rng_state
from zgraph.errors import CheckpointError
from zgraph.runtime.sharded_state import sharding_of

FORMAT = "zgraph-checkpoint"
FORMAT_VERSION = 2

MODEL = "model."
DATA = "zgraph.data"  # tensors of the non-tensor values (extra, scheduler, hyper-parameters...), written by rank 0
RNG = "zgraph.rng."  # ``zgraph.rng.<rank>.<n>``: tensors of each rank's RNG states, written by that rank
# The attribute a zgraph step with ``Config.loss_scale`` keeps its loss-scale state in (zgraph/step.py), per optimizer
LOSS_SCALE_ATTR = "_zgraph_loss_scale"

OptimizerArg = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


# ------------------------------------------------------------------------------------------------ naming
def as_list(optimizer: OptimizerArg) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return list(optimizer)


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` (a tied parameter gets its first name, as ``named_parameters()`` gives)."""
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_params(opt: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def group_names(opt: torch.optim.Optimizer, names: dict[int, str], index: int) -> list[list[str]]:
    """The names of the optimizer's parameters, group by group."""
    out = []
    for g, group in enumerate(opt.param_groups):
        fqns = []
        for p_index, p in enumerate(group["params"]):
            if id(p) not in names:
                raise CheckpointError(
                    f"optimizer {index} ({type(opt).__name__}) holds a tensor of shape {tuple(p.shape)} (param_groups"
                    f"[{g}]['params'][{p_index}]) that is not a parameter of the model: checkpoints name optimizer "
                    "state after the model's parameters"
                )
            fqns.append(names[id(p)])
        out.append(fqns)
    return out


# ------------------------------------------------------------------------------------------------ saving
def saved_state(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    scheduler: Any,
    extra: Mapping[str, Any] | None,
    rank: int,
    world: int,
) -> tuple[dict[str, Tensor], dict[str, Any], Any]:
    """``(tensors, manifest, rng)``: the DCP state dict this rank writes, the manifest (rank 0's is written) and
    this rank's RNG states as a tree. Whole tensors are written by rank 0 only, ``DTensor`` shards by every rank.
    Raises ``CheckpointError`` for a value that cannot be stored as data, before anything is written."""
    names = parameter_names(model)
    tensors: dict[str, Tensor] = {}
    data = Encoder(DATA, tensors)
    model_state = model.state_dict()
    model_values = {}
    for key, value in model_state.items():
        if isinstance(value, Tensor) and not isinstance(value, DTensor) and type(value) not in (Tensor, nn.Parameter):
            raise CheckpointError(f"cannot save model[{key!r}]: a {type(value).__name__}")
        if isinstance(value, Tensor):
            tensors[MODEL + key] = value
        else:
            model_values[key] = data.encode(value, f"model.state_dict()[{key!r}]")
    optimizers_out = []
    for i, opt in enumerate(optimizers):
        fqn_groups = group_names(opt, names, i)
        values = {}
        for param, fqn in zip(optimizer_params(opt), (f for g in fqn_groups for f in g)):
            for field, value in opt.state.get(param, {}).items():
                key = f"optim.{i}.state.{fqn}.{field}"
                if isinstance(value, Tensor):
                    tensors[key] = value
                else:
                    values[key] = data.encode(value, f"optimizer {i} state[{fqn!r}][{field!r}]")
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
        loss_scale = getattr(opt, LOSS_SCALE_ATTR, None)
        optimizers_out.append(
            {
                "class": type(opt).__name__,
                "param_groups": fqn_groups,
                "hyper": data.encode(hyper, f"optimizer {i} param_groups"),
                "state_values": values,
                "loss_scale": data.encode(dict(loss_scale), f"optimizer {i} loss scale") if loss_scale else None,
            }
        )
    scheduler_tree = data.encode(scheduler.state_dict(), "scheduler.state_dict()") if scheduler is not None else None
    extra_tree = data.encode(dict(extra), "extra") if extra is not None else None
    rng = Encoder(f"{RNG}{rank}", tensors).encode(rng_state(), f"rank {rank}'s RNG state")
    if rank != 0:  # whole tensors are written once, by rank 0
        tensors = {k: v for k, v in tensors.items() if isinstance(v, DTensor) or k.startswith(f"{RNG}{rank}.")}
    found = sharding_of(model)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "zgraph_version": _zgraph_version(),
        "torch_version": torch.__version__,
        "world_size": world,
        "stage": found[0].stage if found is not None else None,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model_keys": list(model_state),
        "model_values": model_values,
        "optimizers": optimizers_out,
        "scheduler": scheduler_tree,
        "extra": extra_tree,
    }
    return tensors, manifest, rng


# ------------------------------------------------------------------------------------------------ checking
def check_model(model_state: dict[str, Any], metadata: dict[str, Any], manifest: dict[str, Any]) -> None:
    """Raise ``CheckpointError`` listing every key of the model the checkpoint lacks, every model key of the
    checkpoint the model lacks, and every key whose shape differs."""
    saved: dict[str, Any] = {key: None for key in manifest.get("model_values", {})}
    saved.update({key[len(MODEL) :]: meta for key, meta in metadata.items() if key.startswith(MODEL)})
    missing = [key for key in model_state if key not in saved]
    unexpected = [key for key in saved if key not in model_state]
    misshaped = []
    for key, value in model_state.items():
        if key not in saved:
            continue
        meta = saved[key]
        if isinstance(value, Tensor) != (meta is not None) or (
            meta is not None and tuple(meta.size) != tuple(value.shape)
        ):
            here = str(tuple(value.shape)) if isinstance(value, Tensor) else "a non-tensor value"
            there = str(tuple(meta.size)) if meta is not None else "a non-tensor value"
            misshaped.append(f"{key}: checkpoint {there}, model {here}")
    if missing or unexpected or misshaped:
        raise CheckpointError(mismatch_message("the model", missing, unexpected, misshaped))


def mismatch_message(what: str, missing: list[str], unexpected: list[str], misshaped: list[str]) -> str:
    lines = [f"the checkpoint does not match {what}; nothing was loaded"]
    if missing:
        lines.append(f"missing in the checkpoint ({len(missing)}): " + ", ".join(missing))
    if unexpected:
        lines.append(f"unexpected (in the checkpoint, not in {what}) ({len(unexpected)}): " + ", ".join(unexpected))
    if misshaped:
        lines.append(f"shape mismatch ({len(misshaped)}):\n  " + "\n  ".join(misshaped))
    return "\n".join(lines)


def check_optimizers(
    optimizers: list[torch.optim.Optimizer], names: dict[int, str], manifest: dict, metadata: dict[str, Any]
) -> None:
    """Raise ``CheckpointError`` if an optimizer's class, parameters or param groups differ from the saved."""
    saved = manifest.get("optimizers", [])
    if len(optimizers) > len(saved):
        raise CheckpointError(f"{len(optimizers)} optimizer(s) given, the checkpoint holds {len(saved)}")
    for i, opt in enumerate(optimizers):
        if saved[i].get("class") != type(opt).__name__:
            raise CheckpointError(
                f"optimizer {i} is a {type(opt).__name__}, the checkpoint holds the state of a "
                f"{saved[i].get('class')}; nothing was loaded"
            )
        groups = group_names(opt, names, i)
        saved_groups = saved[i]["param_groups"]
        if groups != saved_groups:
            here = {f for g in groups for f in g}
            there = {f for g in saved_groups for f in g}
            missing = [f for g in groups for f in g if f not in there]
            unexpected = [f for g in saved_groups for f in g if f not in here]
            detail = mismatch_message(f"optimizer {i}'s parameters", missing, unexpected, [])
            raise CheckpointError(
                f"{detail}\nparam_groups: checkpoint {[len(g) for g in saved_groups]} parameters per group, "
                f"optimizer {[len(g) for g in groups]}"
            )
        prefix = f"optim.{i}.state."
        fqns = {f for g in groups for f in g}
        keys = [key for key in metadata if key.startswith(prefix)] + list(saved[i].get("state_values", {}))
        unexpected = [key for key in keys if split_state_key(key[len(prefix) :], fqns) is None]
        if unexpected:
            raise CheckpointError(mismatch_message(f"optimizer {i}'s parameters", [], unexpected, []))


def split_state_key(rest: str, fqns: set[str]) -> tuple[str, str] | None:
    """``"l1.weight.exp_avg" -> ("l1.weight", "exp_avg")`` for a known parameter name, else None."""
    cut = rest.rfind(".")
    while cut > 0:
        if rest[:cut] in fqns:
            return rest[:cut], rest[cut + 1 :]
        cut = rest.rfind(".", 0, cut)
    return None


# ------------------------------------------------------------------------------------------------ staging
def model_targets(model_state: dict[str, Any]) -> dict[str, Tensor]:
    """Empty tensors like the model's (``DTensor`` for a ``DTensor``: same shards), to read into."""
    return {MODEL + k: torch.empty_like(v) for k, v in model_state.items() if isinstance(v, Tensor)}


def state_targets(
    model: nn.Module, opt: torch.optim.Optimizer, index: int, names: dict[int, str], metadata: dict[str, Any]
) -> tuple[dict[str, Tensor], dict[Tensor, dict[str, Any]]]:
    """``(targets, new_state)``: new optimizer state to read into, per parameter: for each saved field a zero
    tensor of the saved shape, in the dtype of the optimizer's current state (the saved dtype if it has none
    yet), laid out as zgraph keeps that state now (a padded shard when sharded, else whole)."""
    found = sharding_of(model)
    bound = found is not None and any(o.optimizer is opt for o in found[1].optimizers)
    prefix = f"optim.{index}.state."
    by_name = {names[id(p)]: p for p in optimizer_params(opt)}
    fqns = set(by_name)
    targets: dict[str, Tensor] = {}
    new_state: dict[Tensor, dict[str, Any]] = {}
    for key, meta in metadata.items():
        if not key.startswith(prefix):
            continue
        fqn, field = split_state_key(key[len(prefix) :], fqns)
        param = by_name[fqn]
        target = None
        size, dtype = tuple(meta.size), meta.properties.dtype
        live = opt.state[param].get(field) if param in opt.state else None
        if isinstance(live, Tensor) and tuple(live.shape) == size:
            dtype = live.dtype  # the dtype the run keeps this state in (Config.optimizer_state_dtype)
        device = param.device if not isinstance(param, DTensor) else param.to_local().device
        if bound and size == tuple(param.shape):
            plan, binding = found
            p_index = binding.param_index(param)
            spec = plan.specs[p_index] if p_index is not None else None
            if plan.group.distributed and plan.stage >= 1 and spec is not None and spec.shape == size:
                target = plan.wrap(torch.zeros(spec.shard_shape, dtype=dtype, device=device), spec)
        if target is None and isinstance(param, DTensor) and size == tuple(param.shape):
            target = torch.zeros_like(param, dtype=dtype)
        if target is None:
            target = torch.zeros(size, dtype=dtype, device=device)
        targets[key] = target
        new_state.setdefault(param, {})[field] = target
    return targets, new_state


def restore_loss_scale(opt: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
    """Put the saved loss-scale state into the dict a zgraph step reads it from (in place: the step's binding
    shares it; only the fields the step's ``Config.loss_scale`` has, on the device it keeps them on); before any
    step, leave it on the optimizer for the first step to start from."""
    current = getattr(opt, LOSS_SCALE_ATTR, None)
    if isinstance(current, dict):
        for key, value in loaded.items():
            if key in current:
                here = current[key]
                on_device = isinstance(value, Tensor) and isinstance(here, Tensor)
                current[key] = value.to(here.device) if on_device else value
    else:
        setattr(opt, LOSS_SCALE_ATTR, dict(loaded))


def _zgraph_version() -> str:
    import zgraph

    return getattr(zgraph, "__version__", "unknown")
