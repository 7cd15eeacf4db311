"""The native kernels (src/unitscale/_native/): built by ``pip install`` as optional
extensions, never at run time."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import unitscale
from unitscale import _native

NAMES = ("_stats", "_rounding")


def test_ci_builds_every_extension() -> None:
    # CI (.ci/run) sets UNITSCALE_REQUIRE_NATIVE=1: there a failed build (a warning under
    # UNITSCALE_WERROR=1, a missing source) fails the suite instead of quietly leaving every
    # native test skipped and the PyTorch paths running.
    if os.environ.get("UNITSCALE_REQUIRE_NATIVE") != "1":
        pytest.skip("UNITSCALE_REQUIRE_NATIVE is not set (CI sets it)")
    for name in NAMES:
        assert _native.extension(name) is not None, _native.missing.get(name)


@pytest.mark.parametrize("name", NAMES)
def test_an_extension_is_a_file_of_the_installed_package(name: str) -> None:
    module = _native.extension(name)
    if module is None:
        pytest.skip(f"not built at install: {_native.missing.get(name)}")
    assert module.__file__ is not None
    assert Path(module.__file__).parent == Path(unitscale.__file__).parent / "_native"


@pytest.mark.slow
def test_nothing_is_compiled_at_run_time(tmp_path: Path) -> None:
    # A fresh process that cannot start any program (a compiler included) and has an empty
    # cache directory reads CPU statistics and rounds to FP8 through the native kernels,
    # without a warning.
    script = textwrap.dedent(
        """
        import subprocess, warnings

        def refuse(*args, **kwargs):
            raise AssertionError(f"a program was started: {args[:1]}")

        # torch first: a CUDA build of torch may warn at import on a CPU, and runs ldconfig
        # to find its libraries (torch 2.14.1); what is checked is unitscale's import and use.
        import torch

        subprocess.Popen = refuse
        warnings.simplefilter("error")
        from unitscale.formats import E4M3
        from unitscale.formats._native import rounding
        from unitscale.tracking import metrics
        from unitscale.tracking._native import native

        x = torch.randn(1000)
        metrics.tensor_stats(x)
        E4M3.quantise(x)
        print(native.loaded(), rounding.available())
        """
    )
    environment = {**os.environ, "UNITSCALE_CACHE_DIR": str(tmp_path), "HOME": str(tmp_path)}
    environment["XDG_CACHE_HOME"] = str(tmp_path)
    built = all(_native.extension(name) is not None for name in NAMES)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment
    )
    if not built:  # the PyTorch paths, with their one warning (an error here)
        assert "native kernels were not built at install" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "True"]
    assert not list(tmp_path.iterdir())
