"""``python -m twofour``: the CLI (also what ``torchrun -m twofour`` starts on each process)."""

import sys

from .cli import main

sys.exit(main())
