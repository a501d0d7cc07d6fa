"""`python -m dew ...` runs the `dew` command, as `dew train --processes` starts its processes."""

import sys

from dew._command import main

sys.exit(main())
