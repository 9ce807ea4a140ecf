"""`python -m grpolab.cli ...`: the same command line as `grpolab ...`."""

import sys

from grpolab.cli import main

sys.exit(main())
