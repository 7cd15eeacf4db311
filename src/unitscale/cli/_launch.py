"""Data-parallel processes for the command: ``--nproc N`` locally, or ranks started by torchrun.

``launch(target, nproc, *args)`` starts ``nproc`` local processes (``spawn``), joins them in
a gloo process group on a free local port, and runs ``target(*args)`` in each. When one
rank fails, the others are stopped (they would wait for it in a collective) and the
launch raises :class:`~unitscale.cli.CommandError` with that rank's error: the command exits
non-zero instead of hanging. Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set),
:func:`init_from_environment` joins the group torchrun describes instead.
"""

from __future__ import annotations

import gc
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["group_from_environment", "init_from_environment", "is_rank_zero", "launch"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(
    rank: int, nproc: int, port: int, errors: str, target: Callable[..., Any], args: Any
) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
    )
    dist.init_process_group("gloo", rank=rank, world_size=nproc)
    try:
        target(*args)
    except BaseException as exc:
        # Noted before this rank's connections close: the ranks waiting for it then fail
        # too ("connection reset"), later, and the launcher reports the first failure.
        line = str(exc).strip().splitlines()
        note = f"{time.time():.6f} {type(exc).__name__}: {line[0] if line else ''}"
        (Path(errors) / f"rank{rank}").write_text(note, encoding="utf-8")
        raise
    finally:
        _leave_group()


def _first_failure(errors: str) -> tuple[int, str] | None:
    """The rank that failed first and its error, from the notes of the failed ranks."""
    notes = []
    for path in Path(errors).glob("rank*"):
        stamp, _, message = path.read_text(encoding="utf-8").partition(" ")
        notes.append((float(stamp), int(path.name[4:]), message))
    if not notes:
        return None
    _, rank, message = min(notes)
    return rank, message


def launch(target: Callable[..., Any], nproc: int, *args: Any) -> None:
    """Run ``target(*args)`` in ``nproc`` local gloo ranks; raise if any rank fails.

    Raises:
        CommandError: a rank raised (its error, first line) or exited abnormally.
    """
    import torch.multiprocessing as mp

    from . import CommandError

    with tempfile.TemporaryDirectory(prefix="unitscale-ranks-") as errors:
        spawn_args = (nproc, _free_port(), errors, target, args)
        try:
            mp.spawn(_rank_main, args=spawn_args, nprocs=nproc, join=True)
        except mp.ProcessRaisedException as exc:
            first = _first_failure(errors)
            if first is None:
                message = str(exc).strip().splitlines()
                first = (exc.error_index, message[-1] if message else str(exc))
            raise CommandError(f"rank {first[0]} of {nproc} failed: {first[1]}") from None
        except mp.ProcessExitedException as exc:
            first = _first_failure(errors)
            if first is not None:
                raise CommandError(f"rank {first[0]} of {nproc} failed: {first[1]}") from None
            raise CommandError(
                f"rank {exc.error_index} of {nproc} exited with {exc.exit_code}"
            ) from None


def init_from_environment() -> bool:
    """Join the gloo process group that ``torchrun`` describes in the environment, once.

    Returns:
        True when this process is one of several ranks (torchrun's or :func:`launch`'s).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_world_size() > 1
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    dist.init_process_group("gloo")
    return dist.get_world_size() > 1


@contextmanager
def group_from_environment() -> Iterator[bool]:
    """:func:`init_from_environment` for the length of a block (its value as the block's),
    leaving the group it joined when the block ends, however it ends.

    A gloo group still alive when the interpreter exits can abort the process: a worker
    thread finishing the last collective needs the GIL to free its tensors, and a thread
    taking the GIL during finalisation exits through a C++ destructor ("terminate called
    without an active exception"). torchrun then fails the whole job and stops the ranks
    still writing (1 launch in 5 here). Destroying the group once nothing holds it (after a
    garbage collection) ends its threads first: 0 in 50. A group joined before (a
    :func:`launch` rank's) is left as it is."""
    import torch.distributed as dist

    joined_here = not dist.is_initialized()
    several = init_from_environment()
    try:
        yield several
    finally:
        if joined_here and dist.is_initialized():
            _leave_group()


def _leave_group() -> None:
    """Destroy the default group once whatever still holds it (a DDP model, a tracking pass)
    is collected, so that its threads end now rather than at exit (see
    :func:`group_from_environment`)."""
    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def is_rank_zero() -> bool:
    """Whether this process writes the outputs (rank 0, or the only process)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
