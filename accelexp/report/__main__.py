"""`python -m accelexp.report`: the `accelexp-report` command."""

import sys

from accelexp.report.cli import main

sys.exit(main())
