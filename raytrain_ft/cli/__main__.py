"""`python -m raytrain_ft.cli`: the `raytrain-ft` command."""

import sys

from raytrain_ft.cli import main

sys.exit(main())
