"""A memory estimate made before any work: refuse a run that cannot fit, with the numbers.

A ``--seq-len`` of 100000 once trained for a minute and a half before the process died of
memory. The estimate below is made from the options alone (no torch import, so the refusal
is immediate) for the built-in decoders (:mod:`unitscale.models`, ``unitscale.
TransformerDecoder``): the activations one training step keeps for the backward pass, in
float32, attention's ``seq_len**2`` scores included. It is a lower bound (no optimiser
state, no allocator slack, no simulated-FP8 copies), so that a run it refuses cannot fit,
and a run it lets through may still need more.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from . import OptionError

__all__ = [
    "BUILTIN_GPT",
    "ActivationEstimate",
    "available_memory",
    "check_memory",
    "estimate_activations",
]

#: Bytes per element: the built-in models train in float32.
_BYTES = 4
#: Activations of width ``hidden_size`` one pre-norm block keeps for its backward pass:
#: norm output 1, q/k/v 3, attention output 1, its projection 1, the residual 1, norm 1,
#: the MLP's up-projection 4 and its activation 4, the down-projection 1.
_PER_TOKEN_WIDTHS = 17
#: Attention maps of ``seq_len**2`` per head a block keeps (the scores and the softmax
#: probabilities; the math attention of a CPU materialises both).
_ATTENTION_MAPS = 2
#: Byte-level vocabulary of the built-in models: the logits and their softmax.
_VOCAB = 256
#: Width, depth and heads of ``unitscale analyse``'s built-in GPT (``GPTConfig()``'s
#: defaults, repeated so that no torch is imported; ``tests/cli`` checks they are equal).
BUILTIN_GPT = (128, 2, 4)


def _gib(n_bytes: float) -> str:
    """``n_bytes`` in GiB or TiB, for messages (``"3.2 GiB"``)."""
    gib = n_bytes / 2**30
    return f"{gib / 1024:.1f} TiB" if gib >= 1024 else f"{gib:.1f} GiB"


@dataclass(frozen=True)
class ActivationEstimate:
    """What one training step of a built-in decoder keeps for its backward pass, in bytes.

    Attributes:
        total: every block's activations and attention maps, the logits, and one attention
            map's gradient (the backward's transient peak).
        attention_per_block: one block's attention maps (batch x heads x seq_len**2 each).
    """

    total: int
    attention_per_block: int


def estimate_activations(
    batch_size: int, seq_len: int, width: int, depth: int, heads: int
) -> ActivationEstimate:
    """A lower bound on the activation memory of one step of a built-in decoder.

    Example:
        >>> e = estimate_activations(16, 100_000, 128, 2, 4)
        >>> e.attention_per_block / 2**40 > 4  # 16 x 4 heads x 1e10 scores, twice, float32
        True
    """
    tokens = batch_size * seq_len
    attention_map = batch_size * heads * seq_len**2 * _BYTES
    attention = _ATTENTION_MAPS * attention_map
    per_block = tokens * width * _PER_TOKEN_WIDTHS * _BYTES + attention
    logits = 2 * tokens * _VOCAB * _BYTES
    return ActivationEstimate(depth * per_block + logits + attention_map, attention)


def _cgroup_room() -> int | None:
    """Bytes this process's cgroup (v2) may still allocate, or None without a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
    except OSError:
        return None
    if limit == "max":
        return None
    try:
        return max(int(limit) - int(used), 0)
    except ValueError:
        return None


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation: ``MemAvailable`` of /proc/meminfo
    (else free pages from ``os.sysconf``), capped by a cgroup limit; None if unknown."""
    available: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        available = None
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = None
    room = _cgroup_room()
    if room is not None:
        available = room if available is None else min(available, room)
    return available


def _largest_seq_len(batch_size: int, width: int, depth: int, heads: int, available: int) -> int:
    """The longest sequence whose estimate fits in ``available`` bytes (0 if none does)."""

    def fits(seq_len: int) -> bool:
        return estimate_activations(batch_size, seq_len, width, depth, heads).total <= available

    low, high = 0, 1
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def check_memory(
    command: str,
    batch_size: int,
    seq_len: int,
    width: int,
    depth: int,
    heads: int,
    available: int | None = None,
    share: float = 1.0,
) -> None:
    """Refuse a run of a built-in decoder whose activations cannot fit in memory.

    Args:
        command: the subcommand, for the message.
        batch_size, seq_len, width, depth, heads: the model and batch of the run.
        available: bytes available (default :func:`available_memory`; unknown: no check).
        share: the share of each batch this machine's processes train (a torchrun
            job over several machines: local processes / all processes).

    Raises:
        OptionError: the estimate exceeds the memory available; the message gives both and
            the longest ``--seq-len`` that fits at this ``--batch-size``.

    Example:
        >>> check_memory("train", 16, 64, 128, 2, 4, available=2**30)  # fits: no error
    """
    if available is None:
        available = available_memory()
    if available is None:
        return
    here = max(1, math.ceil(batch_size * share))
    estimate = estimate_activations(here, seq_len, width, depth, heads)
    if estimate.total <= available:
        return
    longest = _largest_seq_len(here, width, depth, heads, available)
    way_out = (
        f"choose --seq-len {longest} or less, or a smaller --batch-size"
        if longest
        else "choose a smaller --batch-size or --width"
    )
    shared = f" ({here} on this machine)" if here != batch_size else ""
    raise OptionError(
        f"--seq-len {seq_len} with --batch-size {batch_size}{shared} needs at least "
        f"{_gib(estimate.total)} of memory for one step's activations (attention's "
        f"seq_len^2 scores: {_gib(estimate.attention_per_block)} per block), but "
        f"{_gib(available)} is available; {way_out} (unitscale {command} stopped before any work)"
    )
