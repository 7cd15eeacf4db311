"""``python -m unitscale``: the same as the ``unitscale`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
