"""Fail the docs build when a public name is missing from the API reference.

For every package in :data:`PUBLIC_PACKAGES`, each name in its ``__all__`` must be documented:
either under its own path (``unitscale.tracking.ScaleMonitor``) or, for a re-export, as the
same object under another documented path (``unitscale.Linear`` is
``unitscale.modules.Linear``). A class or function must also have a docstring. Each miss is a
Sphinx warning, which ``-W`` turns into a failed build.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.errors import PycodeError
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging

logger = logging.getLogger(__name__)

#: The packages whose ``__all__`` is the public API (private ``_modules`` are not).
PUBLIC_PACKAGES = (
    "unitscale",
    "unitscale.scale",
    "unitscale.constraints",
    "unitscale.parameter",
    "unitscale.errors",
    "unitscale.functional",
    "unitscale.modules",
    "unitscale.optim",
    "unitscale.data_parallel",
    "unitscale.formats",
    "unitscale.capture",
    "unitscale.tracking",
    "unitscale.transforms",
    "unitscale.analysis",
    "unitscale.utils",
    "unitscale.models",
    "unitscale.data",
    "unitscale.training",
    "unitscale.integrations",
    "unitscale.cli",
)


def _resolve(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        return None
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError):
        try:
            return importlib.import_module(path)
        except ImportError:
            return None


def missing_names(documented: set[str]) -> list[str]:
    """The ``package.name`` of each public name not documented (see the module docstring)."""
    by_identity: dict[int, str] = {}
    for path in documented:
        value = _resolve(path)
        if value is not None and (
            inspect.isclass(value) or callable(value) or inspect.ismodule(value)
        ):
            by_identity.setdefault(id(value), path)
    missing = []
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", ()):
            path = f"{package}.{name}"
            value = getattr(module, name)
            if path in documented:
                pass
            elif inspect.ismodule(value) and value.__name__ in documented:
                pass
            elif id(value) in by_identity and not isinstance(value, (int, float, str, tuple)):
                pass
            else:
                missing.append(f"{path} (not in the API reference)")
                continue
            if (inspect.isclass(value) or inspect.isfunction(value)) and not inspect.getdoc(value):
                missing.append(f"{path} (no docstring)")
    return missing


def constant_docs(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """A re-exported constant gets its ``#:`` comment from the module that defines it.

    autodoc looks for the comment in the importing module only, and otherwise shows the
    docstring of the value's type (``dict``'s, ``FPFormat``'s), which says nothing about the
    constant.
    """
    if what not in ("data", "attribute") or inspect.isclass(obj) or callable(obj):
        return
    if lines and "\n".join(lines).strip() != (inspect.getdoc(type(obj)) or "").strip():
        return
    package, _, attr = name.rpartition(".")
    for module_name in sorted(
        m for m in sys.modules if m == package or m.startswith(package + ".")
    ):
        try:
            docs = ModuleAnalyzer.for_module(module_name).find_attr_docs()
        except PycodeError:
            continue
        found = docs.get(("", attr))
        if found:
            lines[:] = list(found)
            return
    lines[:] = []


def check(app: Sphinx, env: BuildEnvironment) -> None:
    documented = set(env.get_domain("py").objects)  # type: ignore[attr-defined]
    documented |= set(env.get_domain("py").modules)  # type: ignore[attr-defined]
    for problem in missing_names(documented):
        logger.warning("public name %s", problem, type="unitscale", subtype="api")


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("env-check-consistency", check)
    app.connect("autodoc-process-docstring", constant_docs, priority=400)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
