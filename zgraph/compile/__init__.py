"""Compile: a captured graph through the pass list, lowered for the backend, and run against the live state.

Files::

    variant.py       ``CompiledStep``, ``SplitCompiled``, ``PipelineCompiled``: one compiled variant of the step
    build.py         captured graph -> passes -> lowering -> ``CompiledStep``
    lower.py         the backend's rewrites and compilation; a split step's two halves
    run.py           running a variant on the live state: inputs read, graph run, state written back
    split_runner.py  split mode, running side: the forward in the call, the backward from autograd
    pipeline.py      pipeline parallelism: the captured graph cut into stages, this rank's compiled
    pipeline_call.py a pipelined call: this rank's schedule run on the state, the results over the micro-batches
"""
