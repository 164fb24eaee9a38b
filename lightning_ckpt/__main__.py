"""``python -m lightning_ckpt``: the command line (:mod:`lightning_ckpt.cli.main`)."""

import sys

from lightning_ckpt.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
