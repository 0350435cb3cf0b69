"""``python -m dsv4cp COMMAND ...``, so that ``torchrun --nproc-per-node 2 -m dsv4cp sweep SPEC`` works."""

import sys

from dsv4cp.cli.main import main

sys.exit(main())
