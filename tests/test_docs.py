"""The documentation's API check: it knows every public package and flags a missing name.

The build itself (``sphinx-build -W``) runs in ``.ci/run``; these tests check the checker.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

import unitscale

DOCS = Path(__file__).resolve().parents[1] / "docs"
# Layers whose names are all documented under another path: experiments holds the code of
# unitscale.models, unitscale.data and unitscale.training.
NOT_IN_REFERENCE = {"unitscale.experiments"}


def _checker() -> ModuleType:
    pytest.importorskip("sphinx")
    spec = importlib.util.spec_from_file_location(
        "check_public_api", DOCS / "_ext" / "check_public_api.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_public_api", module)
    spec.loader.exec_module(module)
    return module


def test_every_public_package_with_all_is_checked_and_has_a_page() -> None:
    checker = _checker()
    public = {"unitscale"}
    for info in pkgutil.iter_modules(unitscale.__path__):
        name = f"unitscale.{info.name}"
        if info.name.startswith("_") or name in NOT_IN_REFERENCE:
            continue
        if hasattr(importlib.import_module(name), "__all__"):
            public.add(name)
    assert set(checker.PUBLIC_PACKAGES) == public
    for package in public:
        page = DOCS / "api" / f"{package.rpartition('.')[2] or package}.rst"
        assert f".. automodule:: {package}\n" in page.read_text(), page


def test_missing_names_flags_undocumented_and_accepts_re_exports() -> None:
    checker = _checker()
    # Nothing documented: every public name is missing, e.g. a top-level class.
    nothing = checker.missing_names(set())
    assert "unitscale.Linear (not in the API reference)" in nothing
    assert "unitscale.integrations.ScaleMonitorCallback (not in the API reference)" in nothing
    # Documenting the canonical path covers the re-export (same object), but not constants.
    covered = checker.missing_names({"unitscale.modules.Linear", "unitscale.formats.E4M3"})
    assert not any(m.startswith("unitscale.Linear ") for m in covered)
    assert "unitscale.modules.Linear (not in the API reference)" not in covered
    assert "unitscale.formats.E4M3 (not in the API reference)" not in covered
    assert "unitscale.formats.E5M2 (not in the API reference)" in covered
