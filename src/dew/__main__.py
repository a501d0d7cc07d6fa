"""`python -m dew ...` runs the `dew` command, as `dew train --processes` starts its processes."""

import sys

from dew.cli import main

sys.exit(main())
