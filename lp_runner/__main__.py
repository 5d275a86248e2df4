"""``python -m lp_runner`` and ``torchrun -m lp_runner``: the command line (``lp_runner.cli.main``)."""

import sys

from lp_runner.cli.main import main

sys.exit(main())
