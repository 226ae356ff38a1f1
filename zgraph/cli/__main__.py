"""``python -m zgraph.cli``: the ``zgraph`` command."""

import sys

from zgraph.cli.main import main

sys.exit(main())
