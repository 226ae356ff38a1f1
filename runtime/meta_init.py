"""A meta-device model's state made real where the step keeps it, filled by the model's own initialisation.

A model built under ``torch.device("meta")`` holds shapes, not values. ``fill`` gives each meta parameter and
buffer of a binding storage on the step's device, one module at a time: the module's own meta
parameters become whole tensors (the same ``nn.Parameter`` objects, ``torch.utils.swap_tensors``), its
initialisation runs on them, and a parameter the plan shards is then cut to this rank's rows and its whole
storage released — so a rank holds its shards plus one module's parameters, never the model.

Where the values come from (``source``):

- ``"init"``: the model's own initialisation, with the random state of rank 0 (sent to every rank first, as
  DTensor's random-number tracker syncs its seed), run so that the values equal what that initialisation gives
  on the unsharded model from the same random state. Routes, by what the model has:
  Hugging Face models (``_initialize_weights``): ``model.init_weights()`` itself, each module's
  ``_init_weights`` run as that module's parameters are made whole (the same values as ``model.to_empty(...)``
  then ``model.init_weights()``); a model with its own ``init_weights()`` (torchtitan's): called once with every
  meta parameter whole (that route holds the whole model while it runs); else each module's
  ``reset_parameters()`` (and ``init_buffers()`` for buffers) in module order — the order a model built on the
  host runs them in its constructors. A parameter tied across modules keeps its first module's values while
  the later modules' initialisations still draw their random numbers (as construction does, and as
  ``to_empty``, which unties, then Hugging Face's ``init_weights``, which ties again, do).
- ``"empty"``: storage only (the values are about to be loaded); buffers are still computed by their modules.
- ``"rank0"``: rank 0 holds the real model (FSDP1's ``sync_module_states`` idiom): each tensor is received
  whole from rank 0, one at a time (``allocator``'s storage, filled by the initial broadcast), and cut like the
  others.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from zgraph.errors import ZGraphError
from zgraph.runtime.state import Binding, ParamRecord


class MetaInitError(ZGraphError, ValueError):
    """A meta-device parameter or buffer that zgraph has no way to give values to."""


def is_meta(t: Tensor | None) -> bool:
    return isinstance(t, Tensor) and getattr(t, "_local_tensor", t).is_meta


def has_meta_state(binding: Binding) -> bool:
    """True when a parameter or buffer of ``binding`` is on the meta device."""
    return any(is_meta(r.tensor) for r in binding.params) or any(is_meta(b.get()) for b in binding.buffers)


Finish = Callable[[ParamRecord], None]  # what becomes of a parameter once it holds its values (cut or kept)


class Materializer:
    """Gives one binding's meta tensors storage on ``device``, module by module (see the module docstring)."""

    def __init__(self, binding: Binding, device: torch.device, finish: Finish):
        self.binding = binding
        self.device = device
        self.finish = finish
        self._made: set[int] = set()  # parameter indices this materializer made real

    @contextlib.contextmanager
    def whole(self, module: nn.Module) -> Iterator[None]:
        """Inside: ``module``'s own meta parameters and buffers are whole tensors on the device; a parameter tied
        to one an earlier module already filled is a scratch copy here, dropped after (its first module's values
        stay, as when the model is built on the host, or untied by ``to_empty`` until Hugging Face ties it)."""
        scratch: dict[str, nn.Parameter] = {}
        touched: list[int] = []
        for attr, p in list(module._parameters.items()):
            index = self.binding.param_index(p) if p is not None else None
            if index is not None and is_meta(p):
                swap_storage(p, blank(p, self.device))
                touched.append(index)
                self._made.add(index)
            elif index in self._made:
                scratch[attr] = p
                module._parameters[attr] = nn.Parameter(blank(p, self.device), p.requires_grad)
        for attr, b in list(module._buffers.items()):
            if is_meta(b):
                index = self.binding.buffer_index(b)
                value = torch.empty_like(b, device=self.device)
                if index is None:
                    module._buffers[attr] = value
                else:
                    self.binding.buffers[index].set(value)
        try:
            yield
        finally:
            module._parameters.update(scratch)
        for index in touched:
            self.finish(self.binding.params[index])


def swap_storage(p: Tensor, new: Tensor) -> None:
    """Make the object ``p`` hold ``new``'s storage (``torch.utils.swap_tensors``), keeping ``p``'s own
    attributes (swap_tensors swaps ``__dict__`` too; zgraph's replacement record and the user's flags stay)."""
    attrs = dict(p.__dict__)
    torch.utils.swap_tensors(p, new)
    p.__dict__.update(attrs)


def blank(p: Tensor, device: torch.device) -> Tensor:
    """Uninitialised storage of ``p``'s shape and dtype on ``device`` (an ``nn.Parameter`` for a parameter)."""
    value = torch.empty(p.shape, dtype=p.dtype, device=device)
    return nn.Parameter(value, p.requires_grad) if isinstance(p, nn.Parameter) else value


def release(p: Tensor) -> None:
    """Give back the whole storage of a parameter replaced by its shard (the object becomes meta, so a reference
    the user kept holds no memory); a tensor that cannot be swapped (a view, one with weak references) is left."""
    if not is_meta(p) and not hasattr(p, "_local_tensor") and p._base is None:
        try:
            swap_storage(p, blank(p, torch.device("meta")))
        except RuntimeError:
            pass


# ----------------------------------------------------------------------------------------------- the routes
Routes = list[tuple[nn.Module, list[nn.Module], str]]


def fill_routes(binding: Binding, values: str) -> Routes:
    """How each root module of ``binding`` with meta tensors is filled (``values``: ``"init"`` or ``"empty"``);
    refuses, changing nothing, a module with no way to fill its tensors."""
    orphans = [r.name for r in binding.params if is_meta(r.tensor) and not r.slots]
    if orphans:
        raise MetaInitError(
            f"zgraph: {orphans[:4]} are on the meta device but held by an optimizer only, not by a module of the "
            "step, so nothing can initialise them: build them on a real device"
        )
    routes = []
    for label, root in binding.modules:
        owners = _owners_in(root, label if len(binding.modules) > 1 else "")
        if owners:
            route = _route(root)
            if route == "modules":
                _check_modules_route(owners, values)
            routes.append((root, [m for _, m in owners], route))
    return routes


def fill(
    binding: Binding, routes: Routes, device: torch.device, finish: Finish, values: str, empty: Finish | None = None
) -> None:
    """Give every meta parameter and buffer of ``binding`` storage on ``device`` and, for ``values="init"``,
    the model's own initial values, by the ``routes`` planned with ``fill_routes``; ``finish`` is called on each
    parameter once it holds its values. ``values="empty"``: the modules that compute buffers run as for
    ``"init"``, every other parameter gets storage only, from ``empty`` (allocated as it will be kept: a shard
    is never whole)."""
    for root, owners, route in routes:
        if values == "empty" and (route != "model" or callable(getattr(root, "init_buffers", None))):
            owners = [m for m in owners if _owns_meta(m, "buffers")]
        mat = Materializer(binding, device, finish)
        {"hf": _run_hf, "model": _run_model, "modules": _run_modules}[route](root, owners, mat, values)
    for record in binding.params:
        if empty is not None and is_meta(record.tensor):
            empty(record)
    left = [r.name for r in binding.params if is_meta(r.tensor)] + [b.name for b in binding.buffers if is_meta(b.get())]
    if left:
        raise MetaInitError(f"zgraph: these tensors are still on the meta device after initialisation: {left[:8]}")


def _owners_in(root: nn.Module, label: str) -> list[tuple[str, nn.Module]]:
    out = []
    for name, module in root.named_modules():
        if any(is_meta(t) for t in (*module._parameters.values(), *module._buffers.values())):
            out.append((".".join(x for x in (label, name) if x) or "<root>", module))
    return out


def _route(root: nn.Module) -> str:
    if hasattr(type(root), "_initialize_weights") and hasattr(type(root), "_init_weights"):
        return "hf"
    return "model" if callable(getattr(root, "init_weights", None)) else "modules"


def _owns_meta(module: nn.Module, kind: str) -> bool:
    return any(is_meta(t) for t in getattr(module, f"_{kind}").values())


def _check_modules_route(owners: list[tuple[str, nn.Module]], values: str) -> None:
    for name, module in owners:
        params = [a for a, p in module._parameters.items() if is_meta(p)]
        buffers = [a for a, b in module._buffers.items() if is_meta(b)]
        can_reset = callable(getattr(module, "reset_parameters", None))
        missing = (params if values == "init" and not can_reset else []) + (
            buffers if not (can_reset or callable(getattr(module, "init_buffers", None))) else []
        )
        if missing:
            raise MetaInitError(
                f"zgraph: {type(module).__name__} at {name!r} is on the meta device ({', '.join(missing)}) but has no "
                "way to initialise it: give the module reset_parameters() (parameters and buffers) or "
                "init_buffers() (buffers), give the model an init_weights(), or build it on a real device"
            )


def _run_modules(root: nn.Module, owners: list[nn.Module], mat: Materializer, values: str) -> None:
    owned = [(m, _owns_meta(m, "parameters"), _owns_meta(m, "buffers")) for m in owners]  # before any is real
    for module, params, buffers in owned:
        with mat.whole(module), torch.no_grad():
            reset = (params and values == "init") or (buffers and not hasattr(module, "init_buffers"))
            if reset:
                module.reset_parameters()
            if buffers and hasattr(module, "init_buffers"):
                module.init_buffers()


def _run_model(root: nn.Module, owners: list[nn.Module], mat: Materializer, values: str) -> None:
    with contextlib.ExitStack() as stack, torch.no_grad():
        for module in owners:
            stack.enter_context(mat.whole(module))
        if values == "empty" and callable(getattr(root, "init_buffers", None)):
            root.init_buffers()
        else:
            root.init_weights()


def _run_hf(root: nn.Module, owners: list[nn.Module], mat: Materializer, values: str) -> None:
    """``root.init_weights()`` (``"empty"``: ``initialize_weights()`` for the modules owning buffers only),
    each module's ``_initialize_weights`` run inside ``mat.whole``."""
    meta = {id(m): _owns_meta(m, "buffers") for m in owners}
    models = [m for m in root.modules() if hasattr(type(m), "_initialize_weights")]
    for model in models:
        original = model._initialize_weights

        def run(module: nn.Module, is_custom_code: bool = False, original: Callable = original) -> None:
            if id(module) not in meta:
                return
            with mat.whole(module):
                if values == "init" or meta[id(module)]:
                    original(module, is_custom_code)

        model._initialize_weights = run
    try:
        root.init_weights() if values == "init" else root.initialize_weights()
    finally:
        for model in models:
            model.__dict__.pop("_initialize_weights", None)


# ------------------------------------------------------------------------------------------ random state
def generator_state(device: torch.device) -> bytes:
    """The default generator state of ``device`` (the host's for ``cpu``), as bytes to send to other ranks."""
    if device.type == "cpu":
        return bytes(torch.get_rng_state().tolist())
    return bytes(torch.get_device_module(device.type).get_rng_state(device).tolist())


def set_generator_state(device: torch.device, state: bytes) -> None:
    value = torch.tensor(list(state), dtype=torch.uint8)
    if device.type == "cpu":
        torch.set_rng_state(value)
    else:
        torch.get_device_module(device.type).set_rng_state(value, device)


def allocator(binding: Binding, device: torch.device) -> Callable[[Tensor], Tensor]:
    """Whole storage on ``device`` standing for a meta tensor of ``binding``, to receive rank 0's values into
    (a parameter keeps its object; a buffer is replaced on its modules)."""

    def allocate(t: Tensor) -> Tensor:
        if binding.param_index(t) is not None:
            swap_storage(t, blank(t, device))
            return t
        index = binding.buffer_index(t)
        value = torch.empty(t.shape, dtype=t.dtype, device=device)
        if index is not None:
            binding.buffers[index].set(value)
        return value

    return allocate
