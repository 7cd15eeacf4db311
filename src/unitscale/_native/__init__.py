"""The native kernels: C sources beside this file (``stats.c``, ``rounding.c``), compiled by
``pip install`` as the optional extensions ``_stats`` and ``_rounding`` (see ``setup.py``).

Nothing is compiled at import or run time. Where an extension was not built (no C compiler
at install time, a failed build), :func:`extension` returns None and warns once per process
that the PyTorch paths run instead (the same values, more slowly).
"""

from __future__ import annotations

import importlib
import threading
import warnings
from types import ModuleType

__all__ = ["extension", "missing"]

_loaded: dict[str, ModuleType | None] = {}
#: Why each extension that is looked for is missing (its import error), by name.
missing: dict[str, str] = {}
_warned: list[bool] = []
_lock = threading.Lock()


def extension(name: str) -> ModuleType | None:
    """The built extension ``unitscale._native.<name>`` (``"_stats"`` or ``"_rounding"``),
    or None where the install did not build it (the first such call warns, once for all)."""
    if name in _loaded:
        return _loaded[name]
    with _lock:
        if name not in _loaded:
            module: ModuleType | None
            try:
                module = importlib.import_module(f"{__name__}.{name}")
            except ImportError as error:
                module = None
                missing[name] = str(error) or type(error).__name__
                _warn_once(name, missing[name])
            _loaded[name] = module
    return _loaded[name]


def _warn_once(name: str, reason: str) -> None:
    if _warned:
        return
    _warned.append(True)
    warnings.warn(
        f"unitscale: the native kernels were not built at install ({name}: {reason}); "
        "PyTorch ops compute the CPU scale statistics and format rounding instead (the same "
        "values, more slowly). Reinstall unitscale where a C compiler is found to build them",
        RuntimeWarning,
        stacklevel=3,
    )
