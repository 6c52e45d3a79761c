"""`python -m blockspec.cli` (e.g. under torchrun)."""

import sys

from blockspec.cli import main

sys.exit(main())
