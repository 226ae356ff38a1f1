"""The environment a step is traced in: what zgraph swaps, patches and watches while ``make_fx`` runs the user's
code, and how a failed trace is explained.

- traced stand-ins are swapped into the modules' parameter and buffer slots and into located slots
  (``zgraph.binding.locate``), then the originals put back;
- ``t.data = value`` on traced state becomes an in-place copy; forward inputs are cast to the compute dtype and
  forwards run under autocast when the config asks;
- modules and optimizers the step reaches that zgraph has not bound stop the trace (``UnboundState``) before
  they act on real tensors; Python state the step changed (param groups, train flags) is restored if it fails;
- ``trace`` runs ``make_fx`` and turns its failures into ``CaptureError`` naming the user's line (found by
  ``zgraph.capture.diagnosis``), or, where a ``torch.compile`` wrapper refused the trace, into the signal to trace
  through it (``zgraph.capture.compiled``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx import traceback as fx_traceback
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

from zgraph.capture import fake_kernels  # noqa: F401  (fake kernels capture needs: aten::_grouped_mm in fp32/fp16 on CPU)
from zgraph.capture.compiled import CompileWrapperReached, reached_compile_wrapper
from zgraph.capture.diagnosis import data_dependent, raised_in_grad_scaler, where
from zgraph.capture.model_hints import hint
from zgraph.errors import CaptureError
from zgraph.runtime.state import Binding
from zgraph.tree import iter_leaves, map_leaves

aten = torch.ops.aten


def _batch_norm_with_honest_schema(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    # aten.native_batch_norm updates running stats in place without declaring it in its schema, so
    # functionalization would drop the update. The _legit variants declare it and run the same CPU/CUDA kernels.
    if running_mean is None or running_var is None:
        return aten._native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)
    if training:
        return aten._native_batch_norm_legit.default(
            input, weight, bias, running_mean, running_var, training, momentum, eps
        )
    return aten._native_batch_norm_legit_no_training.default(
        input, weight, bias, running_mean, running_var, momentum, eps
    )


def _random_from_to(self: Tensor, low: int, high: int | None = None, *, generator: Any = None) -> Tensor:
    # FX cannot print `aten.random.from` (`from` is a Python keyword; the trace functionalizes, so `x.random_(low,
    # high)` arrives here as `random.from`). The CPU and CUDA kernels draw `low + (random % (high - low))`: drawing
    # in [0, high - low) and adding `low` gives the same numbers.
    if high is None:
        raise CaptureError("Tensor.random_(from) without `to` is not supported inside a zgraph step")
    return aten.random.to(self, high - low, generator=generator).add(low)


def _foreach_lerp(selves: list[Tensor], ends: list[Tensor], weight: Any) -> list[Tensor]:
    # One lerp per tensor, the kernel torch's foreach lerp runs per tensor on the host (the same arithmetic as
    # its fused CUDA kernel): element-wise ops that stage 3 runs on shards (an EMA of sharded parameters updates
    # its shards; the foreach op, whose output is a list, would be gathered whole). The trace functionalizes, so
    # the ``_foreach_lerp_`` of the step arrives here as ``_foreach_lerp``.
    weights = weight if isinstance(weight, (list, tuple)) else [weight] * len(selves)
    return [
        (aten.lerp.Tensor if isinstance(w, Tensor) else aten.lerp.Scalar)(start, end, w)
        for start, end, w in zip(selves, ends, weights)
    ]


_TRACE_DECOMPOSITIONS = {
    aten.native_batch_norm.default: _batch_norm_with_honest_schema,
    getattr(aten.random, "from"): _random_from_to,
    **{overload: _foreach_lerp for overload in (aten._foreach_lerp.Scalar, aten._foreach_lerp.List)},
    aten._foreach_lerp.ScalarList: _foreach_lerp,
}


# ------------------------------------------------------------------------------------------- state swapping
@contextlib.contextmanager
def swap_module_tensors(binding: Binding, params: list[Tensor], buffers: list[Tensor]) -> Iterator[None]:
    saved: list[tuple[dict, str, Any]] = []
    try:
        for record, value in zip(binding.params, params):
            for module, attr in record.slots:
                saved.append((module._parameters, attr, module._parameters[attr]))
                module._parameters[attr] = value
        for record, value in zip(binding.buffers, buffers):
            for module, attr in record.slots:
                saved.append((module._buffers, attr, module._buffers[attr]))
                module._buffers[attr] = value
        yield
    finally:
        for store, attr, original in reversed(saved):
            store[attr] = original


@contextlib.contextmanager
def cast_forward_inputs(binding: Binding, dtype: torch.dtype) -> Iterator[None]:
    """Floating-point tensors passed to a bound model's forward are cast to the compute dtype (what FSDP2's
    ``cast_forward_inputs`` and DeepSpeed's bf16/fp16 engines do), so they meet parameters in that dtype."""

    def cast(value: Any) -> Any:
        return value.to(dtype) if isinstance(value, Tensor) and value.is_floating_point() else value

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return map_leaves(args, lambda _p, v: cast(v)), map_leaves(kwargs, lambda _p, v: cast(v))

    handles = [root.register_forward_pre_hook(hook, with_kwargs=True) for _, root in binding.modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class UnboundState(Exception):  # noqa: N818 - a signal to the caller, not an error the user sees
    """Raised while tracing when the step reaches training state zgraph did not bind: a module whose parameters
    or buffers are real tensors (reached through a helper function, a ``functools.partial``, an object deeper
    than zgraph looks), or an optimizer stepped or zeroed that is not among the bound ones. The caller binds
    them and captures again."""

    def __init__(self, modules: list[nn.Module] = (), optimizers: list[torch.optim.Optimizer] = ()):
        super().__init__("the step uses modules or optimizers zgraph has not bound yet")
        self.modules = list(modules)
        self.optimizers = list(optimizers)


def is_real(t: Any) -> bool:
    return isinstance(t, Tensor) and not traced_tensor(t)


def traced_tensor(t: object) -> bool:
    """Whether ``t`` is a tensor of a trace: a fake tensor, or the functional tensor of one."""
    return isinstance(t, (FakeTensor, FunctionalTensor))


@contextlib.contextmanager
def watch_unbound_state(binding: Binding) -> Iterator[None]:
    """Raise ``UnboundState`` as soon as the traced step calls a module that holds real (unbound) parameters or
    buffers, or steps / zeroes an optimizer that is not bound — before either can act on real tensors."""
    bound = {id(r.optimizer) for r in binding.optimizers}

    def module_called(module: nn.Module, args: Any) -> None:
        tensors = [*module._parameters.values(), *module._buffers.values()]
        if any(is_real(t) for t in tensors):
            raise UnboundState(modules=[module])

    def optimizer_used(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        if id(opt) not in bound:
            raise UnboundState(optimizers=[opt])

    original_zero_grad = torch.optim.Optimizer.zero_grad

    @functools.wraps(original_zero_grad)  # its signature, which wrappers inspect (accelerate's zero_grad)
    def zero_grad(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        optimizer_used(opt)  # bound optimizers have their own traced zero_grad (see _swap_optimizers)
        return original_zero_grad(opt, *args, **kwargs)

    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handles = [register_module_forward_pre_hook(module_called), register_optimizer_step_pre_hook(optimizer_used)]
    torch.optim.Optimizer.zero_grad = zero_grad
    try:
        yield
    finally:
        torch.optim.Optimizer.zero_grad = original_zero_grad
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def swap_slots(swaps: list[tuple[Any, Tensor]], traced: dict[int, Tensor]) -> Iterator[None]:
    """Put the traced stand-in of each located tensor (see ``zgraph.binding.locate``) into its slot while tracing."""
    done = []
    try:
        for slot, real in swaps:
            stand_in = traced.get(id(real))
            if stand_in is not None:
                slot.set(stand_in)
                done.append((slot, real))
        yield
    finally:
        for slot, real in reversed(done):
            slot.set(real)


@contextlib.contextmanager
def data_assignment_as_copy(state: list[Tensor]) -> Iterator[None]:
    """``t.data = value`` on a traced piece of state (a parameter, buffer, optimizer state, argument) becomes
    ``t.copy_(value)`` without autograd: the tracer does not see a ``.data`` assignment, so the new value
    would be lost. A value of another shape or dtype cannot be expressed that way and is an error."""
    tracked = {id(t) for t in state}
    descriptor = torch._C.TensorBase.data

    def set_data(tensor: Tensor, value: Tensor) -> None:
        if id(tensor) not in tracked:
            descriptor.__set__(tensor, value)
            return
        if value.shape != tensor.shape or value.dtype != tensor.dtype:
            raise CaptureError(
                f"the step assigns `.data` of shape {tuple(value.shape)} ({value.dtype}) to a tensor of shape "
                f"{tuple(tensor.shape)} ({tensor.dtype}); zgraph can only trace a `.data` assignment that keeps "
                "shape and dtype (it becomes an in-place copy)"
            )
        with torch.no_grad():
            tensor.copy_(value)

    torch.Tensor.data = property(descriptor.__get__, set_data)
    try:
        yield
    finally:
        del torch.Tensor.data


def real_constants(gm: fx.GraphModule) -> list[Tensor]:
    """The real (not fake) tensors a trace froze into ``gm`` as constants: tensors the step read from places
    zgraph did not swap traced stand-ins into."""
    out, seen = [], set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target, None)
            if is_real(value) and id(value) not in seen:
                seen.add(id(value))
                out.append(value)
    return out


@contextlib.contextmanager
def autocast_forwards(binding: Binding, dtype: torch.dtype, device: str) -> Iterator[None]:
    """Each bound model's forward runs under ``torch.autocast(device, dtype)`` (``Config.autocast_dtype``), as
    DeepSpeed's engine runs its forward with the ``torch_autocast`` section; code outside the forward (the loss)
    does not."""
    entered: list[contextlib.AbstractContextManager] = []

    def enter(module: nn.Module, args: Any) -> None:
        region = torch.autocast(device, dtype=dtype)
        region.__enter__()
        entered.append(region)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        entered.pop().__exit__(None, None, None)

    handles = []
    for _, root in binding.modules:
        handles.append(root.register_forward_pre_hook(enter))
        handles.append(root.register_forward_hook(leave))
    try:
        yield
    finally:
        while entered:  # a forward that raised
            entered.pop().__exit__(None, None, None)
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def restore_python_state_on_error(binding: Binding) -> Iterator[None]:
    """If capture fails, undo what the traced Python did to optimizer param groups and module train flags."""
    groups = [[dict(g) for g in r.optimizer.param_groups] for r in binding.optimizers]
    flags = [(m, m.training) for _, root in binding.modules for m in root.modules()]
    try:
        yield
    except BaseException:
        for record, saved in zip(binding.optimizers, groups):
            for group, values in zip(record.optimizer.param_groups, saved):
                group.clear()
                group.update(values)
        for module, training in flags:
            module.training = training
        raise


@contextlib.contextmanager
def refuse_created_state(binding: Binding) -> Iterator[None]:
    """Parameters, buffers and submodules the traced step creates on a bound model (a parameter made lazily in
    ``forward``) would be traced placeholders left on the model. When the trace ends they are removed (the model
    is as it was, attributes they displaced put back) and, unless the trace failed otherwise, refused with a
    ``CaptureError`` naming them. Must be entered before the traced tensors are swapped in, so that on exit the
    bound entries hold their own tensors again."""
    names = {
        id(m): f"{label}.{name}".strip(".") if len(binding.modules) > 1 else name
        for label, root in binding.modules
        for name, m in root.named_modules(remove_duplicate=False)
    }
    before = [
        (m, dict(m._parameters), dict(m._buffers), dict(m._modules), dict(vars(m)))
        for _, root in binding.modules
        for m in root.modules()
    ]
    created: list[str] = []
    try:
        yield
    finally:
        for module, params, buffers, modules, attrs in before:
            for store, saved, kind in (
                (module._parameters, params, "parameter"),
                (module._buffers, buffers, "buffer"),
                (module._modules, modules, "submodule"),
            ):
                for name in [n for n, v in store.items() if saved.get(n) is not v and v is not None]:
                    if kind == "buffer" and saved.get(name) is not None:
                        continue  # a buffer assigned a new value: the step's output, written back after each call
                    created.append(f"{kind} `{_qualified(names.get(id(module), ''), name)}`")
                    if name in saved:
                        store[name] = saved[name]
                    else:
                        del store[name]
                    if name in attrs:
                        module.__dict__[name] = attrs[name]
    if created:
        raise CaptureError(
            f"the step created {', '.join(created)} on the model while zgraph captured it: state made inside the "
            "step would be a traced placeholder, not a tensor (zgraph left the model as it was). Create parameters, "
            "buffers and submodules before the first call: in __init__, or by running one forward eagerly (that "
            "initialises lazy modules too)."
        )


def _python_dispatcher(fakes: list[Tensor]) -> contextlib.AbstractContextManager:
    """Torch's Python dispatcher where a fake input has symbolic sizes (as ``make_fx``'s symbolic mode has): composite
    ops then run their Python kernels, which keep sizes symbolic (C++ ``F.pad`` reads its input's sizes as ints, which
    would fix a symbolic size to the capturing call's)."""
    symbolic = any(isinstance(n, torch.SymInt) for f in fakes if isinstance(f, Tensor) for n in f.shape)
    return enable_python_dispatcher() if symbolic else contextlib.nullcontext()


def traced_arguments(args: tuple, kwargs: dict) -> bool:
    """Whether a step's arguments are tensors (or modules holding tensors) of a trace in progress: the step is
    called from inside another step zgraph is capturing."""
    for _, leaf in iter_leaves((args, kwargs)):
        tensors = leaf.parameters() if isinstance(leaf, nn.Module) else [leaf]
        if any(traced_tensor(t) for t in tensors):
            return True
    return False


def _qualified(module: str, attr: str) -> str:
    return f"{module}.{attr}" if module else attr


def group_values(binding: Binding) -> list:
    return [
        [{k: v for k, v in g.items() if k != "params"} for g in r.optimizer.param_groups] for r in binding.optimizers
    ]


def trace(traced_step: Callable, fakes: list[Tensor], mode: FakeTensorMode, fn: Callable) -> fx.GraphModule:
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        with fx_traceback.preserve_node_meta(), mode, _use_lazy_graph_module(True), _python_dispatcher(fakes):
            return make_fx(
                traced_step,
                tracing_mode="fake",
                decomposition_table=_TRACE_DECOMPOSITIONS,
                _allow_non_fake_inputs=True,
            )(*fakes)
    except (CaptureError, UnboundState):
        raise
    except Exception as exc:
        if reached_compile_wrapper(exc):
            raise CompileWrapperReached() from exc
        detail = data_dependent(exc)
        if detail is not None and raised_in_grad_scaler(exc):
            raise CaptureError(
                f"zgraph cannot capture `{name}`: torch.amp.GradScaler decides in Python whether gradients "
                f"overflowed{where(exc)}. zgraph does fp16 loss scaling in the graph: drop the GradScaler (call "
                'loss.backward() and opt.step() directly) and set zgraph.Config(loss_scale="dynamic"), or '
                "zgraph.DynamicLossScale(...) for GradScaler's init_scale / growth_factor / backoff_factor / "
                "growth_interval."
            ) from exc
        if detail is None:
            raise CaptureError(
                f"zgraph could not capture `{name}`: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
                f"{where(exc)}"
            ) from exc
        raise CaptureError(
            f"zgraph cannot capture `{name}`: {detail}{where(exc)}. zgraph traces the step once and replays "
            "the graph on later calls, so Python cannot branch on tensor values only the device knows inside it. "
            "Move the check outside the step, or express it with tensor ops (torch.where, masking); a count "
            "to branch on can be a module's 0-d integer buffer the step advances (as AveragedModel.n_averaged): "
            f"zgraph reads it on the host and captures each branch.{hint(exc)}"
        ) from exc
