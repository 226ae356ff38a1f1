"""The ``zgraph`` command.

Files::

    __main__.py  ``python -m zgraph.cli``
    main.py      argument parsing and the sub-commands
    estimate.py  ``zgraph estimate``
    estimate_lengths.py  ``zgraph estimate --seq-lens``: one trace, the sequence a size symbol; a table over lengths
    estimate_pipeline.py  ``zgraph estimate --pipeline-parallel``: the pipeline's flags, a row per stage, the bubble
    units.py     bytes as ``zgraph estimate`` reads and prints them; its error for bad input
"""
