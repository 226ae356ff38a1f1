"""How a checkpoint's tensors match a model's: missing, unexpected and mis-shaped names, and the report
``load_pretrained`` raises or warns with, in the layout of Hugging Face ``from_pretrained``'s load report (a
Key | Status | Details table, then notes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from zgraph.errors import CheckpointError


@dataclass
class Match:
    """A checkpoint against a model.

    Attributes:
        missing: model names no checkpoint tensor fills (a tied tensor is missing only if all its names are).
        unexpected: checkpoint names the model does not have.
        mismatched: ``(name, checkpoint shape, model shape)`` of names in both with different shapes.
    """

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)


class PretrainedMismatchError(CheckpointError):
    """The checkpoint ``load_pretrained`` was given does not match the model (``match`` lists how); nothing in the
    model changed."""

    def __init__(self, message: str, match: Match):
        super().__init__(message)
        self.match = match


def report(model_class: str, path: str, match: Match, missing_note: str) -> str:
    """The table of ``match``'s names with their status, and notes saying what each status means."""
    rows = [(name, "UNEXPECTED", "") for name in match.unexpected]
    rows += [(name, "MISSING", "") for name in match.missing]
    rows += [(name, "MISMATCH", f"ckpt: {there} vs model: {here}") for name, there, here in match.mismatched]
    width = max([len("Key")] + [len(r[0]) for r in rows])
    lines = [f"{model_class} LOAD REPORT from: {path}", f"{'Key':<{width}} | {'Status':<10} | Details"]
    lines.append(f"{'-' * width}-+-{'-' * 10}-+-{'-' * 8}")
    lines += [f"{name:<{width}} | {status:<10} | {details}".rstrip() for name, status, details in rows]
    lines.append("")
    lines.append("Notes:")
    if match.unexpected:
        lines.append("- UNEXPECTED:\tin the checkpoint, not in the model; ignored with strict=False.")
    if match.missing:
        lines.append(f"- MISSING:\tnot in the checkpoint; {missing_note}.")
    if match.mismatched:
        lines.append("- MISMATCH:\tin both, with different shapes; refused even with strict=False.")
    return "\n".join(lines)


def refuse(model_class: str, path: str, match: Match, strict: bool) -> None:
    """Raise ``PretrainedMismatchError`` for shape mismatches, and with ``strict`` for missing or unexpected names."""
    if match.mismatched or (strict and match):
        table = report(model_class, path, match, "strict=False leaves them as they are")
        why = "strict=True: every name must match" if strict and (match.missing or match.unexpected) else "shapes"
        raise PretrainedMismatchError(
            f"load_pretrained: the checkpoint does not match the model ({why}); nothing was loaded\n{table}", match
        )
