"""``python -m unitscale.cli``: the same as the ``unitscale`` command."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
