"""Running a compiled variant against the live state: its inputs read from the modules, optimizers and arguments,
the graph run (with the offload tier serving its reload and write-back nodes), the new state written back, and
what the graph does not hold restored (None grads, Python state, LR schedulers stepped after the update)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from torch import Tensor

from zgraph.capture.as_written import hyperparameters
from zgraph.capture.captured import Returned
from zgraph.compile.variant import CompiledStep
from zgraph.graph import INPUT, OFFLOADED, VAL, placeholders, state_key, tensor_bytes
from zgraph.host_ops import host_tier
from zgraph.ops import offload_tier
from zgraph.runtime.executor import Executable
from zgraph.runtime.host_update import HostRunner
from zgraph.runtime.offload_activations import ActivationStash, unstash_order
from zgraph.runtime.offload_store import TierStore
from zgraph.runtime.state import Binding
from zgraph.runtime.state_io import StateIO
from zgraph.tree import map_leaves


def run(compiled: CompiledStep, binding: Binding, user_tensors: list[tuple[str, Tensor]]) -> object:
    """Run ``compiled`` on the live state: read its inputs, run the graph, write the new state back, restore what
    the graph does not hold (None grads, Python state, LR schedulers stepped after the update); returns the
    step's result."""
    io = StateIO(binding, binding.plan)
    store = compiled.offload = getattr(binding, "offload", None)
    compiled.host, compiled.host_fallback = binding.host, binding.host_fallback
    hyper: dict[tuple[int, int], dict[str, float]] = {}
    for spec in compiled.input_specs:
        if spec.kind == "hparam" and (spec.optimizer, spec.group) not in hyper:
            opt = binding.optimizers[spec.optimizer].optimizer
            hyper[(spec.optimizer, spec.group)] = hyperparameters(opt, opt.param_groups[spec.group])
    inputs = [io.read(spec, user_tensors, hyper) for spec in compiled.input_specs]
    outputs = list(_run_graph(compiled, binding, store, inputs))
    unalias(outputs, inputs, compiled.executable.updated_inputs)
    user_values = []
    for value, role in zip(outputs, compiled.output_roles):
        if role.kind == "user":
            user_values.append(value)
        elif role.kind != OFFLOADED:  # the graph wrote those to the offload tier itself
            io.write(role, value, user_tensors)
    return finish_call(compiled, binding, user_tensors, user_values)


def _run_graph(compiled: CompiledStep, binding: Binding, store: TierStore | None, inputs: list) -> Sequence:
    """Run the graph, with the offload tier serving its reload / write_back nodes and the activation tier its
    stash / unstash nodes (``Config.offload_activations``), where it has them."""
    tier = getattr(binding, "activations", None)
    order = unstash_order(compiled.final) if tier is not None else []
    graph = hosted(binding, compiled.executable, inputs)
    if order:
        window = binding.activations_window
        graph = functools.partial(run_stashed, ActivationStash(tier, order, window, store), graph)
    return _run_offloaded(compiled, store, inputs, graph) if store is not None else graph()


def hosted(binding: Binding, executable: Executable, inputs: list) -> Callable[[], Sequence]:
    """Running ``executable`` on ``inputs``: with the binding's host runner serving its host update operators
    where it has them (``Config.offload_update="host"``)."""
    runner = getattr(binding, "host", None)
    if runner is None or executable.host_parts is None:
        return lambda: executable.run(inputs)
    return functools.partial(run_hosted, runner, executable.host_parts, lambda: executable.run(inputs))


def run_hosted(runner: HostRunner, parts: list, run_graph: Callable[[], Sequence]) -> Sequence:
    """``run_graph()`` with ``runner`` serving its copies and running its host partitions ``parts``; what it
    started is finished after it (or its failure)."""
    runner.begin(parts)
    try:
        with host_tier(runner):
            outputs = run_graph()
    except BaseException:
        runner.abort()
        raise
    runner.finish()
    return outputs


def run_stashed(stashes: ActivationStash, run_graph: Callable) -> Sequence:
    """``run_graph()`` with ``stashes`` serving the graph's stash / unstash nodes; freed after it, or its failure."""
    try:
        with offload_tier(stashes):
            outputs = run_graph()
    except BaseException:
        stashes.finish(raise_error=False)
        raise
    stashes.finish()
    return outputs


def reserve_offload(compiled: CompiledStep, store: TierStore) -> None:
    """Reserve the files of the inputs ``compiled`` offloads for the first time, from the graph's own values:
    at set-up, so a full disk is reported on every rank before any of them runs the graph."""
    split = compiled.split
    orders = [compiled.offloaded_inputs] if split is None else [split.forward_reloads, split.backward_reloads]
    inputs = placeholders(compiled.transformed)
    store.reserve(
        {state_key(inputs[i].meta[INPUT]): tensor_bytes(inputs[i].meta[VAL]) for i in sorted({*sum(orders, ())})}
    )


def _run_offloaded(compiled: CompiledStep, store: TierStore, inputs: list, graph: Callable) -> Sequence:
    """Run the graph with the offload tier serving its reload / write_back nodes (``run_offloaded``)."""
    specs = compiled.input_specs
    for attribute, kind, layout in (("bytes_total", "opt_state", None), ("param_bytes_total", "param", "shard")):
        mine = [t for t, s in zip(inputs, specs) if s.kind == kind and layout in (None, s.layout) and t.dim()]
        if mine:  # kept from the last graph that read such inputs otherwise (for explain())
            setattr(store, attribute, sum(t.numel() * t.element_size() for t in mine))
    order = compiled.offloaded_inputs
    slots = {i: (state_key(specs[i]), inputs[i]) for i in order}
    return run_offloaded(store, order, slots, inputs, graph)


def run_offloaded(
    store: TierStore, order: Sequence[int], slots: dict[int, tuple[tuple, Tensor]], inputs: list, run_graph: Callable
) -> Sequence:
    """``run_graph()`` with the offload tier serving the graph's reload / write_back nodes. ``order``: the slot
    each reload reads, in graph order; ``slots``: each slot's state key and tensor; ``inputs``: what the graph
    receives (an offloaded input it reads without a reload node, e.g. with the ``offload`` pass disabled, gets
    its memory back first)."""
    offloaded = {id(t) for _, t in slots.values()}
    store.prepare(slots, [t for t in inputs if id(t) not in offloaded], list(order))
    try:
        with offload_tier(store):
            outputs = run_graph()
    except BaseException:
        store.abort()
        raise
    store.commit()
    return outputs


def finish_call(
    compiled: CompiledStep,
    binding: Binding,
    user_tensors: list[tuple[str, Tensor]],
    user_values: list,
    grads: bool = True,
) -> object:
    """After the graph ran: restore what it does not hold (None grads unless not ``grads``, Python state, LR
    schedulers stepped after the update); returns the step's result."""
    captured = compiled.captured
    for i in captured.none_grads if grads else ():
        binding.params[i].tensor.grad = None
    for i in captured.none_input_grads if grads else ():
        user_tensors[i][1].grad = None
    for o_index, p_index, key, value in captured.constant_state:
        opt = binding.optimizers[o_index].optimizer
        opt.state[binding.params[p_index].tensor][key] = value
    for module, training in captured.training_flags:
        module.training = training
    for o_index in captured.optimizers_stepped:
        binding.optimizers[o_index].optimizer._opt_called = True  # what LR schedulers check
    for scheduler, before_update in captured.scheduler_steps:
        if not before_update:
            scheduler.step()
    return map_leaves(
        captured.result_template,
        lambda _p, leaf: user_values[leaf.position] if isinstance(leaf, Returned) else leaf,
    )


def _memory(t: Tensor) -> tuple[int, int, int]:
    """``(storage, first byte, end byte)`` a tensor's elements occupy."""
    size = t.element_size()
    extent = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()) if n > 0) + 1
    start = t.storage_offset() * size
    return t.untyped_storage().data_ptr(), start, start + extent * size


def unalias(outputs: list, inputs: list, updated_inputs: frozenset[int] = frozenset()) -> None:
    """Outputs whose memory overlaps an input's or another output's are cloned, so no two pieces of state ever
    share elements (except ``updated_inputs``: a state's own input, updated in place). Disjoint views of one
    buffer (a bucket's results) keep sharing it."""
    taken: dict[int, list[tuple[int, int]]] = {}

    def overlaps(t: Tensor) -> bool:
        storage, start, end = _memory(t)
        return any(start < e and s < end for s, e in taken.get(storage, ()))

    def take(t: Tensor) -> None:
        storage, start, end = _memory(t)
        taken.setdefault(storage, []).append((start, end))

    for t in inputs:
        if isinstance(t, Tensor) and t.numel():
            take(t)
    for i, value in enumerate(outputs):
        if i in updated_inputs or not isinstance(value, Tensor) or not value.numel():
            continue
        if overlaps(value):
            outputs[i] = value = value.clone()
        take(value)
