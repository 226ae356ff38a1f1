"""The model's repeated blocks, marked while a step is traced: ``mark_blocks`` annotates every node a block's forward
makes with the block's name (``node.meta[CUSTOM][BLOCK]``, see ``zgraph.graph``), what ``Config.remat="full"``
recomputes block by block (``zgraph.passes.remat``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.fx import traceback as fx_traceback

from zgraph.graph import BLOCK, CUSTOM
from zgraph.runtime.state import Binding


def repeated_blocks(binding: Binding) -> list[tuple[str, nn.Module]]:
    """The bound models' blocks, by name: the children of every ``nn.ModuleList`` / ``nn.Sequential`` that has at
    least two children, all of one class (a model's repeated layers)."""
    blocks = []
    for label, root in binding.modules:
        for name, module in root.named_modules(prefix=label):
            children = list(module.named_children())
            if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) > 1:
                if len({type(child) for _, child in children}) == 1:
                    blocks += [(f"{name}.{child_name}", child) for child_name, child in children]
    return blocks


@contextlib.contextmanager
def mark_blocks(binding: Binding) -> Iterator[None]:
    """Nodes a block's forward makes carry its name (``node.meta[CUSTOM][BLOCK]``, see ``zgraph.graph``); in a
    block inside another block, the outer one's."""
    entered: list[contextlib.AbstractContextManager | None] = []

    def enter(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            inside = BLOCK in fx_traceback.current_meta.get(CUSTOM, {})
            context = None if inside else fx_traceback.annotate({BLOCK: name})
            if context is not None:
                context.__enter__()
            entered.append(context)

        return hook

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        context = entered.pop()
        if context is not None:
            context.__exit__(None, None, None)

    handles = []
    for name, block in repeated_blocks(binding):
        handles.append(block.register_forward_pre_hook(enter(name)))
        handles.append(block.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
