"""The graph inputs of a step call: every parameter, ``.grad`` present on entry, buffer, optimizer state tensor,
numeric optimizer hyper-parameter, tensor argument (and its ``.grad``) and loss-scale state, in graph order, with
the tensors they are read from; and their fake stand-ins for a trace."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext, StrictMinMaxConstraint
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.value_ranges import ValueRanges

from zgraph.capture.as_written import hyperparameters
from zgraph.errors import CaptureError
from zgraph.graph import GraphInput
from zgraph.runtime.state import Binding


@dataclass
class Inputs:
    """The graph inputs of a step call, in graph order, with the tensors they are read from."""

    specs: list[GraphInput]
    values: list[Tensor]  # real tensors (or fakes made from metadata) in spec order
    homes: dict[int, torch.device] = field(default_factory=dict)  # position: the device a host tensor stands in for


def collect_inputs(binding: Binding, user_tensors: list[tuple[str, Tensor]]) -> Inputs:
    """The graph inputs of a step call, in graph order, with the tensors they are read from."""
    specs: list[GraphInput] = []
    values: list[Tensor] = []

    def add(spec: GraphInput, value: Tensor) -> None:
        specs.append(spec)
        values.append(value)

    for r in binding.params:
        add(GraphInput("param", r.name, r.index), r.tensor)
    for r in binding.params:
        if r.tensor.grad is not None:
            add(GraphInput("grad", r.name, r.index), r.tensor.grad)
    for r in binding.buffers:
        value = r.get()
        if value is not None:
            add(GraphInput("buffer", r.name, r.index), value)
    for o in binding.optimizers:
        for i in sorted({i for indices in o.group_params for i in indices}):
            for key, value in binding.optimizer_state(o.index, i).items():
                if isinstance(value, Tensor):
                    name = f"{binding.params[i].name}:{key}"
                    add(GraphInput("opt_state", name, i, field=key, optimizer=o.index), value)
    for o in binding.optimizers:
        for g_index, group in enumerate(o.optimizer.param_groups):
            for hp_name, hp_value in hyperparameters(o.optimizer, group).items():
                name = f"{o.name}.group{g_index}:{hp_name}"
                add(GraphInput("hparam", name, g_index, field=hp_name, optimizer=o.index, group=g_index), hp_value)
    for leaf_index, (path, t) in enumerate(user_tensors):
        add(GraphInput("input", path, leaf_index), t)
    for leaf_index, (path, t) in enumerate(user_tensors):
        if t.is_leaf and t.grad is not None:  # a non-leaf holds none (and torch warns when it is read)
            add(GraphInput("input_grad", f"{path}.grad", leaf_index), t.grad)
    for name, value in binding.loss_scale_state.items():
        add(GraphInput("loss_scale", f"loss_scale:{name}", 0, field=name), value)
    # a parameter the host updates: its state in host memory is traced as the device's (zgraph.runtime.host_state)
    homes = {
        k: binding.device
        for k, (spec, value) in enumerate(zip(specs, values))
        if spec.kind in ("param", "grad", "opt_state") and spec.index in binding.host_params and value.dim() > 0
    }
    return Inputs(specs, values, homes)


def fake_inputs(
    mode: FakeTensorMode,
    inputs: Inputs,
    meta_as: torch.device | None = None,
    dynamic: Mapping[str, Collection[int]] | None = None,
) -> list[Tensor]:
    """Fake stand-ins of the inputs; a meta tensor stands for one on ``meta_as`` when that is given (estimates
    trace models that hold no memory). ``dynamic``: argument path -> the dims of that user tensor (and of its
    ``.grad``) whose sizes are symbols of the capture's ShapeEnv (backed, hinted with this call's size)."""
    dynamic = dynamic or {}
    fakes = []
    for k, (spec, value) in enumerate(zip(inputs.specs, inputs.values)):
        if spec.kind == "hparam":
            with mode:
                fakes.append(torch.empty((), dtype=torch.float64))
            continue
        home = inputs.homes.get(k)
        if isinstance(value, DTensor):  # sharded state: the graph is captured on the whole (logical) tensor
            device = meta_as if value.is_meta and meta_as is not None else value._local_tensor.device
            with mode:
                fake = torch.empty(value.shape, dtype=value.dtype, device=home or device)
        elif home is not None:
            with mode:
                fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=home)
        elif spec.kind in ("input", "input_grad") and argument_path(spec) in dynamic:
            fake = _symbolic(mode, value.detach(), spec.name, dynamic[argument_path(spec)], meta_as)
        elif value.is_meta and meta_as is not None:
            fake = mode.fake_tensor_converter.from_meta_and_device(mode, value.detach(), meta_as)
        else:
            fake = mode.from_tensor(value.detach(), static_shapes=True)
        if spec.kind in ("param", "input") and value.requires_grad:
            fake.requires_grad_(True)
        fakes.append(fake)
    return fakes


def argument_path(spec: GraphInput) -> str:
    """The argument path of a user tensor input (of its ``.grad`` for an ``input_grad``)."""
    return spec.name.removesuffix(".grad") if spec.kind == "input_grad" else spec.name


def _symbolic(
    mode: FakeTensorMode, value: Tensor, name: str, dims: Collection[int], meta_as: torch.device | None = None
) -> Tensor:
    """A fake of ``value`` whose sizes in ``dims`` are backed symbols, a symbol each (not torch's duck sizing, where
    sizes equal at this call would share one, and a later call where they differ would break its guard); sizes 0
    and 1 are specialized, as torch does; ``dims`` may map a dim to its declared ``(min, max)`` (either
    None), which becomes the symbol's value range (as ``torch._dynamo.mark_dynamic``'s does); a meta ``value``
    stands for one on ``meta_as`` (estimates)."""
    sizes = [DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(value.dim())]
    ranges = dims if isinstance(dims, Mapping) else {}
    constraints = [_range_constraint(ranges.get(d, (None, None))) for d in range(value.dim())]
    context = StatelessSymbolicContext(dynamic_sizes=sizes, constraint_sizes=constraints)
    from torch._dynamo.source import LocalSource  # torch._dynamo is imported only where needed

    stands_for = meta_as if value.is_meta and meta_as is not None else None
    if stands_for is not None:  # a fake is made from a tensor with memory: the CPU's, moved (as fakes) after
        value = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
    fake = mode.from_tensor(value, static_shapes=False, symbolic_context=context, source=LocalSource(name))
    if stands_for is not None and stands_for.type != "cpu":
        with mode:
            fake = fake.to(stands_for)
    return fake


def _range_constraint(bounds: tuple[int | None, int | None]) -> StrictMinMaxConstraint | None:
    lo, hi = bounds
    if lo is None and hi is None:
        return None
    upper = int_oo if hi is None else hi
    return StrictMinMaxConstraint(vr=ValueRanges(lower=lo or 0, upper=upper), warn_only=False)


def check_dense(inputs: Inputs) -> None:
    """Only dense tensors can be graph inputs."""
    for spec, value in zip(inputs.specs, inputs.values):
        if spec.kind == "hparam":
            continue
        if not isinstance(value, Tensor) or value.is_sparse:
            raise CaptureError(f"{spec.name}: only dense tensors can be graph inputs, got {type(value).__name__}")
