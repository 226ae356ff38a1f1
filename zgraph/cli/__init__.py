"""The ``zgraph`` command.

Files::

    main.py      argument parsing and the sub-commands
    estimate.py  ``zgraph estimate``
"""
