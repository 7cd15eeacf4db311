"""The demo: built-in models, the bundled corpus and the experiments the command drives.

Built on the library's public layers (modules, transforms, tracking, analysis); nothing
below imports from here. Also importable under their short names: ``unitscale.models``,
``unitscale.data``, ``unitscale.training``.

Every experiment (:mod:`.training` for ``unitscale train``, :mod:`.transfer` for
``unitscale transfer``) trains with one runner (:mod:`.runner`: data streams, evaluation
batches, the schedule and the loop) and writes its files with one report writer
(:mod:`.report`); each holds only what is its own: its run kinds, its claims, its tables.
"""

from . import data, models, report, runner, training, transfer

__all__ = ["data", "models", "report", "runner", "training", "transfer"]
