"""Output helpers shared by the subcommands: progress lines, file names, the start and the end
of an experiment command (checks before work; the summary printed and written last)."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "Progress",
    "add_out_options",
    "check_out_folder",
    "finish_summary",
    "prepare_out_folder",
    "refuse_earlier_outputs",
    "require_analysis_extra",
    "slug",
    "start_command",
]


class Progress:
    """Stage lines on stderr with the time elapsed since the command started."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f}s] {message}", file=sys.stderr, flush=True)


def slug(name: str, default: str) -> str:
    """``name`` as a file-name part (``"gpt2 (HF)"`` -> ``"gpt2_HF"``), ``default`` if empty."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or default


def require_analysis_extra(command: str) -> None:
    """Check that the plotting and table libraries a subcommand writes its outputs with are
    installed, before any work starts.

    Raises:
        CommandError: matplotlib or pandas is missing; the message names the extra to install.
    """
    try:
        import matplotlib  # noqa: F401
        import pandas  # noqa: F401
    except ModuleNotFoundError as exc:
        from . import CommandError

        raise CommandError(
            f"unitscale {command} needs {exc.name}: pip install 'unitscale[analysis]'"
        ) from exc


def check_out_folder(text: str, option: str = "--out") -> Path:
    """The output folder ``text``, checked before any work starts.

    A folder that does not exist yet is created and removed again (with any parents this
    created), so that a path the command cannot create fails now, not after the work.

    Raises:
        OptionError: when the folder exists as a file, is not writable, or cannot be created.

    Example:
        >>> check_out_folder("report").name
        'report'
    """
    from . import OptionError as CommandError  # a bad --out: exit status 2

    out = Path(text)
    if out.exists():
        if not out.is_dir():
            raise CommandError(f"{option} {text!r} exists and is not a folder; choose another")
        if not os.access(out, os.W_OK | os.X_OK):
            raise CommandError(f"{option} {text!r}: the folder is not writable; choose another")
        return out
    missing = [out, *(p for p in out.absolute().parents if not p.exists())]
    try:
        out.mkdir(parents=True)
    except FileExistsError:
        if out.is_dir():  # created meanwhile (another rank of a torchrun job): usable
            return out
        raise CommandError(
            f"{option} {text!r} exists and is not a folder; choose another"
        ) from None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise CommandError(
            f"{option} {text!r} cannot be created: {reason}; choose another"
        ) from exc
    for folder in missing:  # deepest first: remove only what this check created
        try:
            folder.rmdir()
        except OSError:  # written into meanwhile (another rank): it stays
            break
    return out


def refuse_earlier_outputs(
    out: Path, patterns: tuple[str, ...], overwrite: bool, option: str = "--out"
) -> None:
    """Refuse to write into a folder that holds an earlier run's outputs, unless told to.

    Args:
        out: the output folder (checked by :func:`check_out_folder`).
        patterns: the names (``glob`` patterns) of the files the command writes.
        overwrite: the user asked to replace them (``--overwrite``).

    Raises:
        OptionError: ``out`` holds a file of ``patterns`` and ``overwrite`` is False; the
            message names the files and the two ways out.
    """
    if overwrite or not out.is_dir():
        return
    found = sorted({p.name for pattern in patterns for p in out.glob(pattern) if p.is_file()})
    if found:
        from . import OptionError

        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise OptionError(
            f"{option} {str(out)!r} holds the outputs of an earlier run ({shown}); give "
            "--overwrite to replace them, or choose another folder"
        )


def add_out_options(parser: Any, default: str) -> None:
    """``--out`` and ``--overwrite``: where a command writes, the same rule for every command
    (a folder that holds an earlier run's outputs is refused unless ``--overwrite`` is given,
    see :func:`prepare_out_folder`)."""
    parser.add_argument(
        "--out", default=default, metavar="DIR", help=f"output folder (default {default})"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the outputs of an earlier run in --out (without it, a folder that "
        "holds them is refused)",
    )


def prepare_out_folder(args: Any, outputs: tuple[str, ...]) -> Path:
    """The checked output folder of a command run with ``args`` (``--out``,
    ``--overwrite``), before any work starts: :func:`check_out_folder`, then
    :func:`refuse_earlier_outputs` for the files the command writes (``outputs``)."""
    out = check_out_folder(args.out)
    refuse_earlier_outputs(out, outputs, bool(getattr(args, "overwrite", False)))
    return out


def start_command(command: str) -> Progress:
    """What every experiment subcommand does first: start the clock of its stage lines and
    check that the libraries it writes its outputs with are installed.

    Raises:
        CommandError: matplotlib or pandas is missing (see :func:`require_analysis_extra`).
    """
    progress = Progress()
    require_analysis_extra(command)
    return progress


def finish_summary(
    text: str, out: Path, written: list[Path], progress: Callable[[str], None]
) -> int:
    """What every experiment subcommand does last: add the list of outputs to the summary
    ``text``, write it to ``out/summary.txt``, print it on stdout and say ``done``.

    Returns:
        0, the exit status.
    """
    summary = out / "summary.txt"
    names = [p.name for p in [*written, summary]]
    text += f"\nwrote {len(names)} outputs to {out}/: " + ", ".join(names) + "\n"
    summary.write_text(text, encoding="utf-8")
    sys.stdout.write(text)
    progress("done")
    return 0
