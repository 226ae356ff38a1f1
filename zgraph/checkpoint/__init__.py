"""Checkpoints and whole tensors of sharded state. Imports only ``zgraph.runtime``, the contract and ``zgraph.version``.

Files::

    save_load.py        ``zgraph.save``, ``zgraph.load``, ``zgraph.consolidate``
    ranks.py            every rank's outcome of each part of a save or load, exchanged so that all raise if one failed
    state.py            what a checkpoint holds and how it is matched against a model and optimizers
    load_optimizers.py  what ``load`` puts into the optimizers: saved values checked, staged state committed
    data.py             non-tensor state stored as JSON data beside DCP tensors
    io.py               the on-disk side: manifest, hashes, atomic writes
    read.py             reading checkpoints safely (allow-list unpickler, checked files)
    gather.py           ``zgraph.gather``, ``zgraph.full_state_dict`` and ``zgraph.stream_state_dict``
"""
