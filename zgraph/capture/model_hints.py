"""What to change, for capture failures that come from a known third-party model pattern.

Capture reports a data-dependent Python operation generically ("Python control flow depends on the value of a
tensor ..."). Some come from code the user did not write and can switch off with one call; ``hint(exc)`` names
that call, to be appended to the capture error.

Transformers' "eager" experts implementation of MoE models (Mixtral, Qwen2-MoE, ...) loops in Python over the
experts that received tokens (``for expert_idx in expert_hit:``, ``torch.where(expert_mask[...])``): which experts
run, and on how many tokens, depends on the router's output. The "batched_mm" and "grouped_mm" (default)
implementations compute the same experts with a fixed set of ops.
"""

from __future__ import annotations

import types

from torch import nn

__all__ = ["hint"]


def hint(exc: BaseException) -> str:
    """A sentence (with a leading space) saying what to change when ``exc`` was raised inside a known
    data-dependent model pattern; ``""`` otherwise."""
    for frame in reversed(_frames(exc.__traceback__)):  # innermost first: the experts module, not the model
        owner = frame.f_locals.get("self")
        if not isinstance(owner, nn.Module) or not hasattr(owner, "num_experts"):
            continue  # only an experts module (transformers' ``XxxExperts``); dense models have the setting too
        config = getattr(owner, "config", None)
        if getattr(config, "_experts_implementation", None) == "eager":
            return (
                f" `{type(owner).__name__}` runs transformers' eager experts implementation, a Python loop over the "
                'experts the router picked: call `model.set_experts_implementation("batched_mm")` (or '
                '"grouped_mm", transformers\' default) before the step.'
            )
    return ""


def _frames(tb: types.TracebackType | None) -> list[types.FrameType]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames
