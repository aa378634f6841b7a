"""`python -m mtplx_ext.train`."""

from mtplx_ext.train.cli import main

main()
