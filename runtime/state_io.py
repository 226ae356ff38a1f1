"""Graph I/O: a step graph's inputs read from the live training state, its outputs written back, each in the
layout the graph declares (``full`` or ``shard``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from zgraph.errors import ZGraphError
from zgraph.graph import ShardSpec
from zgraph.runtime.sharded_state import ShardingPlan
from zgraph.runtime.state import Binding


class StateIO:
    """Reads a step graph's inputs from the live training state and writes its outputs back, each in the
    layout the graph declares (``GraphInput.layout`` / ``GraphOutput.layout``: ``full`` or ``shard``)."""

    def __init__(self, binding: Binding, plan: ShardingPlan):
        self.binding = binding
        self.plan = plan

    def _whole(self, t: Tensor) -> Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t.detach()

    def _state_tensor(self, spec: Any, t: Tensor) -> Tensor:
        if spec.layout == "shard":
            return self.plan.padded(t, self.plan.specs[spec.index])
        return self._whole(t)

    def read(self, spec: Any, user_tensors: list, hyper: dict) -> Tensor:
        binding = self.binding
        kind = spec.kind
        if kind == "param":
            param = binding.params[spec.index].tensor
            if spec.layout == "shard" and self.plan.params_sharded(spec.index):
                self._check_laid_out(binding.params[spec.index].name, param, self.plan.specs[spec.index])
            return self._state_tensor(spec, param)
        if kind == "grad":
            return self._state_tensor(spec, binding.params[spec.index].tensor.grad)
        if kind == "opt_state":
            return self._state_tensor(spec, binding.optimizer_state_value(spec.optimizer, spec.index, spec.field))
        if kind == "buffer":
            return binding.buffers[spec.index].get()
        if kind == "hparam":
            return torch.tensor(hyper[(spec.optimizer, spec.group)][spec.field], dtype=torch.float64)
        if kind == "input":
            return user_tensors[spec.index][1].detach()
        if kind == "input_grad":
            return user_tensors[spec.index][1].grad
        if kind == "loss_scale":
            return binding.loss_scale_state[spec.field]
        raise AssertionError(f"unknown graph input kind {kind!r}")

    def _check_laid_out(self, name: str, param: Tensor, spec: ShardSpec) -> None:
        """A sharded parameter must still be a DTensor laid out as zgraph lays it, or its update (written into
        it after the step) would have nowhere to go; raised before the step runs."""
        if not (isinstance(param, DTensor) and self.plan.laid_out(param, spec)):
            raise ZGraphError(
                f"parameter {name} is no longer a DTensor sharded as zgraph shards it (now {type(param).__name__}, "
                f"placements {getattr(param, 'placements', None)}): something outside zgraph re-laid it out, so "
                "the step's update would be lost. Leave zgraph's parameters as they are between steps "
                "(zgraph.gather(model) gives whole ones to read or change)."
            )

    def write(self, role: Any, value: Tensor, user_tensors: list) -> None:
        binding = self.binding
        kind = role.kind
        sharded = role.layout == "shard"
        spec = self.plan.specs[role.index] if sharded else None
        if kind == "param":
            param = binding.params[role.index].tensor
            if sharded:
                self.plan.store(param, value, spec, adopt=True)  # laid out as zgraph lays it: read() checked
            else:
                param.data = value
        elif kind == "grad":
            param = binding.params[role.index].tensor
            param.grad = self.plan.store(param.grad, value, spec) if sharded else value
        elif kind == "opt_state":
            opt = binding.optimizers[role.optimizer].optimizer
            state = opt.state[binding.params[role.index].tensor]
            state[role.field] = self.plan.store(state.get(role.field), value, spec) if sharded else value
        elif kind == "buffer":
            buffer = binding.buffers[role.index].get()
            if buffer is not None and buffer.shape == value.shape and buffer.dtype == value.dtype:
                buffer.data = value
            else:
                binding.buffers[role.index].set(value)
        elif kind == "input":
            with torch.no_grad():
                user_tensors[role.index][1].copy_(value)
        elif kind == "input_grad":
            user_tensors[role.index][1].grad = value
        elif kind == "loss_scale":
            binding.loss_scale_state[role.field] = value
        else:
            raise AssertionError(f"unknown graph output kind {kind!r}")
