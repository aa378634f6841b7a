"""`python -m mtplx_ext.cli`: the `mtplx-ext` command."""

import sys

from mtplx_ext.cli import main

sys.exit(main())
