"""How many torch threads a command runs on: fewer on a machine whose cores are busy.

torch starts one intra-op thread per core. On cores shared with other work every
multi-threaded op waits for all its threads, and a small model's step gets far slower
instead of faster: a plain GPT step took 1645 ms with 2 threads on 2 busy cores against
169 ms with 1 thread. Without ``--threads``, a command reads the 1-minute load average at
its start and uses as many threads as cores look free (at least one), and says so.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from ._args import positive_int

__all__ = ["add_threads_option", "free_cores", "pick_threads"]


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: torch's intra-op threads (default: one per free core)."""
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch intra-op threads per process (default: torch's, one per core, or fewer "
        "when the load average shows the cores busy: said on stderr); on a busy machine "
        "fewer threads are often much faster (1 is safest)",
    )


def free_cores(load: float | None = None, cores: int | None = None) -> int | None:
    """Cores not busy with other work: the core count less the 1-minute load average,
    rounded, at least 1; None where the load average cannot be read (not on Windows).

    Example:
        >>> free_cores(load=9.6, cores=2), free_cores(load=0.2, cores=2)
        (1, 2)
    """
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
    cores = cores or os.cpu_count() or 1
    return max(1, min(cores, math.floor(cores - load + 0.5)))


def pick_threads(requested: int | None, say: Callable[[str], None]) -> int:
    """Set and return torch's intra-op threads for a command.

    ``requested`` (``--threads``) is used as given. Without it, torch's default is kept on a
    quiet machine; when the load average shows fewer free cores than that, one thread per
    free core is used instead and ``say`` tells the user, naming ``--threads``.
    """
    import torch

    if requested is not None:
        torch.set_num_threads(requested)
        return requested
    default = torch.get_num_threads()
    free = free_cores()
    if free is None or free >= default:
        return default
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    torch.set_num_threads(free)
    say(
        f"the cores are busy (1-minute load average {load:.1f} on {cores} cores): "
        f"{free} torch thread(s) instead of {default}, which would wait for each other; "
        "--threads N chooses"
    )
    return free
