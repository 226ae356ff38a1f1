"""One call of a step, along the data's way: bind its state (``zgraph.binding``), find its compiled variant by guard
key or capture (``zgraph.capture.protocol``) and compile (``zgraph.compile.build``) one, agree on it with the other
ranks, run it (``zgraph.compile.run``, or ``zgraph.compile.split_runner`` for a split step). A call that misses every
variant only in the sizes of argument dims makes those dims symbolic first (``zgraph.binding.dynamic``); so do dims
whose sizes differ between ranks (each rank's batch padded to its own longest row), compared at a step's first call
and wherever the ranks' graphs differ (``Dispatcher._agree``): every rank then runs one graph.

On several ranks a call takes part in the failure protocol (``zgraph.runtime.agreement``): the ranks compare a
fingerprint of the graph they are about to run, a rank that fails records its error for the others, and a rank
whose collective fails raises ``RankFailedError`` naming the rank that failed first.
"""

from __future__ import annotations

import time
import warnings

import torch.distributed as dist
from torch import Tensor

from zgraph.binding.arguments import StepCall
from zgraph.binding.dynamic import DynamicDims, argument_sizes, argument_tensors
from zgraph.binding.guards import KEY_PARTS, describe_leaf, discover
from zgraph.binding.host_layout import host_layout
from zgraph.binding.micro_batches import microbatches, split_call
from zgraph.binding.session import Bound, Session, user_tensors
from zgraph.binding.setup import layout_device, step_groups
from zgraph.capture.as_written import hyperparameters, lifts
from zgraph.capture.compiled import WRAPPER_WARNING
from zgraph.capture.environment import traced_arguments
from zgraph.capture.optimizers import drop_state, stateless_pairs
from zgraph.capture.protocol import Rebind, capture
from zgraph.capture.size_guards import SizeGuards
from zgraph.compile.build import collector_paused, compile_step
from zgraph.compile.pipeline import compile_pipeline
from zgraph.compile.pipeline_call import run_pipeline
from zgraph.compile.run import reserve_offload, run
from zgraph.compile.split_runner import Peers, run_split
from zgraph.compile.variant import CompiledStep
from zgraph.config import Config
from zgraph.errors import CaptureError
from zgraph.graph import GraphInput
from zgraph.inspect.reuse import HeldCapture
from zgraph.runtime.agreement import Channel
from zgraph.runtime.consistency import check_same_graph, raise_different_graphs, same_digests
from zgraph.runtime.devices import control_device
from zgraph.runtime.optimizers import unwrap_optimizer
from zgraph.runtime.process_group import ProcessGroupInfo, ensure_process_group, timed_group
from zgraph.runtime.state import Binding

_MAX_REBINDS = 4  # captures of one call that may each find more state to bind
_RECAPTURE_WARNING = 8  # captures for the same state after which the step warns


class Dispatcher:
    """Runs the calls of one step; holds its state between calls (bindings, compiled variants by guard key: those
    of one key differ in the branches the step took on host-known values, ``HostGuards``, or in the conditions on
    symbolic sizes, ``SizeGuards``; the arguments' symbolic dims, ``DynamicDims``)."""

    def __init__(self, config: Config, process_group: dist.ProcessGroup | None):
        self.config = config
        self.process_group = process_group
        self.passes = config.passes()
        self.session = Session(config)
        self.cache: dict[tuple, list[CompiledStep]] = {}
        self.last: CompiledStep | None = None  # the variant the last call ran
        self.calls = 0  # calls made, for naming the call in errors other ranks see
        self.dynamic = DynamicDims(config.dynamic)  # the arguments' symbolic dims (marked, automatic, Config.dynamic)
        self.own_sizes = config.pipeline_parallel is None  # ranks may pass sizes of their own (a pipeline: one batch)
        self.asked: Config | None = None  # the config given, where the state's layout changed it (_lay_out_on_host)

    def __call__(self, call: StepCall) -> object:
        if traced_arguments(call.args, call.kwargs):
            raise CaptureError(
                f"zgraph step `{call.name}` was called from inside another zgraph step while that one was being "
                "captured; steps do not nest. Call the inner step's undecorated function there (`inner.__wrapped__`), "
                "or call the two steps one after the other."
            )
        group = ensure_process_group(self.process_group, lambda: self.session.device_of(call))
        label = f"call {self.calls} of step `{call.name}`"
        self.calls += 1
        micro = split_call(call, microbatches(self.config)) if self.config.pipeline_parallel is not None else None
        if not group.distributed:
            return self._call(call, None, group, label, micro)
        channel = Channel(group, self.config.collective_timeout)
        try:
            result = self._call(call, channel, group, label, micro)
        except Exception as error:
            if not getattr(error, "_zgraph_recorded", False):
                channel.record_failure(label, error)
            raise
        channel.clear_failure()  # a good call on the group: this rank's earlier failure (any step's) is over
        return result

    def _call(
        self, call: StepCall, channel: Channel | None, group: ProcessGroupInfo, label: str, micro: list | None
    ) -> object:
        """One call: bind, look up or capture, agree with the other ranks on the graph, run it. ``micro``: a
        pipelined step's micro-batch calls; the first is bound and captured."""
        if channel is not None:
            channel.enter(label)
            group = timed_group(group, self.config.collective_timeout, lambda: channel.exchange(f"{label} (set-up)"))
            group = step_groups(group, self.config)
            if self.calls == 1:
                self._lay_out_on_host(call, group)
            if self.calls == 1 and self.own_sizes:  # every rank captures: sizes differing between ranks are symbols
                self._widen_across_ranks(channel, label, argument_tensors(call))
        prepared = call if micro is None else micro[0]
        compiled, bound = self._prepare_or_tell(prepared, group, channel, label)
        peers = None
        if channel is not None:
            compiled, bound = self._agree(prepared, group, channel, label, compiled, bound)
            device = control_device(group.backend, bound.binding.device)
            peers = Peers(channel, group.group_name, device, label)
        self.last = compiled
        try:
            if micro is not None:
                tensors = [user_tensors(bound.binding, m, bound.located) for m in micro]
                return run_pipeline(compiled, bound.binding, tensors, group)
            return self._run(compiled, bound, peers)
        except Exception as error:
            failure = error if channel is None else channel.failed_running(label, error)
            if failure is error:
                raise
            raise failure from error

    def _lay_out_on_host(self, call: StepCall, group: ProcessGroupInfo) -> None:
        """At the first call: run the config ``zgraph.binding.host_layout`` says (stage 1 or 2 updating on the
        host on several ranks runs stage 3's layout)."""
        binding = Binding(*discover(call, self.session.observed))
        config = host_layout(self.config, group, layout_device(group, binding), binding)
        if config is not self.config:
            self.asked, self.config, self.passes, self.session = self.config, config, config.passes(), Session(config)

    def _prepare_or_tell(
        self, call: StepCall, group: ProcessGroupInfo, channel: Channel | None, label: str, again: bool = False
    ) -> tuple[CompiledStep, Bound]:
        """``_prepare``; where it fails on several ranks, the others are told (in the digests' all-gather)."""
        try:
            return self._prepare(call, group, channel, again)
        except Exception as error:
            if channel is None:
                raise
            channel.record_failure(label, error)
            error._zgraph_recorded = True
            device = control_device(group.backend, self.session.device)
            check_same_graph(channel, group.group_name, label, 0, [], error, device)  # tell the others; re-raises
            raise

    def _agree(
        self,
        call: StepCall,
        group: ProcessGroupInfo,
        channel: Channel,
        label: str,
        compiled: CompiledStep,
        bound: Bound,
    ) -> tuple[CompiledStep, Bound]:
        """The variant every rank runs: this one where the ranks' graphs are the same. Where they differ, the ranks
        exchange their arguments' sizes; dims whose sizes differ between ranks (each rank's batch padded to its own
        longest row) become symbolic on every rank, a rank whose symbolic dims that changed captures again, and the
        graphs are compared once more. Otherwise, or if they still differ: ``RankMismatchError`` on every rank."""
        device = control_device(group.backend, bound.binding.device)
        if same_digests(channel, group.group_name, label, compiled.digest, device=device):
            return compiled, bound
        if not (self.own_sizes and self._widen_across_ranks(channel, label, bound.user_tensors)):
            raise_different_graphs(channel, label, compiled.description)
        compiled, bound = self._prepare_or_tell(call, group, channel, label, again=True)
        device = control_device(group.backend, bound.binding.device)
        check_same_graph(channel, group.group_name, label, compiled.digest, compiled.description, device=device)
        return compiled, bound

    def _widen_across_ranks(self, channel: Channel, label: str, tensors: list[tuple[str, Tensor]]) -> bool:
        """The ranks exchange their argument tensors' sizes; those that differ between ranks become symbolic dims.
        Whether any did (the same on every rank)."""
        sizes = channel.exchange(f"{label} (argument sizes)", argument_sizes(tensors))
        return self.dynamic.widen_across_ranks(sizes)

    @staticmethod
    def _run(compiled: CompiledStep, bound: Bound, peers: Peers | None) -> object:
        if compiled.split is not None:
            split = compiled.split
            return run_split(compiled, split, bound.binding, bound.user_tensors, bound.call.name, peers)
        return run(compiled, bound.binding, bound.user_tensors)

    def _prepare(
        self, call: StepCall, group: ProcessGroupInfo, channel: Channel | None, again: bool = False
    ) -> tuple[CompiledStep, Bound]:
        """The compiled variant for this call (captured now if there is none) and the call bound; ``again``: the
        call was prepared once already (its LR schedulers are not stepped twice)."""
        schedulers_stepped = again
        self.dynamic.observe(call)  # marked dims; a size outside a declared range is refused here
        for attempt in range(_MAX_REBINDS + 1):
            bound = self.session.bind(call, group, channel)
            compiled = self._lookup(bound)
            if compiled is None and self.dynamic.widen(self._key(bound), self.cache):
                compiled = self._lookup(bound)  # automatic dynamic: sizes that changed are symbols from now on
            if compiled is None:
                compiled = self._compile(bound, group)
                if isinstance(compiled, Rebind):  # the trace found state to bind first: bind it, capture again
                    if attempt == _MAX_REBINDS:
                        raise CaptureError(f"zgraph could not bind the state the step uses: {compiled.reason}")
                    continue
                key = self._key(bound)
                self._warn_if_recaptured_often(key, call)
                self.cache.setdefault(key, []).append(compiled)
            if not schedulers_stepped:
                schedulers_stepped = True
                if self._step_schedulers_first(compiled):
                    continue
            break
        if bound.binding.offload is not None:
            reserve_offload(compiled, bound.binding.offload)  # a full disk is reported here, where every rank hears
        return compiled, bound

    def _lookup(self, bound: Bound) -> CompiledStep | None:
        """The compiled variant of the call's guard key whose host guards hold for it, if there is one."""
        binding = bound.binding

        def read(spec: GraphInput) -> object:
            if spec.kind == "buffer":
                return binding.buffers[spec.index].get()
            opt = binding.optimizers[spec.optimizer].optimizer
            if spec.kind == "hparam":
                return hyperparameters(opt, opt.param_groups[spec.group])[spec.field]
            return binding.optimizer_state(spec.optimizer, spec.index)[spec.field]

        for compiled in self.cache.get(self._key(bound), ()):
            guards, sizes = compiled.captured.host_guards, compiled.captured.size_guards
            if (sizes is None or sizes.hold(bound.user_tensors)) and (guards is None or guards.hold(read)):
                return compiled
        return None

    def held_capture(self, call: StepCall) -> HeldCapture | None:
        """The untransformed capture of the variant ``call`` would run now, for an estimate to reuse (read only:
        nothing is bound, located or captured); None where the call would bind or capture first."""
        bound = self.session.bound_as_is(call)
        compiled = self._lookup(bound) if bound is not None else None
        if bound is None or compiled is None:
            return None
        dims = self.dynamic.of([path for path, _ in bound.user_tensors])
        return HeldCapture(compiled.captured, self.config, bound.binding, dims)

    def _key(self, bound: Bound) -> tuple:
        """The call's guard key, the sizes of its symbolic dims left out."""
        return bound.guard_key(self.dynamic.dims)

    def variants(self) -> int:
        """How many variants of the step have been captured."""
        return sum(len(variants) for variants in self.cache.values())

    def _compile(self, bound: Bound, group: ProcessGroupInfo) -> CompiledStep | Rebind:
        """Capture, transform and compile the call's step; or what the trace found to bind first."""
        start = time.perf_counter()
        fresh = stateless_pairs(bound.binding)
        with collector_paused(promote=True):
            dynamic = self.dynamic.of([path for path, _ in bound.user_tensors])
            captured = capture(bound.request(self.config, dynamic), self.session.more_to_bind(bound))
        if isinstance(captured, Rebind):
            return captured
        capture_seconds = time.perf_counter() - start
        if captured.python_results:
            shown = ", ".join(f"{path} = {value!r}" for path, value in captured.python_results[:3])
            warnings.warn(
                f"zgraph: `{bound.call.name}` returns Python numbers ({shown}"
                f"{', ...' if len(captured.python_results) > 3 else ''}): they were computed once, when the step "
                "was captured, and every call returns them unchanged. Return tensors (they are computed on every "
                "call), or read Python values such as the learning rate after the call.",
                RuntimeWarning,
                stacklevel=6,
            )
        if captured.through_compile:
            warnings.warn(WRAPPER_WARNING.format(name=bound.call.name), UserWarning, stacklevel=6)
        try:
            with collector_paused(promote=True):
                if self.config.pipeline_parallel is not None:
                    compiled = compile_pipeline(captured, bound.binding, self.config, group, capture_seconds)
                else:
                    compiled = compile_step(captured, bound.binding, self.passes, self.config.backend, capture_seconds)
        except BaseException:  # a pass refused the graph: the optimizer state the capture created goes again
            drop_state(bound.binding, fresh)
            raise
        _warn_fixed_sizes(captured.size_guards, bound.call, self.dynamic.assumed)
        return compiled

    def _warn_if_recaptured_often(self, key: tuple, call: StepCall) -> None:
        """Warn once when the step has been captured ``_RECAPTURE_WARNING`` times for the same state, naming what
        changed since the previous capture: each capture traces (and compiles) the whole step."""
        same_state = [k for k in self.cache for _ in self.cache[k] if k[0] == key[0]]
        if len(same_state) + 1 != _RECAPTURE_WARNING:
            return
        previous = same_state[-1]
        part = next((i for i, (a, b) in enumerate(zip(previous, key)) if a != b), None)
        why = (
            "a value the step branches on or reads with int() / float() (a hyper-parameter, a step counter, a "
            "module's 0-d integer buffer) changed: read a number that changes every call with .item(), which stays "
            "symbolic"
        )
        if part is None and any(v.captured.size_guards is not None for v in self.cache.get(key, ())):
            why = (
                "an argument's size broke a condition the graph's symbolic sizes rely on (a size 0 or 1, sizes "
                "that were equal, a size the step fixed: zgraph warned when it captured that)"
            )
        if part is not None:
            why = KEY_PARTS[part]
        if part == KEY_PARTS.index("an argument"):
            changed = [(p, a, b) for (p, a), (_, b) in zip(previous[part], key[part]) if a != b]
            if changed:
                path, before, after = changed[0]
                why = f"argument `{path}` changed from {describe_leaf(before)} to {describe_leaf(after)}"
        warnings.warn(
            f"zgraph: `{call.name}` has been captured {_RECAPTURE_WARNING} times; the last time because {why}. "
            "Every capture traces and compiles the whole step again. Python numbers and objects among the "
            "arguments are part of the graph (pass numbers that change as tensors), and an optimizer class that "
            "torch.optim does not define is traced with its hyper-parameters as constants, so a changing learning "
            "rate recaptures it.",
            RuntimeWarning,
            stacklevel=6,
        )

    @staticmethod
    def _step_schedulers_first(compiled: CompiledStep) -> bool:
        """Step the LR schedulers the user's step steps before its optimizer's ``step()``, as eager would at
        that point (the graph then reads the new learning rates). True if an optimizer whose hyper-parameters are
        constants of the graph (part of the guard key) reads them, or the variant's host guards may branch on
        them: the graph must then be looked up, or traced, again."""
        first = [scheduler for scheduler, before_update in compiled.captured.scheduler_steps if before_update]
        for scheduler in first:
            scheduler.step()
        guarded = compiled.captured.host_guards is not None
        return bool(first) and (guarded or any(not lifts(unwrap_optimizer(scheduler.optimizer)) for scheduler in first))


def _warn_fixed_sizes(guards: SizeGuards | None, call: StepCall, assumed: set[tuple[str, int]]) -> None:
    """Warn when the capture fixed a symbolic dim to one size: each new size of it is captured again. Not for the
    ``assumed`` dims (``Config.dynamic=True`` made every dim symbolic: those the code needs as numbers are fixed, as
    torch.compile(dynamic=True) does)."""
    fixed = [f for f in (guards.fixed() if guards is not None else []) if (f[0], f[1]) not in assumed]
    if fixed:
        shown = ", ".join(f"dim {dim} of `{path}` to {size}" for path, dim, size in fixed)
        warnings.warn(
            f"zgraph: `{call.name}` was captured with symbolic sizes, but the step fixed {shown}: its code (a Python "
            "branch on the size, a reshape to a fixed shape, int() of a size) needs that size, so each new size "
            "of it is captured again. Compute shapes from the tensors (x.shape, -1 in view/reshape) to keep the "
            "size symbolic.",
            RuntimeWarning,
            stacklevel=7,
        )
