"""`python -m kvlab.cli ...` is the `kvlab` command."""

import sys

from . import main

sys.exit(main())
