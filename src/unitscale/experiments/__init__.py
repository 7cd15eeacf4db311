"""The demo: built-in models, the bundled corpus and the training runs the command drives.

Built on the library's public layers (modules, transforms, tracking, analysis); nothing
below imports from here. Also importable under their short names: ``unitscale.models``,
``unitscale.data``, ``unitscale.training``.
"""

from . import data, models, training, transfer

__all__ = ["data", "models", "training", "transfer"]
