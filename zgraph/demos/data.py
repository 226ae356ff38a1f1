"""Demo training text, generated locally: the docstrings of Python's standard library, byte-tokenized.

Nothing is downloaded. The corpus depends only on the Python installation, and batches are drawn from it with
a seeded generator, so every rank of a run sees the same corpus.
"""

from __future__ import annotations

import importlib
import inspect

import torch
from torch import Tensor

VOCAB = 256  # byte-level tokens

_MODULES = (
    "abc argparse ast asyncio base64 bisect calendar collections contextlib copy csv dataclasses datetime decimal "
    "difflib email enum fractions functools gettext glob gzip hashlib heapq hmac html http inspect io ipaddress "
    "itertools json logging mailbox math mimetypes numbers operator optparse os pathlib pickle pprint queue random "
    "re sched secrets shlex shutil socket statistics string struct subprocess tarfile tempfile textwrap threading "
    "timeit tokenize traceback turtle typing unittest urllib uuid warnings weakref zipfile zoneinfo"
).split()


def corpus_text() -> str:
    """English prose from the standard library's docstrings (about a megabyte)."""
    parts = []
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # an optional module missing in this Python build
            continue
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            if doc and len(doc) > 200:
                parts.append(doc)
    return "\n\n".join(parts)


def corpus_tokens() -> Tensor:
    """The corpus as a 1-D tensor of byte tokens."""
    return torch.frombuffer(bytearray(corpus_text().encode("utf-8", "replace")), dtype=torch.uint8).long()


def batch(tokens: Tensor, batch_size: int, seq: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random windows of ``seq + 1`` tokens: inputs and next-token targets."""
    starts = torch.randint(0, tokens.numel() - seq - 1, (batch_size,), generator=generator)
    windows = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]
