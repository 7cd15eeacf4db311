"""The report writer every experiment shares: self-contained HTML pages, PNG, CSV and JSON.

An experiment builds its page from :func:`html_table`, :func:`html_figure` and
:func:`html_paragraphs` and writes it with :func:`write_html_page`; its tables go through
:func:`write_csv` (6 decimals, ``\\n`` line ends: byte-identical for identical numbers), its
figures through :func:`save_png` (no timestamp or software tag: byte-identical for identical
pictures) and its records through :func:`write_json`.

Design constraints: a page needs no network to view (figures are inline ``data:`` URIs, a
Content-Security-Policy forbids anything else); every value is HTML-escaped; nothing here
computes a result (collection is separate from presentation).
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = [
    "html_figure",
    "html_paragraphs",
    "html_table",
    "png_data_uri",
    "save_png",
    "settings_rows",
    "write_csv",
    "write_html_page",
    "write_json",
]

_STYLE = (
    "<style>body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;"
    "padding:0 1em;color:#222}table{border-collapse:collapse;margin:1em 0}"
    "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
    # Narrow windows (800 px): headers wrap, a table too wide scrolls inside itself.
    "th{white-space:normal}table{display:block;max-width:100%;overflow-x:auto}"
    "td:first-child,th:first-child,table.text td{text-align:left}"
    "img{max-width:100%;height:auto}"
    "figure{margin:1.5em 0}figcaption{color:#555;font-size:0.9em}"
    "pre{background:#f6f6f6;padding:0.8em;overflow-x:auto}</style>"
)


def png_data_uri(fig: Figure) -> str:
    """``fig`` as an inline PNG ``data:`` URI (100 dpi, no software tag)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def save_png(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Write ``fig`` to ``path`` as PNG (100 dpi, no software tag); return the path."""
    out = Path(path)
    fig.savefig(out, dpi=100, metadata={"Software": None})
    return out


def write_csv(frame: pd.DataFrame, path: str | os.PathLike[str]) -> Path:
    """Write ``frame`` without its index (6 decimals, ``\\n`` line ends); return the path."""
    out = Path(path)
    frame.to_csv(out, index=False, float_format="%.6f", lineterminator="\n")
    return out


def write_json(document: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``document`` as indented JSON with a final newline; return the path."""
    out = Path(path)
    out.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return out


def html_table(
    header: Sequence[str] | None, rows: Iterable[Sequence[str]], text: bool = False
) -> str:
    """An HTML table of escaped cells (``header``: the first row, as ``th``; None: none).
    Numbers align right, the first column left; ``text=True`` aligns every cell left (prose).

    Example:
        >>> html_table(["a"], [["<1>"]])
        '<table><tr><th>a</th></tr>\\n<tr><td>&lt;1&gt;</td></tr>\\n</table>'
    """
    lines = ['<table class="text">' if text else "<table>"]
    if header is not None:
        lines[0] += "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"
    lines += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows]
    lines.append("</table>")
    return "\n".join(lines)


def html_paragraphs(lines: Iterable[str]) -> list[str]:
    """One escaped ``<p>`` per non-blank line."""
    return [f"<p>{html.escape(line)}</p>" for line in lines if line.strip()]


def html_figure(caption: str, fig: Figure) -> str:
    """``fig`` inline, with ``caption`` under it (and as its alternative text)."""
    text = html.escape(caption)
    return (
        f'<figure><img alt="{text}" src="{png_data_uri(fig)}">'
        f"<figcaption>{text}</figcaption></figure>"
    )


def settings_rows(config: Any, shown: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """A configuration dataclass as ``(field, value)`` rows: sequences joined with ``, ``,
    ``shown`` replacing fields whose value needs words (a resolved default), None shown as
    ``default``."""
    assert is_dataclass(config), "settings_rows takes a dataclass instance"
    shown = shown or {}
    rows = []
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name in shown:
            text = shown[f.name]
        elif value is None:
            text = "default"
        elif isinstance(value, (tuple, list)):
            text = ", ".join(str(v) for v in value)
        else:
            text = str(value)
        rows.append((f.name, text))
    return rows


def write_html_page(
    path: str | os.PathLike[str], title: str, heading: str, body: Iterable[str]
) -> Path:
    """Write a self-contained HTML page: ``heading`` then the ``body`` parts (HTML, already
    escaped); return the path."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "img-src data:; style-src 'unsafe-inline'\">",
        f"<title>{html.escape(title)}</title>",
        _STYLE + "</head><body>",
        f"<h1>{html.escape(heading)}</h1>",
        *body,
        "</body></html>",
    ]
    out = Path(path)
    out.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return out
