"""zgraph inside other libraries' training loops: the top floor of the user surface. It may import the whole
library; nothing in zgraph imports it, and importing ``zgraph`` never imports what it wraps (transformers stays an
optional extra: ``pip install 'zgraph[hf]'``).

Files::

    transformers.py   ZGraphTrainer (a transformers.Trainer whose update is one zgraph step),
                      ZGraphTrainingArguments (deepspeed= read by zgraph, no DeepSpeed package needed)
    accelerate.py     ZGraphAccelerator: a user's own accelerate loop run as zgraph steps (the model's forward
                      with its compiled backward, the optimizer step), no DDP wrapper
    hf_accelerate.py  the accelerate pieces the trainer swaps in: no DDP wrapper, an optimizer handle whose
                      step() is the zgraph step's
    hf_args.py        TrainingArguments zgraph cannot honour, refused when the trainer is built; the zgraph
                      Config a trainer runs with (from a Config, a DeepSpeed JSON, or the arguments)
    trl.py            ZGraphSFTTrainer (TRL's SFTTrainer on ZGraphTrainer's step; its metrics come out of the
                      step), ZGraphSFTConfig; needs trl
    trl_logprob.py    TRL's chunked log-prob kernel as one op of the step graph (its token loop would fix the
                      token count: a capture per padded length)
    hf_deepspeed.py   DeepSpeed JSON "auto" values filled from TrainingArguments, as transformers' DeepSpeed
                      integration fills them (plain dicts: no transformers import)
"""
