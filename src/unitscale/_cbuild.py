"""Compile a small dependency-free C file once per machine and load it with :mod:`ctypes`.

Shared by the native kernels (:mod:`unitscale.tracking._native` for scale statistics,
:mod:`unitscale.formats._native` for rounding). A library is built at first use, with the
first set of optional flags the compiler accepts (OpenMP, the host's vector instructions),
into a cache directory under a name keyed by its source, compiler, flags and machine, so a
changed source never loads a stale build. Concurrent processes may race to build: each
builds in a temporary directory and renames the result into place atomically.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "OPTIONAL_FLAGS",
    "LazyLibrary",
    "cache_dir",
    "compiler",
    "declare",
    "load",
    "load_extension",
]

#: Tried in order: OpenMP (PyTorch's own runtime, already loaded: the same threads) and the
#: host's vector instructions where the compiler has them.
OPTIONAL_FLAGS: tuple[tuple[str, ...], ...] = (
    ("-fopenmp", "-march=native"),
    ("-fopenmp",),
    ("-march=native",),
    (),
)


def cache_dir() -> Path:
    """``UNITSCALE_CACHE_DIR``, else ``$XDG_CACHE_HOME/unitscale`` or ``~/.cache/unitscale``."""
    explicit = os.environ.get("UNITSCALE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    root = os.environ.get("XDG_CACHE_HOME")
    return (Path(root) if root else Path.home() / ".cache") / "unitscale"


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else the first of ``cc``, ``gcc``, ``clang`` found."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def declare(function: Any, argtypes: Sequence[Any], restype: Any = None) -> Any:
    """``function`` (from a loaded library) declared to take ``argtypes`` and return
    ``restype`` (None: void)."""
    function.argtypes = list(argtypes)
    function.restype = restype
    return function


class LazyLibrary:
    """A library built and loaded at its first use (:meth:`get`), once per process.

    ``bind`` declares the functions' ctypes signatures on the loaded library. Where building
    or loading fails, :attr:`failure` says why, ``on_failure`` is called with it once, and
    the library stays unavailable: callers take their PyTorch path.
    """

    def __init__(
        self,
        name: str,
        source: str,
        flags: Sequence[str],
        bind: Callable[[ctypes.CDLL], None],
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.name, self.source, self.flags = name, source, tuple(flags)
        self._bind = bind
        self._on_failure = on_failure
        self._lib: ctypes.CDLL | None = None
        #: Why the library is unavailable ("" until a build or load has failed).
        self.failure = ""
        self._lock = threading.Lock()

    def get(self) -> ctypes.CDLL | None:
        """The loaded library (building it on the first call), or None where that failed."""
        if self._lib is not None or self.failure:
            return self._lib
        with self._lock:
            if self._lib is None and not self.failure:
                try:
                    lib = load(self.name, self.source, self.flags, compiler())
                    self._bind(lib)
                except (OSError, subprocess.SubprocessError) as error:
                    self.failure = str(error) or type(error).__name__
                    if self._on_failure is not None:
                        self._on_failure(self.failure)
                    return None
                self._lib = lib
        return self._lib


def load(name: str, source: str, flags: Sequence[str], cc: str | None) -> ctypes.CDLL:
    """The library ``name`` built from ``source`` with ``flags`` (plus the first accepted
    :data:`OPTIONAL_FLAGS`), from the cache when it is there.

    Raises :class:`OSError` where it cannot be built (Windows, no compiler, compile errors).
    """
    return ctypes.CDLL(str(_cached(name, source, flags, cc)))


def _cached(
    name: str,
    source: str,
    flags: Sequence[str],
    cc: str | None,
    suffix: str = ".so",
    build_flags: Sequence[str] = (),
    key_parts: Sequence[str] = (),
) -> Path:
    """The cached build of ``source`` (keyed by it, the compiler, ``flags``, the optional
    flags, the machine and ``key_parts``), built first where it is not there yet."""
    if sys.platform == "win32":
        raise OSError("not built on Windows")
    if cc is None:
        raise OSError("no C compiler found (set CC)")
    parts = [source, cc, *flags, *map(str, OPTIONAL_FLAGS), platform.machine(), *key_parts]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}{suffix}"
    if not target.exists():
        _build(name, source, [*build_flags, *flags], cc, target)
    return target


def load_extension(name: str, source: str, flags: Sequence[str], cc: str | None) -> ModuleType:
    """The CPython extension module ``name`` (its init function ``PyInit_<name>``) built from
    ``source`` with ``flags`` as :func:`load` builds a library, against the running
    interpreter's headers. A call into it costs a fraction of a :mod:`ctypes` call, whose
    argument conversion dominates for small tensors.

    Raises :class:`OSError` where it cannot be built (no compiler, no ``Python.h``: a Python
    without its development headers, compile errors) or loaded.
    """
    include = sysconfig.get_paths().get("include") or ""
    if not (Path(include) / "Python.h").exists():
        raise OSError(f"no Python.h in {include!r} (the Python development headers)")
    abi = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = _cached(name, source, flags, cc, abi, [f"-I{include}"], [include, abi])
    loader = importlib.machinery.ExtensionFileLoader(name, str(target))
    spec = importlib.util.spec_from_file_location(name, str(target), loader=loader)
    if spec is None:  # pragma: no cover - a file location with a loader always has a spec
        raise OSError(f"cannot load {target}")
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as error:
        raise OSError(f"cannot load {target}: {error}") from error
    return module


def _build(name: str, source: str, flags: Sequence[str], cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        path = Path(work) / f"unitscale_{name}.c"
        path.write_text(source)
        out = Path(work) / target.name
        errors = ""
        for extra in OPTIONAL_FLAGS:
            command = [cc, "-shared", "-fPIC", *flags, *extra, str(path), "-o", str(out)]
            result = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if result.returncode == 0:
                os.replace(out, target)
                return
            errors = result.stderr.strip()
        raise OSError(f"{cc} failed: {errors[:300]}")
