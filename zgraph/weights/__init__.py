"""Models bigger than one rank: built on the meta device, initialised and loaded straight into shards, exported
without a whole copy. Imports the config, the binding's layout, the checkpoint floor and the runtime.

Files::

    materialize.py      ``zgraph.materialize``: a meta model's state allocated as the step lays it out, and filled
                        by the model's own initialisation
    load.py             ``zgraph.load_pretrained``: Hugging Face safetensors (one file or an index) and DCP
                        directories read into the shards, each rank reading only its rows; all or nothing
    sources.py          the checkpoints ``load_pretrained`` reads (safetensors file or index, DCP directory): their
                        tensors' names, shapes and dtypes, and the rows of dim 0 asked for, nothing unpickled
    report.py           a checkpoint's names against a model's (missing, unexpected, mis-shaped), reported as
                        ``from_pretrained``'s load report; ``PretrainedMismatchError``
    save.py             ``zgraph.save_pretrained``: sharded safetensors and their index, one tensor gathered at a time
    safetensors_stream.py  the safetensors format written one tensor at a time (header first, from the shapes)
"""
