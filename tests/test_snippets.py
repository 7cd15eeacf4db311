"""Every Python snippet of README.md and docs/ runs as written.

Which blocks run, per page, in order, in one namespace per page, in a fresh temporary folder:

- reStructuredText (``docs/**/*.rst``): every ``.. code-block:: python`` (or ``python3``,
  ``pycon``) and every literal block introduced by ``::`` (Sphinx highlights those as Python
  unless the page sets ``.. highlight::`` to another language). Blocks in another language
  (``.. code-block:: bash``, ``.. code-block:: text``) do not run.
- Markdown (``README.md``): every fenced block opened with ````` ```python `````.
- A block written as an interactive session (``>>>`` prompts) runs as a doctest: its outputs
  must match.

A block that cannot run here (it needs several processes or a GPU) is marked, with its
reason, by a comment before it: ``.. skip-snippet: <reason>`` in reStructuredText,
``<!-- skip-snippet: <reason> -->`` in Markdown. The marker applies to the next block; a
marker without a reason fails the test.
"""

from __future__ import annotations

import doctest
import re
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.rst")])
PAGES = [page for page in PAGES if "_build" not in page.parts]
PYTHON = {"python", "python3", "py", "pycon"}


@dataclass(frozen=True)
class Snippet:
    """One code block of a page: where it starts (1-based line of its first line of code),
    its code, and the reason it does not run (None when it runs)."""

    line: int
    code: str
    skip: str | None


_RST_SKIP = re.compile(r"^\s*\.\. skip-snippet:(?P<reason>.*)$")
_MD_SKIP = re.compile(r"^\s*<!-- skip-snippet:(?P<reason>.*?)-->\s*$")
_DIRECTIVE = re.compile(r"^(?P<indent>\s*)\.\. (?:code-block|code|sourcecode)::\s*(?P<lang>\S*)")
_HIGHLIGHT = re.compile(r"^\s*\.\. highlight::\s*(?P<lang>\S+)")


class SnippetError(ValueError):
    """A page's snippet markup is wrong (a skip marker without a reason)."""


def _reason(match: re.Match[str], path: Path, number: int) -> str:
    reason = match["reason"].strip()
    if not reason:
        raise SnippetError(f"{path}:{number}: skip-snippet needs a reason after the colon")
    return reason


def _indented_block(lines: list[str], start: int, indent: int) -> tuple[int, str]:
    """The block of lines after ``start`` indented deeper than ``indent`` (blank lines and
    directive options skipped at its head): ``(line index of its first line, code)``."""
    index = start + 1
    while index < len(lines) and (
        not lines[index].strip() or re.match(r"^\s*:[\w-]+:", lines[index])
    ):
        index += 1
    first, body = index, []
    while index < len(lines):
        text = lines[index]
        if text.strip() and len(text) - len(text.lstrip()) <= indent:
            break
        body.append(text)
        index += 1
    return first, textwrap.dedent("\n".join(body)).strip("\n") + "\n"


def rst_snippets(text: str, path: Path = Path("<page>")) -> list[Snippet]:
    """The Python blocks of a reStructuredText page, in order."""
    lines = text.splitlines()
    snippets: list[Snippet] = []
    skip: str | None = None
    literal_is_python = True
    for number, line in enumerate(lines):
        if (match := _RST_SKIP.match(line)) is not None:
            skip = _reason(match, path, number + 1)
            continue
        if (match := _HIGHLIGHT.match(line)) is not None:
            literal_is_python = match["lang"] in PYTHON
            continue
        # A list item's text (and so its literal block) is indented past its marker.
        item = re.match(r"^\s*(?:\d+\.|#\.|[-*+])\s+", line)
        indent = len(item[0]) if item else len(line) - len(line.lstrip())
        if (match := _DIRECTIVE.match(line)) is not None:
            is_python = match["lang"] in PYTHON or (not match["lang"] and literal_is_python)
        elif line.rstrip().endswith("::") and not line.lstrip().startswith(".."):
            is_python = literal_is_python
        else:
            continue
        first, code = _indented_block(lines, number, indent)
        if is_python and code.strip():
            snippets.append(Snippet(first + 1, code, skip))
            skip = None
    return snippets


def markdown_snippets(text: str, path: Path = Path("<page>")) -> list[Snippet]:
    """The ```` ```python ```` blocks of a Markdown page, in order."""
    lines = text.splitlines()
    snippets: list[Snippet] = []
    skip: str | None = None
    index = 0
    while index < len(lines):
        line = lines[index]
        if (match := _MD_SKIP.match(line)) is not None:
            skip = _reason(match, path, index + 1)
        fence = re.match(r"^\s*(```+)\s*(\w*)", line)
        if fence is None:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence[1]):
            end += 1
        if fence[2] in PYTHON:
            snippets.append(Snippet(index + 2, "\n".join(lines[index + 1 : end]) + "\n", skip))
            skip = None
        index = end + 1
    return snippets


def snippets_of(page: Path) -> list[Snippet]:
    text = page.read_text(encoding="utf-8")
    if page.suffix == ".md":
        return markdown_snippets(text, page)
    return rst_snippets(text, page)


def run_snippet(snippet: Snippet, page: Path, namespace: dict[str, Any]) -> None:
    """Run one block in ``namespace``; tracebacks and doctest failures name the page line."""
    name = f"{page.relative_to(ROOT)}:{snippet.line}"
    if snippet.code.lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(
            snippet.code, namespace, name, str(page), snippet.line - 1
        )
        flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
        runner = doctest.DocTestRunner(optionflags=flags)
        runner.run(test, clear_globs=False)
        assert runner.failures == 0, f"{name}: the doctest's output differs (see above)"
        return
    code = "\n" * (snippet.line - 1) + snippet.code  # line numbers as on the page
    exec(compile(code, str(page), "exec"), namespace)


# -- the pages ------------------------------------------------------------------------------
RUNNABLE = [page for page in PAGES if any(s.skip is None for s in snippets_of(page))]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_snippets_run_in_order(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    if page.name == "fp8-real.rst":  # real FP8: float8 GEMMs on this CPU and torch
        from unitscale.transforms.lowp._gemm import float8_device_error

        if (reason := float8_device_error("cpu")) is not None:
            pytest.skip(f"real FP8 needs float8 GEMMs: {reason}")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(tmp_path)
    # A real module, as a user's script is: TorchDynamo imports the module of a class or
    # function a snippet defines (its __module__) when it guards on it.
    module = types.ModuleType(f"_snippet_{page.stem.replace('-', '_')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace: dict[str, Any] = module.__dict__
    for snippet in snippets_of(page):
        if snippet.skip is None:
            run_snippet(snippet, page, namespace)


def test_every_page_with_code_is_run() -> None:
    """The guide pages that show Python are all among the pages run (none silently dropped
    by a parse that finds no block)."""
    shown = {
        page
        for page in PAGES
        if re.search(r"(^(?!\s*\.\.).*::\s*$|```python)", page.read_text(encoding="utf-8"), re.M)
        and page.parent.name != "api"
    }
    assert shown <= set(RUNNABLE) | {p for p in PAGES if snippets_of(p)}
    assert ROOT / "README.md" in RUNNABLE


# -- the extraction itself --------------------------------------------------------------------
PAGE = """\
Title
=====

Some text::

    x = 1

.. code-block:: bash

    unitscale analyse

.. skip-snippet: needs two processes

.. code-block:: python
   :caption: launched with torchrun

   y = x + 1

1. A step in a list::

       z = x + 2

   More text.

.. highlight:: text

::

    not python
"""


def test_rst_blocks_in_order_with_lines_languages_and_skip_reasons() -> None:
    found = rst_snippets(PAGE)
    assert [(s.line, s.code, s.skip) for s in found] == [
        (6, "x = 1\n", None),
        (17, "y = x + 1\n", "needs two processes"),
        (21, "z = x + 2\n", None),
    ]


def test_markdown_blocks_and_skip_markers() -> None:
    text = "# T\n\n```bash\nls\n```\n\n<!-- skip-snippet: a GPU -->\n```python\na = 1\n```\n"
    text += "\n```python\nb = 2\n```\n"
    found = markdown_snippets(text)
    assert [(s.line, s.code, s.skip) for s in found] == [
        (9, "a = 1\n", "a GPU"),
        (13, "b = 2\n", None),
    ]


def test_a_skip_marker_needs_a_reason() -> None:
    with pytest.raises(SnippetError, match="needs a reason"):
        rst_snippets(".. skip-snippet:\n\n::\n\n    x = 1\n")


def test_a_failing_snippet_names_its_page_line(tmp_path: Path) -> None:
    page = ROOT / "docs" / "index.rst"
    with pytest.raises(ZeroDivisionError) as info:
        run_snippet(Snippet(7, "a = 1\nb = a / 0\n", None), page, {})
    frame = info.traceback[-1]
    assert (frame.path, frame.lineno + 1) == (page, 8)
    with pytest.raises(AssertionError, match=r"index\.rst:3"):
        run_snippet(Snippet(3, ">>> 1 + 1\n3\n", None), page, {})


def test_the_fp8_guide_compares_fp32_and_fp8_from_the_same_weights() -> None:
    """Each ``unit_scale`` call draws new weights: the guide's FP32-vs-FP8 example must
    unit-scale once and check the comparison it makes (the snippet itself runs above)."""
    first = snippets_of(ROOT / "docs" / "guide" / "fp8.rst")[0]
    assert first.skip is None
    assert first.code.count("unit_scale(") == 1, first.code  # one model, one draw of weights
    assert "simulate_fp8(scaled)" in first.code
    assert "assert abs(fp8_loss - fp32_loss)" in first.code
