"""Safetensors files for tests, written without numpy (``safetensors.torch.save_file`` needs it, and the README's
test run has none): zgraph's streaming writer, which writes ``save_file``'s own bytes (``test_save_pretrained``
checks that where numpy is installed)."""

from __future__ import annotations

import os

from torch import Tensor

from zgraph.weights.safetensors_stream import Entry, StreamWriter


def save_file(tensors: dict[str, Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    entries = [Entry(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    with StreamWriter(os.fspath(path), entries, metadata or {"format": "pt"}) as writer:
        for entry in writer.order:
            writer.write(entry.name, tensors[entry.name])
