"""`python -m distore_ucx ...` is the `distore` command."""

import sys

from .cli import main

sys.exit(main())
