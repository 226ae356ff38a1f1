"""Checkpoints and whole tensors of sharded state. Imports only ``zgraph.runtime`` and the contract.

Files::

    save_load.py  ``zgraph.save``, ``zgraph.load``, ``zgraph.consolidate``
    state.py      what a checkpoint holds and how it is matched against a model and optimizers
    data.py       non-tensor state stored as JSON data beside DCP tensors
    io.py         the on-disk side: manifest, hashes, atomic writes
    read.py       reading checkpoints safely (allow-list unpickler, checked files)
    gather.py     ``zgraph.gather`` and ``zgraph.full_state_dict``
"""
