"""Inspection: what the passes did, and what a step will cost before it runs.

Files::

    explain.py   ``step.explain()`` and ``step.dump()``
    pipeline_view.py  explain() of a pipelined step: each block's stage and rank, the schedule's timeline and bubble
    estimate.py  ``step.estimate(...)``: memory and communication per rank, on meta stand-ins
    model_state.py  the model state a step graph leaves, piece by piece and by kind
    pipeline_estimate.py  the estimate of a pipelined step: each stage's memory, each rank's peak under the schedule
    stage_parts.py  a pipeline's stage graphs measured, and a rank's actions walked in order: what it holds when
    stage_zero.py  ZeRO within a pipeline's stages: a stage's update and (stage 3) gather graphs as its group runs them
    shadow.py    the estimate's stand-ins: the call's modules and optimizers copied onto the meta device, traced
    liveness.py  bytes alive after each node and the peak
    budget.py    ``Config.memory_budget``: the fastest estimated combination of remat and offload that fits
    pipeline_budget.py  ``Config.memory_budget`` of a pipelined step: per rank, the lightest remat that fits
    reuse.py     an estimate of a call the step has captured copies the step's capture instead of tracing
    variants.py  estimates of several configs of one captured step, the passes they share run once
    budget_sizes.py  the argument sizes a budget's plan is for; a larger call is planned again
"""
