"""Capture: the user's step traced, on fake tensors, into one functional aten graph (forward, every backward,
the optimizer), with the state it reads and writes as graph inputs and outputs.

Files::

    protocol.py         the one capture protocol: guess first-step state, trace, bind more, trace again, split
    trace.py            one trace of the step: the traced call, its outputs and their roles
    inputs.py           the graph inputs of a call, in graph order, and their fake stand-ins
    captured.py         what a capture is asked and returns: ``CaptureRequest``, ``Traced``, ``CapturedGraph``
    environment.py      what zgraph swaps, patches and watches while the step runs under ``make_fx``
    diagnosis.py        how a failed trace is explained: the user's line, the data-dependent operation
    compiled.py         torch.compile wrappers the step reaches (torch.compile(model), module.compile()), traced through
    optimizers.py       optimizers and LR schedulers while a step is traced; a first step's optimizer state
    update_rules.py     traceable update rules of the ``torch.optim`` classes whose hyper-parameters are inputs
    as_written.py       the other ``torch.optim`` classes, traced as written: hyper-parameters as inputs
    host_scalars.py     ``.item()`` of values the host knows (step counters, 0-d int buffers): branches as guards
    size_guards.py      the conditions on an argument's symbolic sizes a graph holds for, checked before each call
    symbolic_calls.py   calls that would fix such a value (``torch.tensor(x)``, BatchNorm's momentum) kept symbolic
    precision.py        mixed precision, loss scaling and clipping while tracing
    collectives.py      ``torch.distributed`` calls in the step, traced as functional collectives
    generator_state.py  random generator state read and set in the step, as graph operations
    random_layout.py    random ops draw their numbers into the elements eager PyTorch gives them
    functionalize.py    the step functionalized as it is traced; the functional graph named and tagged
    joint.py            split mode: the step and the backward of its returned outputs, traced as one joint graph
    blocks.py           the model's repeated blocks marked on the nodes they make (``Config.remat``)
    cuda_trace.py       tracing a step as CUDA would run it, on CPU fakes (estimates)
    fake_kernels.py     fake kernels wider than torch's
    model_hints.py      what to change, for capture failures from known third-party model patterns
"""
