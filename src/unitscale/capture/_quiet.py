"""torch's own log lines kept quiet while unitscale captures a module.

When a user's forward fails inside TorchDynamo (a shape error, say), torch logs it before
raising: ``torch._subclasses.fake_tensor`` writes an ERROR with a 20-line traceback ("failed
while attempting to run meta for aten.mm.default") and Dynamo logs what it gave up on. The
capture then raises the user's own exception, run eagerly (``_core.py``,
``Capture._raise_eager_error``), and unitscale's warnings say what was not transformed; the
log lines only repeat it in torch's internals. They are dropped while a capture runs (in the
capturing thread only), by a filter on those loggers. ``TORCH_LOGS`` set in the environment
(the user asked for torch's logs) keeps them all.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["quiet_torch_logs"]

#: The loggers (and their children) dropped during a capture.
QUIETED = ("torch._subclasses", "torch._dynamo", "torch.fx.experimental.symbolic_shapes")


class _DuringCapture(logging.Filter):
    """Drops records of :data:`QUIETED` loggers logged by a thread that is capturing."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(self.local, "depth", 0):
            return True
        return not _quieted(record.name)


_FILTER = _DuringCapture()


_SCANNED = [-1]  # the number of loggers when the handlers were last looked at


def _quieted(name: str) -> bool:
    return any(name == n or name.startswith(n + ".") for n in QUIETED)


def _install() -> None:
    """Put the filter on every logger of :data:`QUIETED` and their children (a logger's
    filters see each record created there, before any handler: torch's, which it re-creates
    when its log settings change, or a user's). Looked at again only when loggers were added
    (the scan is O(loggers), the check per capture O(1))."""
    loggers = logging.Logger.manager.loggerDict
    if len(loggers) == _SCANNED[0]:
        return
    names = [name for name in list(loggers) if _quieted(name)] + list(QUIETED)
    for name in names:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    _SCANNED[0] = len(loggers)


@contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """Drop torch's own log records of :data:`QUIETED` in this thread while the block runs
    (exceptions pass through unchanged); nothing is dropped when ``TORCH_LOGS`` is set."""
    if os.environ.get("TORCH_LOGS"):
        yield
        return
    _install()
    local = _FILTER.local
    local.depth = getattr(local, "depth", 0) + 1
    try:
        yield
    finally:
        local.depth -= 1
