"""The host-memory offload tier's protocol on real tensors: what ``prepare`` releases, ``read`` returns, ``write`` /
``commit`` keep and ``materialize`` / ``close`` give back (``zgraph.runtime.offload_host``).

On a GPU the store copies over a stream of its own; here, with host tensors standing for the device's, the copies
are synchronous and the bookkeeping — which storages are released, what each reload reads, what the next step
sees — is the same. The whole step on the stand-in device is in ``tests/test_device_path.py``.
"""

from __future__ import annotations

import torch

from zgraph.runtime.offload_host import HostStore

KEYS = [("opt_state", 0, "exp_avg", 0), ("opt_state", 1, "exp_avg", 0)]


def _inputs() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(64, 8), torch.randn(32)]


def test_released_between_steps_read_back_per_reload_and_written_in_place():
    store = HostStore(torch.device("cpu"), window=64 * 4)
    a, b = _inputs()
    first_a, first_b = a.clone(), b.clone()
    slots = {0: (KEYS[0], a), 1: (KEYS[1], b)}
    store.prepare(slots, keep=[], order=[0, 1, 0])  # `a` reloaded twice (two phases)
    assert a.untyped_storage().nbytes() == 0 and b.untyped_storage().nbytes() == 0
    assert store.bytes_offloaded == (64 * 8 + 32) * 4
    assert torch.equal(store.read(0, a), first_a) and torch.equal(store.read(1, b), first_b)
    assert torch.equal(store.read(0, a), first_a)  # the second phase reads the value the step started from
    store.write(0, first_a * 2)
    store.commit()
    store.prepare(slots, keep=[], order=[0, 1])  # the next step reads what this one wrote
    assert torch.equal(store.read(0, a), first_a * 2) and torch.equal(store.read(1, b), first_b)
    store.commit()
    store.materialize()
    assert torch.equal(a, first_a * 2) and torch.equal(b, first_b)


def test_an_input_read_directly_keeps_its_memory_and_takes_the_new_value():
    store = HostStore(torch.device("cpu"))
    a, b = _inputs()
    first_a = a.clone()
    store.prepare({0: (KEYS[0], a)}, keep=[a], order=[0])  # the graph also reads `a` without a reload
    assert a.untyped_storage().nbytes() == a.numel() * 4 and store.bytes_offloaded == 0
    store.write(0, first_a + 1)
    store.commit()
    assert torch.equal(a, first_a + 1)


def test_closing_the_store_gives_every_state_its_memory_back():
    store = HostStore(torch.device("cpu"))
    a, b = _inputs()
    first_a = a.clone()
    store.prepare({0: (KEYS[0], a), 1: (KEYS[1], b)}, keep=[], order=[0, 1])
    store.abort()
    store.close()
    assert torch.equal(a, first_a) and b.untyped_storage().nbytes() == b.numel() * 4
