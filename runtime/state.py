"""The training state a compiled step reads and writes: parameters, buffers, optimizers.

A ``Binding`` is built from the modules and optimizers a step call uses. It numbers every *unique* parameter
(tied parameters, the same tensor under several names, are one entry with several names) and every buffer,
and remembers where each lives (module attribute slots, optimizer param groups), so that capture can swap in
traced tensors and the executor can read inputs and write results back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from zgraph.errors import CaptureError
from zgraph.runtime.optimizers import class_name


@dataclass
class ParamRecord:
    """One unique parameter.

    Attributes:
        index: position among the binding's parameters (graph inputs are numbered by it).
        names: fully qualified names, first one canonical (tied parameters have several).
        slots: ``(module, attribute)`` pairs holding the parameter; empty for a tensor only an optimizer holds.
        tensor: the live object (``nn.Parameter``, or the optimizer's tensor).
    """

    index: int
    names: list[str]
    slots: list[tuple[nn.Module, str]]
    tensor: Tensor

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass
class BufferRecord:
    """One unique buffer, found through its module slots."""

    index: int
    names: list[str]
    slots: list[tuple[nn.Module, str]]

    @property
    def name(self) -> str:
        return self.names[0]

    def get(self) -> Tensor | None:
        module, attr = self.slots[0]
        return module._buffers.get(attr)

    def set(self, value: Tensor | None) -> None:
        for module, attr in self.slots:
            module._buffers[attr] = value


@dataclass
class OptimizerRecord:
    """One optimizer and, per param group, the binding indices of its parameters."""

    index: int
    name: str
    optimizer: torch.optim.Optimizer
    group_params: list[list[int]] = field(default_factory=list)


class Binding:
    """Modules and optimizers of a step call, with their parameters numbered once."""

    def __init__(self, modules: list[tuple[str, nn.Module]], optimizers: list[tuple[str, torch.optim.Optimizer]]):
        self.modules = modules
        self.plan: Any = None  # the ShardingPlan (zgraph.runtime.sharded_state), set when the step binds
        self.cost_model: Any = None  # the CostModel (zgraph.runtime.cost_model), set when the step binds
        self.loss_scale_state: dict[
            str, Tensor
        ] = {}  # fp16 loss scale carried between calls (zgraph.capture.precision)
        self.device = torch.device("cpu")  # where the state lives (zgraph.runtime.devices.state_device)
        self.backend: str | None = None  # the group's backend for that device; None: the group's own name
        self.offload: Any = None  # the offload tier's store (zgraph.runtime.offload), set when the step binds
        self.activations: Any = None  # the activation tier (zgraph.runtime.offload_activations), set likewise
        self.activations_window = 0  # its read-ahead and write-behind bytes (Config.prefetch_bytes)
        self.host_params: frozenset[int] = frozenset()  # parameters updated on the host (zgraph.runtime.host_state)
        self.host: Any = None  # their runner (zgraph.runtime.host_update.HostRunner), set when the step binds
        self.host_fallback: str | None = None  # why the update does not run on the host where it was to (explain())
        self.params: list[ParamRecord] = []
        self.buffers: list[BufferRecord] = []
        self._param_by_id: dict[int, int] = {}
        self._buffer_by_id: dict[int, int] = {}
        prefix_modules = len(modules) > 1
        for label, root in modules:
            prefix = f"{label}." if prefix_modules else ""
            for mod_name, module in root.named_modules(remove_duplicate=False):
                for attr, p in module._parameters.items():
                    if p is not None:
                        self._add_param(p, prefix + _join(mod_name, attr), (module, attr))
                for attr, b in module._buffers.items():
                    if b is not None:
                        self._add_buffer(b, prefix + _join(mod_name, attr), (module, attr))
        self.optimizers: list[OptimizerRecord] = []
        for o_index, (label, opt) in enumerate(optimizers):
            record = OptimizerRecord(o_index, label, opt)
            for g_index, group in enumerate(opt.param_groups):
                indices = []
                for p_index, p in enumerate(group["params"]):
                    if id(p) not in self._param_by_id:
                        self._add_param(p, f"{label}.param_groups[{g_index}][{p_index}]", None)
                    indices.append(self._param_by_id[id(p)])
                record.group_params.append(indices)
            self.optimizers.append(record)

    def _add_param(self, p: Tensor, name: str, slot: tuple[nn.Module, str] | None) -> None:
        index = self._param_by_id.get(id(p))
        if index is None:
            index = len(self.params)
            self._param_by_id[id(p)] = index
            self.params.append(ParamRecord(index, [], [], p))
        record = self.params[index]
        if name not in record.names:
            record.names.append(name)
        if slot is not None and slot not in record.slots:
            record.slots.append(slot)

    def _add_buffer(self, b: Tensor, name: str, slot: tuple[nn.Module, str]) -> None:
        index = self._buffer_by_id.get(id(b))
        if index is None:
            index = len(self.buffers)
            self._buffer_by_id[id(b)] = index
            self.buffers.append(BufferRecord(index, [], []))
        record = self.buffers[index]
        record.names.append(name)
        if slot not in record.slots:
            record.slots.append(slot)

    def replace_param(self, index: int, new: Tensor) -> None:
        """Record that parameter ``index`` is now the tensor ``new`` (sharding replaces parameters)."""
        old = self.params[index].tensor
        del self._param_by_id[id(old)]
        self._param_by_id[id(new)] = index
        self.params[index].tensor = new

    def param_index(self, t: Tensor) -> int | None:
        """Index of ``t`` if it is one of the bound parameters."""
        return self._param_by_id.get(id(t))

    def buffer_index(self, t: Tensor) -> int | None:
        index = self._buffer_by_id.get(id(t))
        if index is not None and self.buffers[index].get() is t:
            return index
        return None

    def optimizer_state(self, o_index: int, p_index: int) -> dict:
        """The live ``optimizer.state`` entry of a parameter (empty dict if the optimizer has none yet)."""
        opt = self.optimizers[o_index].optimizer
        return opt.state.get(self.params[p_index].tensor, {})

    def optimizer_state_value(self, o_index: int, p_index: int, key: str) -> Any:
        """One value of a parameter's optimizer state; a ``CaptureError`` naming the optimizer if it has none."""
        state = self.optimizer_state(o_index, p_index)
        if key not in state:
            raise missing_state(self, o_index, p_index, key)
        return state[key]


def missing_state(binding: Binding, o_index: int, p_index: int, key: str) -> CaptureError:
    """The error for graph-read optimizer state that is not where the optimizer keeps its state."""
    record = binding.optimizers[o_index]
    return CaptureError(
        f"zgraph cannot read the state of the optimizer {record.name!r} ({class_name(record.optimizer)}): the "
        f"step's graph reads its {key!r} of parameter {binding.params[p_index].name}, which its `state` does not "
        "hold. zgraph reads optimizer state from `optimizer.state`, keyed by the parameters in `param_groups`, as "
        "torch.optim keeps it; an optimizer that keeps its state elsewhere cannot be stepped in a zgraph step."
    )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def state_tensors(binding: Binding) -> list[Tensor]:
    """The tensors that must be on the step's device: parameters, buffers and optimizer state of a parameter's
    rank (0-d state such as ``step`` counters stays where torch.optim keeps it, on the host)."""
    out = [r.tensor for r in binding.params]
    out += [b for b in (r.get() for r in binding.buffers) if b is not None]
    for o in binding.optimizers:
        for state in o.optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, Tensor) and v.dim() > 0]
    return out
