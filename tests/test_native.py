"""The native kernels (src/unitscale/_native/): built by ``pip install`` as optional
extensions, never at run time."""

from __future__ import annotations

import os
import platform
import re
import shutil
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


# Instructions a baseline x86-64 CPU (SSE2) lacks: any AVX encoding, and the SSE3-SSE4.2,
# POPCNT/LZCNT/BMI instructions that the x86-64-v2 and v3 levels add.
_BEYOND_BASELINE = re.compile(
    r"%[yz]mm|%k[0-7]\b|^\s*[0-9a-f]+:\s+(v[a-z0-9]+|round[sp][sd]|pshufb|ptest|popcnt|lzcnt"
    r"|tzcnt|andn|bextr|[sp]dep|pext|shlx|shrx|sarx|rorx|mulx|blendv?p[sd]|pblend|pmulld"
    r"|pmaxs[bd]|pmins[bd]|pmaxu[wd]|pminu[wd]|insertps|extractps|pextr[bdq]|pinsr[bdq]"
    r"|dpp[sd]|hadd|hsub|movddup|movs[hl]dup|lddqu|pabs|palignr|pmovzx|pmovsx|pcmpeqq)\b",
    re.MULTILINE,
)


@pytest.mark.parametrize("name", NAMES)
def test_a_build_runs_on_every_x86_64_cpu(name: str) -> None:
    # An installed binary may be run by another machine than the one that built it (a
    # shared home, a container image): outside the clones that the loader picks from the
    # running CPU's features, the code must use baseline x86-64 instructions only, and every
    # function compiled for a newer level must have a baseline ("default") clone beside it.
    module = _native.extension(name)
    if module is None:
        pytest.skip(f"not built at install: {_native.missing.get(name)}")
    if platform.machine() != "x86_64" or shutil.which("objdump") is None:
        pytest.skip("needs an x86-64 machine and objdump")
    assert module.__file__ is not None
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", module.__file__],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    functions = re.split(r"^[0-9a-f]+ <([^>]+)>:$", listing, flags=re.MULTILINE)
    bodies = dict(zip(functions[1::2], functions[2::2], strict=True))
    newer = re.compile(r"\.arch_x86_64_v[34]$")
    beyond = sorted(f for f, body in bodies.items() if _BEYOND_BASELINE.search(body))
    assert beyond, "no function uses a newer instruction set: is the dispatch compiled in?"
    assert [f for f in beyond if not newer.search(f)] == []
    assert [f for f in beyond if newer.sub(".default", f) not in bodies] == []
