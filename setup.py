"""The optional native extensions (``src/unitscale/_native/*.c``); everything else is in
pyproject.toml.

Both are built by ``pip install`` (and ``pip install -e .``) where a C compiler is found, with
baseline flags for the target architecture only (no ``-march=native``: a build runs on every
CPU of its architecture), warnings on (``-Wall -Wextra``, and ``-Werror`` where the
environment sets ``UNITSCALE_WERROR=1``, as CI does) and OpenMP where the compiler takes it.
They need only the Python headers, not torch's. Where they cannot be built the install
succeeds all the same and unitscale runs its PyTorch paths (the same values), saying so once.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_HERE = Path("src/unitscale/_native")
_WARNINGS = ["-Wall", "-Wextra"]
# No -ffast-math: these keep IEEE semantics (no finite-math or flush-to-zero assumptions).
_IEEE = ["-O3", "-fno-math-errno", "-fno-trapping-math"]
# Reassociating the statistics' float64 sums lets the compiler vectorise them (which changes
# only their rounding); the rounding kernels must not be reassociated.
_REASSOCIATE = ["-fassociative-math", "-fno-signed-zeros"]


def _extension(name: str, flags: list[str]) -> Extension:
    return Extension(
        f"unitscale._native.{name}",
        sources=[str(_HERE / f"{name[1:]}.c")],
        depends=[str(_HERE / "native.h")],
        extra_compile_args=_IEEE + flags,
        optional=True,
    )


class _BuildExt(build_ext):
    """build_ext with warnings (errors under ``UNITSCALE_WERROR=1``) and OpenMP where the
    compiler accepts ``-fopenmp``."""

    def build_extensions(self) -> None:
        extra = list(_WARNINGS)
        if os.environ.get("UNITSCALE_WERROR") == "1":
            extra.append("-Werror")
        openmp = self.compiler.compiler_type == "unix" and self._accepts("-fopenmp")
        for extension in self.extensions:
            extension.extra_compile_args = [*extension.extra_compile_args, *extra]
            if openmp:
                extension.extra_compile_args.append("-fopenmp")
                extension.extra_link_args = [*extension.extra_link_args, "-fopenmp"]
        super().build_extensions()

    def _accepts(self, flag: str) -> bool:
        with tempfile.TemporaryDirectory() as work:
            source = Path(work) / "probe.c"
            source.write_text("int main(void) { return 0; }\n")
            try:
                objects = self.compiler.compile(
                    [str(source)], output_dir=work, extra_postargs=[flag]
                )
                self.compiler.link_executable(
                    objects, "probe", output_dir=work, extra_postargs=[flag]
                )
            except Exception:  # the compiler's own error types vary: any failure means no
                return False
        return True


setup(
    ext_modules=[_extension("_stats", _REASSOCIATE), _extension("_rounding", [])],
    cmdclass={"build_ext": _BuildExt},
)
