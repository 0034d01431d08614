"""`python -m pkv`: the `pkv` command."""

import sys

from pkv.cli import main

sys.exit(main())
