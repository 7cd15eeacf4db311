"""Sphinx configuration of the unitscale documentation (built offline: no intersphinx).

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (``.ci/run`` does, with
warnings as errors). ``nitpicky`` makes every unresolved cross-reference to a unitscale name a
warning; references to other libraries (torch, pandas, ...) are not checked, since they cannot
be resolved without fetching their inventories. ``_ext/check_public_api.py`` fails the build
when a name in a public package's ``__all__`` is missing from the API reference.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent / "src"))
os.environ.setdefault("UNITSCALE_STATS", "eager")

import unitscale  # noqa: E402

project = "unitscale"
author = "the unitscale authors"
copyright = "the unitscale authors"
release = unitscale.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "check_public_api",
]
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_theme_options = {"description": "Unit scaling for PyTorch", "page_width": "1100px"}
html_static_path: list[str] = []
# MathJax is loaded by the reader's browser; the build itself needs no network.

# autodoc: members in __all__ (imported ones included), in source order; hints in the text.
autodoc_default_options = {
    "members": True,
    "imported-members": True,
    "undoc-members": True,
    "member-order": "bysource",
    "show-inheritance": True,
}
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_class_signature = "separated"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True
napoleon_use_ivar = True  # an "Attributes:" section does not re-declare dataclass fields

# Broken cross-references to unitscale names fail the build; other libraries' names cannot be
# resolved offline (no intersphinx) and are not checked.
nitpicky = True
_EXTERNAL = (
    "torch",
    "nn",
    "fx",
    "Tensor",
    "np",
    "numpy",
    "pd",
    "pandas",
    "matplotlib",
    "Axes",
    "Figure",
    "transformers",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "PreTrainedModel",
    "argparse",
    "typing",
    "collections",
    "os",
    "pathlib",
    "Path",
    "enum",
    "dataclasses",
    "types",
    "abc",
    "weakref",
    "contextlib",
    "datetime",
    "logging",
    "io",
    "re",
    "numbers",
    "builtins",
    "_io",
    "optional",
    # short forms of torch's and argparse's names in annotations
    "Module",
    "Graph",
    "GraphModule",
    "Node",
    "Sequential",
    "ModuleList",
    "Parameter",
    "ArgumentParser",
    "Namespace",
    "iterable",
)
nitpick_ignore_regex = [
    # private names (``_Data``, ``unitscale.tracking.metrics._Data``) and module-level type
    # aliases used in annotations (``OnNonFinite``, ``Stage`` seen from another package)
    ("py:.*", r"(.*\.)?_[A-Za-z]\w*(\..*)?"),
    ("py:class", r"OnNonFinite|Stage|Rounding|SpecialValues|Constraint|FP8Recipe"),
    ("py:.*", rf"({'|'.join(_EXTERNAL)})(\..*)?"),
    # Python's own types, as annotations name them.
    (
        "py:.*",
        r"(None|int|float|bool|str|bytes|object|tuple|list|dict|set|frozenset|type|"
        r"callable|Callable|Any|Literal|Sequence|Mapping|Iterable|Iterator|Generator|"
        r"TypeAlias|TypeVar|Self|Union|Optional|PathLike|Ellipsis|slice|range|"
        r"Exception|ValueError|TypeError|RuntimeError|KeyError|ImportError|"
        r"RuntimeWarning|UserWarning|FloatingPointError|NotImplementedError)",
    ),
]
