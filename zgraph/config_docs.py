"""``Config.__doc__`` built from the docstring under each of its fields (read from the source)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Mapping


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated field of the dataclass ``cls``, read from its source (empty when the
    source cannot be read)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body
    docs: dict[str, str] = {}
    for stmt, after in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def doc_with_attributes(summary: str, docs: Mapping[str, str]) -> str:
    """``summary`` followed by an ``Attributes:`` section (Google style) listing ``docs``."""
    lines = [summary, "", "Attributes:"]
    for name, doc in docs.items():
        lines.append(textwrap.fill(f"{name}: {doc}", width=116, initial_indent="    ", subsequent_indent="        "))
    return "\n".join(lines) + "\n"
