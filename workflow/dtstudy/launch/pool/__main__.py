"""`python -m dtstudy.launch.pool`: the warm pool's server."""

import sys

from dtstudy.launch.pool import main

sys.exit(main())
