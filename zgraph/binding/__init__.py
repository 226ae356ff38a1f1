"""Binding: what a step call reaches (modules, optimizers, tensors read outside its arguments), bound once per set
of state and laid out for the step's ranks; the guard key a compiled variant is cached under.

Files::

    arguments.py  one call of a step (``StepCall``): its function and arguments, bound to the signature once
    guards.py     discovery of modules and optimizers; the guard key
    dynamic.py    which argument dims are symbolic sizes: zgraph.mark_dynamic, automatic dynamic, declared ranges,
                  sizes that differ between ranks
    locate.py     where the tensors a step reads outside its arguments live
    setup.py      the one binding set-up (check, then lay out), for a call and for an estimate
    host_layout.py  stages 1 and 2 with the update on the host on several ranks: stage 3's layout
    session.py    what a step remembers between calls (bindings, observed state, located tensors); a call bound
    micro_batches.py  a pipelined step's call cut into micro-batches along its tensor arguments' dim 0
"""
