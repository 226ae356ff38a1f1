"""DeepSpeed JSON configs read as plain values (never imports ``zgraph.Config``; ``Config.from_deepspeed`` builds
one from what these return).

Files::

    config.py  the config's sections as ``Config`` fields
    keys.py    every key DeepSpeed 0.19.8 reads, and what zgraph does with it
    values.py  strict readers for JSON values
    optim.py   ``zgraph.optimizer_from_deepspeed``: the optimizer and LR scheduler sections
"""
