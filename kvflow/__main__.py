"""``python -m kvflow``: the same as the ``kvflow`` command."""

import sys

from kvflow.cli import main

sys.exit(main())
