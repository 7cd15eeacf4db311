"""The package as a whole: what ``import unitscale`` costs, ``python -m unitscale``, layering."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _hang_guard import HANG_GUARD_S

SRC = Path(__file__).resolve().parents[1] / "src" / "unitscale"


@pytest.mark.slow
def test_import_does_not_load_dynamo_or_inductor() -> None:
    code = (
        "import sys, unitscale, unitscale.analysis, unitscale.cli, unitscale.integrations; "
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'transformers') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_python_m_unitscale_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "unitscale", "--help"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: unitscale")


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["train", "--help"], ["nosuch"]])
def test_python_m_unitscale_behaves_like_the_command(argv: list[str]) -> None:
    """Same output and exit status as the installed ``unitscale`` script, errors included."""
    script = Path(sys.executable).with_name("unitscale")
    if not script.exists():
        pytest.skip(f"no unitscale script beside {sys.executable} (package not installed)")
    runs = [
        subprocess.run(cmd + argv, capture_output=True, text=True, timeout=HANG_GUARD_S)
        for cmd in ([sys.executable, "-m", "unitscale"], [str(script)])
    ]
    module, command = runs
    assert (module.returncode, module.stdout, module.stderr) == (
        command.returncode,
        command.stdout,
        command.stderr,
    )
    assert module.returncode == (0 if argv[-1] == "--help" else 2)


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of the unitscale modules ``path`` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.update(f"{module}.{alias.name}" for alias in node.names)
            names.add(module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith("unitscale")}


def test_no_module_reaches_into_another_packages_private_module() -> None:
    """A package's ``_private`` modules are imported only from inside that package."""
    offenders = []
    for path in SRC.rglob("*.py"):
        owner = ".".join(path.relative_to(SRC.parent).parts[:2]).removesuffix(".py")
        for name in _imported_modules(path):
            parts = name.split(".")
            for part in parts[2:]:
                if part.startswith("_") and not part.startswith("__"):
                    if ".".join(parts[:2]) != owner:
                        offenders.append(f"{path.relative_to(SRC)} imports {name}")
                    break
    assert offenders == []


def test_top_level_help_imports_no_torch() -> None:
    """``unitscale --help`` and ``import unitscale`` stay fast: torch loads on first use."""
    code = (
        "import sys, contextlib, io\n"
        "import unitscale\n"
        "from unitscale.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch' in sys.modules, 'train ' in out.getvalue())\n"
        "unitscale.Linear\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "True"]


def test_lazy_names_are_the_submodules_objects() -> None:
    import unitscale
    import unitscale.modules
    import unitscale.tracking

    assert unitscale.Linear is unitscale.modules.Linear
    assert unitscale.ScaleMonitor is unitscale.tracking.ScaleMonitor
    assert set(unitscale.__all__) <= set(dir(unitscale))
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        unitscale.Nope  # noqa: B018


# -- comments and docstrings cite only what a clone has ----------------------------------------
ROOT = SRC.parents[1]
#: Files the repository does not have (they lived outside it), and tracker issue numbers.
#: Built from pieces so that this file does not match itself.
UNCITABLE = re.compile("|".join([r"STYLE\.md", r"DESIGN\.md", r"\b[Ii]ssue #?[0-9]+"]))
#: Citations allowed to stay, as (file, text) pairs; each entry must still be there (a stale
#: entry fails), so the list only shrinks. Empty: cite docs/, a source file or a paper.
UNCITABLE_LEFT: set[tuple[str, str]] = set()


def test_sources_cite_no_file_or_issue_the_repository_lacks() -> None:
    found = set()
    for folder in ("src", "tests", "benchmarks", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in {".py", ".rst", ".md", ".c", ".h"}:
                continue
            relative = path.relative_to(ROOT).as_posix()
            for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                for match in UNCITABLE.finditer(line):
                    left = next((s for f, s in UNCITABLE_LEFT if f == relative and s in line), None)
                    found.add((relative, left) if left else (f"{relative}:{lineno}", match[0]))
    assert found - UNCITABLE_LEFT == set(), "cite docs/, a source file or a paper instead"
    assert UNCITABLE_LEFT - found == set(), "fixed: delete these from UNCITABLE_LEFT"


#: Modules allowed over ``MAX_MODULE_LINES`` and functions (``path::qualname``) allowed over
#: ``MAX_FUNCTION_LINES`` for now, each with why; an entry that no longer applies fails, so the
#: list only shrinks. A function may instead carry ``# long: <reason>`` on or above its ``def``.
TOO_LONG_LEFT: dict[str, str] = {}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def function_lengths(source: str) -> dict[str, int]:
    """``qualname`` -> lines from ``def`` to the function's end, its docstring excluded, for
    every function in ``source`` not marked ``# long: <reason>`` on its ``def`` line or the
    line above it."""
    lines = source.splitlines()
    lengths = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    marked = any(
                        "# long:" in line for line in lines[child.lineno - 2 : child.lineno]
                    )
                    length = (child.end_lineno or child.lineno) - child.lineno + 1
                    first = child.body[0]
                    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                        if isinstance(first.value.value, str):
                            length -= (first.end_lineno or first.lineno) - first.lineno + 1
                    if not marked:
                        lengths[name] = length
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return lengths


def test_function_lengths_counts_code_not_docstrings_and_honours_the_marker() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(3))
    documented = f'def f():\n    """Doc.\n\n    More.\n    """\n{body}'
    source = f"{documented}\n# long: a flat table\ndef g():\n{body}"
    assert function_lengths(source) == {"f": 4}


def test_modules_and_functions_fit_on_a_screen() -> None:
    """A module holds one idea (at most ``MAX_MODULE_LINES``), a function one step (at most
    ``MAX_FUNCTION_LINES`` of code): split a longer one into named helpers or modules."""
    found = set()
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC).as_posix()
        source = path.read_text(encoding="utf-8")
        if len(source.splitlines()) > MAX_MODULE_LINES:
            found.add(relative)
        for name, length in function_lengths(source).items():
            if length > MAX_FUNCTION_LINES:
                found.add(f"{relative}::{name}")
    assert found - set(TOO_LONG_LEFT) == set(), "split these, or mark a function '# long: why'"
    assert set(TOO_LONG_LEFT) - found == set(), "fixed: delete these from TOO_LONG_LEFT"


def test_benchmark_modules_fit_on_a_screen() -> None:
    """The same module rule for ``benchmarks/`` (the README table generator is split by table
    family: ``readme_tables.py`` and its ``_tables_*.py``)."""
    long = [
        path.name
        for path in sorted((ROOT / "benchmarks").rglob("*.py"))
        if len(path.read_text(encoding="utf-8").splitlines()) > MAX_MODULE_LINES
    ]
    assert long == [], f"split these (at most {MAX_MODULE_LINES} lines a module)"
