"""Inspection: what the passes did, and what a step will cost before it runs.

Files::

    explain.py   ``step.explain()`` and ``step.dump()``
    estimate.py  ``step.estimate(...)``: memory and communication per rank, on meta stand-ins
    liveness.py  bytes alive after each node and the peak
    budget.py    ``Config.memory_budget``: the fastest estimated combination of remat and offload that fits
"""
