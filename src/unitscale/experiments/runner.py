"""The experiment runner every experiment shares: data, evaluation, schedule and training loop.

``unitscale train`` (:mod:`unitscale.training`), ``unitscale transfer``
(``unitscale.experiments.transfer``) and any experiment that comes next train their runs
with the pieces here, so that what they have in common is defined once:

- :func:`training_batches`: the training stream of a seed (the bundled text's training split);
- :func:`evaluation_batches`: the fixed evaluation samples of a seed, drawn from their own
  streams (seed offsets :data:`EVAL_SEED_OFFSETS`), so that the training order is the same
  whether or not (and however often) a run evaluates, and every experiment that evaluates
  at the same batch size, sequence length and seed sees the *same* samples by construction;
- :class:`Schedule`: linear warm-up, then cosine decay to 10% of the peak;
- :func:`train_loop`: the loop (schedule, one loss read per step, stop on a non-finite
  loss, evaluation every ``eval_every`` steps and at the end, data parallelism under
  ``torch.distributed``) with hooks for what an experiment adds (a scale monitor, progress);
- :func:`evaluate`: the mean loss of a model over fixed batches.

An experiment is then its own short module: its run kinds (how each builds its model and
optimiser), its claims and its tables; :mod:`unitscale.experiments.report` writes its files.

Design constraints: nothing here builds a model, parses options or prints; the global RNG
is never touched (batches come from seeded generators); under ``torch.distributed`` with
more than one rank every rank reads the same global batches and trains on its block of rows.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from ..data import Batch, batches
from ..errors import UnitScaleError

__all__ = [  # noqa: RUF022 (grouped by kind)
    # data
    "EVAL_SEED_OFFSETS",
    "training_batches",
    "evaluation_batches",
    # schedule and checks
    "Schedule",
    "check_positive_int",
    "check_warmup",
    # the loop
    "LoopResult",
    "loss_of",
    "evaluate",
    "data_parallel",
    "train_loop",
]

#: Added to an experiment's seed to seed its fixed evaluation samples, per split. Every
#: experiment takes them from here: "the same samples as ``unitscale train``" holds by
#: construction.
EVAL_SEED_OFFSETS: dict[str, int] = {"train": 1_000_003, "heldout": 2_000_003}


def training_batches(batch_size: int, seq_len: int, seed: int) -> Iterable[Batch]:
    """The endless training stream of ``seed``: random windows of the training split."""
    return batches(batch_size, seq_len, seed=seed, split="train")


def evaluation_batches(
    batch_size: int, seq_len: int, seed: int, split: Literal["train", "heldout"], count: int
) -> list[Batch]:
    """The ``count`` fixed evaluation batches of ``split`` for an experiment seeded ``seed``.

    Example:
        >>> a = evaluation_batches(2, 8, 0, "heldout", 1)[0]
        >>> b = evaluation_batches(2, 8, 0, "heldout", 3)[0]
        >>> a.input_ids.shape, bool((a.input_ids == b.input_ids).all())
        (torch.Size([2, 8]), True)
    """
    stream = batches(batch_size, seq_len, seed=seed + EVAL_SEED_OFFSETS[split], split=split)
    return [next(stream) for _ in range(count)]


def check_positive_int(owner: str, name: str, value: Any, error: type[Exception]) -> None:
    """Raise ``error`` naming ``owner`` and ``name`` unless ``value`` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{owner}: {name}={value!r} must be a positive integer")


def check_warmup(owner: str, value: Any, error: type[Exception]) -> None:
    """Raise ``error`` unless ``value`` (``warmup_steps``) is None or an int >= 0."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise error(f"{owner}: warmup_steps={value!r} must be a non-negative integer or None")


@dataclass(frozen=True)
class Schedule:
    """Linear warm-up over ``warmup`` steps (None: 5% of ``steps``), then cosine decay to 10%.

    Example:
        >>> s = Schedule(steps=100, warmup=10)
        >>> [round(s.lr(1.0, step), 3) for step in (0, 9, 10, 99)]
        [0.1, 1.0, 1.0, 0.1]
        >>> Schedule(steps=100).warmup_steps
        5
    """

    steps: int
    warmup: int | None = None

    @property
    def warmup_steps(self) -> int:
        """The warm-up steps (``warmup``, or 5% of ``steps`` when it is None)."""
        return self.steps // 20 if self.warmup is None else self.warmup

    def lr(self, peak: float, step: int) -> float:
        """The learning rate at ``step`` of a run whose peak is ``peak``."""
        warmup = self.warmup_steps
        if step < warmup:
            return peak * (step + 1) / warmup
        span = max(self.steps - 1 - warmup, 1)
        progress = min((step - warmup) / span, 1.0)
        return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def loss_of(model: Callable[..., Tensor], batch: Batch) -> Tensor:
    """``model(input_ids, labels=targets)``: every experiment's model takes next-token
    targets aligned with ``input_ids`` (``Batch.targets``) and returns its mean loss."""
    return model(batch.input_ids, labels=batch.targets)


def evaluate(model: Callable[..., Tensor], data: Sequence[Batch], grad: bool = True) -> float:
    """The mean loss of ``model`` over ``data`` (no optimiser step).

    Evaluated in the mode the model trains in (dropout is 0, so the numbers are those of
    eval mode) and, by default, with autograd on: TorchDynamo guards on both, and a second
    capture (or an Inductor recompile of the FP8 runs) for evaluation would cost more than
    it saves. ``grad=False`` evaluates under ``torch.no_grad()`` (for uncompiled models).
    """
    with torch.set_grad_enabled(grad):
        total = 0.0
        for batch in data:
            total += float(loss_of(model, batch).detach())
        return total / len(data)


def data_parallel() -> tuple[int, int]:
    """``(rank, world size)`` of ``torch.distributed`` when it is initialised, else ``(0, 1)``."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank(), distributed.get_world_size()
    return 0, 1


def _shard(batch: Batch, rank: int, world: int) -> Batch:
    """This rank's rows of the global ``batch`` (a contiguous block)."""
    if world == 1:
        return batch
    rows = batch.input_ids.shape[0] // world
    part = slice(rank * rows, (rank + 1) * rows)
    return replace(
        batch,
        input_ids=batch.input_ids[part],
        attention_mask=batch.attention_mask[part],
        labels=batch.labels[part],
        targets=batch.targets[part],
    )


def _sum_gradients(state: object, bucket: Any) -> torch.futures.Future[Tensor]:
    """A DDP communication hook: the gradients' *sum* over the ranks (DDP's default averages)."""
    work = torch.distributed.all_reduce(bucket.buffer(), async_op=True)
    assert work is not None  # async_op=True always returns the work
    return work.get_future().then(lambda fut: fut.value()[0])


def _data_parallel_module(module: Callable[..., Tensor], unit_scaled_loss: bool) -> nn.Module:
    """``module`` in ``DistributedDataParallel``, reducing as its loss needs (see
    :func:`train_loop`)."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel(cast("nn.Module", module))
    if not unit_scaled_loss:
        # DDP compares the hook's annotations with its own types, and this module's are
        # strings (PEP 563): it accepts none.
        _sum_gradients.__annotations__.clear()
        wrapped.register_comm_hook(None, _sum_gradients)
    return wrapped


def _mean_over_ranks(loss: Tensor, world: int) -> float:
    """The global batch's loss: the mean of the ranks' (equal) shard losses."""
    if world == 1:
        return float(loss.detach())
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return float(total) / world


@dataclass
class LoopResult:
    """What :func:`train_loop` measured.

    Attributes:
        losses: the training loss of every step done (the global batch's mean); the last is
            the non-finite one when the run stopped.
        heldout: ``{steps done: held-out loss}`` at each evaluation, the last at the end.
        final_train_loss: mean loss over the fixed training batches at the end (NaN after
            a stop).
        stopped_at: the step whose loss was not finite (training stopped there), or None.
        data_digest: SHA-256 (first 16 hex digits) of the token ids of every global batch
            trained on.
        skipped_steps: with a ``grad_scaler``, the steps it skipped (their gradients were
            not finite, so it lowered its scale); 0 without.
    """

    losses: list[float] = field(default_factory=list)
    heldout: dict[int, float] = field(default_factory=dict)
    final_train_loss: float = math.nan
    stopped_at: int | None = None
    data_digest: str = ""
    skipped_steps: int = 0


@contextmanager
def _data_parallel_size(world: int) -> Iterator[None]:
    """``set_data_parallel(size=world)`` while training data-parallel (restored after)."""
    if world == 1:
        yield
        return
    from ..data_parallel import set_data_parallel

    set_data_parallel(size=world)
    try:
        yield
    finally:
        set_data_parallel()


def train_loop(
    model: nn.Module,
    optimiser: torch.optim.Optimizer,
    data: Iterable[Batch],
    schedule: Schedule,
    *,
    eval_every: int,
    heldout: Sequence[Batch],
    train_eval: Sequence[Batch],
    step_module: Callable[..., Tensor] | None = None,
    unit_scaled_loss: bool = False,
    eval_grad: bool = True,
    after_backward: Callable[[], object] | None = None,
    on_step: Callable[[float], None] | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> LoopResult:
    """Train ``model`` for ``schedule.steps`` steps, one batch of ``data`` per step.

    Each step sets every parameter group's learning rate to ``schedule.lr(its peak, step)``
    (the peak is the group's rate when the loop starts, so per-parameter rules such as
    u-μP's keep their ratios), runs forward and backward on this rank's rows, reads the loss
    once, and steps the optimiser. A non-finite loss stops the run before its optimiser step.
    The held-out loss is measured after every ``eval_every`` steps and at the end, and the
    final training loss at the end (both with ``model``, on every rank the whole batches).

    When ``torch.distributed`` is initialised with N > 1 ranks, each rank trains
    ``DistributedDataParallel(step_module)`` on its block of ``batch_size / N`` rows of the
    same global batch, and the recorded loss is the global batch's mean (one ``all_reduce``
    per step). Every gradient a rank computes per example, and so every gradient an FP8
    simulation rounds, equals one process's on the global batch:

    - a plain mean loss (``unit_scaled_loss=False``) gives each example the gradient
      ``1 / rows``, N times one process's ``1 / (N rows)`` (like a loss scale of N, which
      moves what underflows in FP8). So each rank back-propagates its loss divided by N
      (each example's gradient is ``1 / global rows``) and the ranks' parameter gradients
      are *summed*, not averaged;
    - a unit-scaled loss (``unit_scaled_loss=True``, :func:`unitscale.functional.cross_entropy`)
      gives each example a unit gradient whatever the rows, and unit-scaled ops correct
      the gradients of shared tensors for an *average* over the ranks
      (:mod:`unitscale.data_parallel`): the loss is back-propagated as it is, the gradients
      averaged (DDP's default), with ``set_data_parallel(size=N)`` for the run.

    Args:
        model: the model (evaluated as it is).
        optimiser: its optimiser, at the peak learning rates.
        data: the global training batches (at least ``schedule.steps``).
        schedule: the steps and the learning-rate schedule.
        eval_every: held-out loss every this many steps.
        heldout: the held-out evaluation batches.
        train_eval: the training evaluation batches (final training loss).
        step_module: what the training step calls (default ``model``).
        unit_scaled_loss: whether the loss is unit-scaled (see above; only data-parallel
            runs depend on it).
        eval_grad: evaluate with autograd on (see :func:`evaluate`).
        after_backward: called after each backward (e.g. a scale monitor's ``step``).
        on_step: called with each finite loss after its optimiser step (progress).
        grad_scaler: dynamic loss scaling: the loss is multiplied by its scale before the
            backward, and the step goes through ``grad_scaler.step`` (which unscales the
            gradients and skips the step where one is not finite) and ``update``. A step
            counts as skipped when the scale went down (``GradScaler`` backs off exactly
            then). Under data parallelism every rank sees the same reduced gradients, so
            every rank skips the same steps.

    Returns:
        The :class:`LoopResult`.

    Raises:
        UnitScaleError: ``data`` ran out before ``schedule.steps`` steps.
    """
    rank, world = data_parallel()
    trained: Callable[..., Tensor] = model if step_module is None else step_module
    loss_factor = 1.0
    if world > 1:
        trained = _data_parallel_module(trained, unit_scaled_loss)
        loss_factor = 1.0 if unit_scaled_loss else 1.0 / world
    with _data_parallel_size(world):
        peaks = [group["lr"] for group in optimiser.param_groups]
        digest = hashlib.sha256()
        stream = iter(data)
        result = LoopResult()
        for step in range(schedule.steps):
            if step % eval_every == 0 and step > 0:
                result.heldout[step] = evaluate(model, heldout, eval_grad)
            for group, peak in zip(optimiser.param_groups, peaks, strict=True):
                group["lr"] = schedule.lr(peak, step)
            batch = next(stream, None)
            if batch is None:
                raise UnitScaleError(
                    f"train_loop: the data ran out after {step} of {schedule.steps} steps; pass "
                    "one batch per step"
                )
            digest.update(batch.input_ids.cpu().numpy().tobytes())
            loss = loss_of(trained, _shard(batch, rank, world))
            backward = loss if loss_factor == 1.0 else loss * loss_factor
            if grad_scaler is not None:
                backward = grad_scaler.scale(backward)
            backward.backward()
            if after_backward is not None:
                after_backward()
            value = _mean_over_ranks(loss, world)
            result.losses.append(value)
            if not math.isfinite(value):
                result.stopped_at = step
                break
            if grad_scaler is None:
                optimiser.step()
            else:
                scale = grad_scaler.get_scale()
                grad_scaler.step(optimiser)
                grad_scaler.update()
                result.skipped_steps += grad_scaler.get_scale() < scale
            optimiser.zero_grad(set_to_none=True)
            if on_step is not None:
                on_step(value)
        if result.stopped_at is None:
            result.heldout[schedule.steps] = evaluate(model, heldout, eval_grad)
            result.final_train_loss = evaluate(model, train_eval, eval_grad)
        result.data_digest = digest.hexdigest()[:16]
        return result
