"""The demos and their models and data: users of the library (nothing in the library imports them).

Files::

    gpt_demo.py         ``zgraph demo``: a small GPT on several ranks
    multimodal_demo.py  ``zgraph demo --multimodal``: the seeds' disaggregated multimodal training
    multimodal.py       the multimodal models and their step
    models.py           a GPT-2-style decoder (demo, benchmarks, tests)
    llama.py            a Llama-shaped decoder (``zgraph estimate --model llama-7b``)
    data.py             demo text, generated locally
    ranks.py            local ranks for the demos: start (forked from a forkserver), wait, collect
"""
