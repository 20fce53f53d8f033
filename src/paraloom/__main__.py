"""``python -m paraloom``: the ``paraloom`` command line without its installed script."""

import sys

from paraloom.cli import main

sys.exit(main())
