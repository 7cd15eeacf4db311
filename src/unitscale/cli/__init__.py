"""The ``unitscale`` command: a thin dispatcher over one module per subcommand.

Each subcommand lives in ``unitscale.cli.<name>`` and provides ``add_parser(subparsers)``
(which registers its options and ``set_defaults(run=run)``) and ``run(args) -> int``. To add
one, write the module and append its name to :data:`SUBCOMMANDS`. Subcommand modules import
heavy libraries inside ``run`` so that ``unitscale --help`` stays fast, and a command line is
parsed and checked before torch is imported: a typo fails at once. Parsers therefore
take their defaults from torch-free values (``train`` repeats ``TrainConfig``'s, checked
equal by the tests); what only ``--help`` shows and needs torch to know (the run names) is
filled in by ``Parser.load_help_defaults``.

Failures are one line on stderr and a non-zero exit status, never a traceback (set
``UNITSCALE_DEBUG=1`` to see one): bad options (and ``unitscale`` with no command, which
prints the usage) exit 2, whether argparse finds them or the subcommand does (an
:class:`OptionError`: a malformed ``--model``, a missing file, an
``--out`` that is a file, a text too short for ``--seq-len``); errors while working exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from .._version import __version__
from ..errors import UnitScaleError

__all__ = [
    "SUBCOMMANDS",
    "CommandError",
    "OptionError",
    "UsageError",
    "build_parser",
    "main",
    "usage_error",
]

#: Subcommand modules under ``unitscale.cli``, in the order ``--help`` lists them.
SUBCOMMANDS: tuple[str, ...] = ("analyse", "train", "transfer")


class CommandError(UnitScaleError):
    """A subcommand cannot do its work; the message is shown as one line."""


class OptionError(CommandError):
    """An option's value cannot work (the subcommand found it): exit status 2, as for any
    bad option, with the option named in the message."""


class UsageError(Exception):
    """Bad command-line options (raised instead of argparse's exit): exit status 2."""


def usage_error(command: str, message: str) -> UsageError:
    """A :class:`UsageError` of ``unitscale <command>``, worded as the parser's own, for
    options that are each valid but do not go together (raise it from ``run``).

    Example:
        >>> print(usage_error("train", "--steps 2 is too few"))
        unitscale train: error: --steps 2 is too few (see 'unitscale train --help')
    """
    prog = f"unitscale {command}"
    return UsageError(f"{prog}: error: {message} (see '{prog} --help')")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, raised rather than printed with usage.

    Attributes:
        load_help_defaults: called with the parser before its help is formatted, to fill in
            defaults whose values need a heavy import (None: nothing to load). Parsing a
            command line never calls it.
    """

    load_help_defaults: Callable[[Parser], None] | None = None

    def format_help(self) -> str:
        if self.load_help_defaults is not None:
            self.load_help_defaults(self)
        return super().format_help()

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message} (see '{self.prog} --help')")


def build_parser(only: str | None = None) -> Parser:
    """Build the ``unitscale`` parser with every subcommand in :data:`SUBCOMMANDS`.

    Args:
        only: build this subcommand's options only (the one being run); the others are
            listed by their ``HELP`` line, so that their modules' work is not prepared.
            None: all.
    """
    parser = Parser(
        prog="unitscale",
        description=(
            "Unit scaling for PyTorch: see the scale of every tensor of a model, forward and "
            "backward, and whether it fits FP8 and FP16."
        ),
    )
    parser.add_argument("--version", action="version", version=f"unitscale {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=Parser, title="commands"
    )
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        if only is None or name == only or not hasattr(module, "HELP"):
            module.add_parser(subparsers)
        else:
            subparsers.add_parser(name, help=module.HELP, add_help=False)
    return parser


def _subcommand(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` runs (aliases resolved by their module), or None."""
    first = next((a for a in argv if not a.startswith("-")), None)
    if first in SUBCOMMANDS:
        return first
    return "analyse" if first == "analyze" else None


#: A library message's leading function name (``load_corpus: ``, ``batches(split='train'): ``).
_WHERE = re.compile(r"^[A-Za-z_][\w.]*(\([^)]*\))?: ")
#: Library argument names in corpus errors, as the command's options.
_OPTIONS = {"seq_len=": "--seq-len ", "batch_size=": "--batch-size ", "seq_len": "--seq-len"}


def _in_command_terms(message: str) -> str:
    """A corpus error in the command's terms: no function name, options instead of arguments."""
    message = _WHERE.sub("", message)
    for argument, option in _OPTIONS.items():
        message = message.replace(argument, option)
    return message


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    if not isinstance(error, UnitScaleError):
        return f"{type(error).__name__}: {first}"
    if type(error).__name__ == "CorpusError":  # no import: the data layer loads torch
        return _in_command_terms(first)
    return first


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``unitscale`` command; return its exit status.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0 on success, 1 when the work failed, 2 for bad options or no command, 130 when
        interrupted.

    Example:
        >>> main(["analyse", "--seq-len", "0"])  # one line on stderr, no traceback
        2
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # Only the subcommand being run is built in full; with none, no subcommand's options are
    # (``unitscale --help`` then imports no torch).
    parser = build_parser(only=_subcommand(argv) or "")
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # name the subcommand whose options they are not
            prog = f"unitscale {args.command}" if args.command else "unitscale"
            raise UsageError(
                f"{prog}: error: unrecognized arguments: {' '.join(unknown)} (see '{prog} --help')"
            )
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.command is None:  # nothing to run: the usage, and a failed status for scripts
        parser.print_help(sys.stderr)
        print(
            "unitscale: error: no command given; choose one of the commands above", file=sys.stderr
        )
        return 2
    debug = os.environ.get("UNITSCALE_DEBUG", "") not in ("", "0")
    try:
        return int(args.run(args) or 0)
    except UsageError as exc:  # options that do not go together, found before any work
        print(exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"unitscale {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            raise
        print(f"unitscale {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        # A corpus error is about --text, --seq-len or --batch-size (no import: see _one_line).
        usage = isinstance(exc, OptionError) or type(exc).__name__ == "CorpusError"
        return 2 if usage else 1
