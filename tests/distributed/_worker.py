"""One rank of the data-parallel checks, started by the tests in this folder (not a test).

Run as ``python _worker.py CHECKS OUT_DIR`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT`` set. Every rank builds the same models from the same seed, computes the
reference (one process on the concatenated batch, data-parallel size 1) itself, then runs the
wrapped model (DDP or FSDP2) on its shard of the batch, and writes what it measured to
``OUT_DIR/rank<R>.json`` for the test to assert on.
"""

from __future__ import annotations

import copy
import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import unitscale as us
from unitscale.data_parallel import fully_shard, set_data_parallel
from unitscale.models import GPTConfig, plain_gpt, unit_scaled_gpt
from unitscale.parameter import has_mup_tags
from unitscale.transforms import simulate_fp8, to_fp8, track_scales, unit_scale

CONFIG = GPTConfig(vocab_size=64, hidden_size=32, depth=1, heads=2, seq_len=16, aligned_labels=True)
GLOBAL_BATCH = 8


def _decoder() -> nn.Module:
    torch.manual_seed(0)
    return us.TransformerDecoder(hidden_size=32, depth=2, heads=2, vocab_size=64, mup=True)


def _unit_scaled_gpt() -> nn.Module:
    return unit_scale(plain_gpt(CONFIG, seed=0), trainable_norms=True)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "modules-decoder": _decoder,
    "modules-gpt": lambda: unit_scaled_gpt(CONFIG, seed=0),
    # norms kept trainable: every parameter's gradient is compared
    "unit_scale": lambda: _unit_scaled_gpt(),
    "simulate_fp8": lambda: simulate_fp8(_unit_scaled_gpt()),
    "track_scales": lambda: track_scales(_unit_scaled_gpt()),
    "to_fp8": lambda: to_fp8(_unit_scaled_gpt()),
}


def batch(size: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (size, CONFIG.seq_len + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def _strip(name: str) -> str:
    return name.removeprefix("module.")


def _relative_errors(
    ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]
) -> dict[str, float]:
    return {
        name: float((got[name] - value).norm() / value.norm().clamp_min(1e-30))
        for name, value in ref.items()
        if name in got
    }


def check_gradients(
    name: str, wrapper: str, local: int | None = None, model: nn.Module | None = None
) -> dict[str, Any]:
    """One process on the concatenated batch (the reference, data-parallel size 1) against
    ``wrapper`` on ``local`` rows per rank (default: ``GLOBAL_BATCH / world``); ``model``: one
    built beforehand (else ``MODELS[name]``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = GLOBAL_BATCH // world if local is None else local
    inputs, labels = batch(local * world)
    torch.manual_seed(0)  # unit_scale re-initialises weights from the global generator
    model = MODELS[name]() if model is None else model
    reference = copy.deepcopy(model)
    set_data_parallel(size=1)
    ref_loss = reference(inputs, labels=labels)
    ref_loss.backward()
    set_data_parallel()
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    keys_before = list(model.state_dict().keys())
    tags_before = {n: has_mup_tags(p) for n, p in model.named_parameters()}
    if wrapper == "fsdp":
        wrapped: nn.Module = fully_shard(model)
    else:
        wrapped = DistributedDataParallel(model)
        if wrapper == "ddp-uncorrected":  # the scales of one process: shows the check can fail
            set_data_parallel(size=1)
    if wrapper == "group-only":  # a process group, no DDP, gradients averaged by hand
        wrapped = model
    rows = slice(rank * local, (rank + 1) * local)
    loss = wrapped(inputs[rows], labels=labels[rows])
    loss.backward()
    set_data_parallel()
    if wrapper == "group-only":
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= world
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    grads = {
        _strip(n): _full(p.grad).detach()
        for n, p in wrapped.named_parameters()
        if p.grad is not None
    }
    errors = _relative_errors(ref_grads, grads)
    inner = wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped
    return {
        "loss_error": abs(float(mean_loss - ref_loss.detach()) / float(ref_loss.detach())),
        "max_grad_error": max(errors.values()),
        "min_grad_error": min(errors.values()),
        "worst": max(errors, key=errors.__getitem__),
        "grad_names": sorted(grads) == sorted(ref_grads),
        "missing": sorted(set(ref_grads) - set(grads)),
        "state_dict_keys": list(inner.state_dict().keys()) == keys_before,
        "names": [_strip(n) for n, _ in wrapped.named_parameters()] == list(tags_before),
        "tags": {_strip(n): has_mup_tags(p) for n, p in wrapped.named_parameters()} == tags_before,
        "any_tags": any(tags_before.values()),
    }


def check_compile() -> dict[str, Any]:
    """torch.compile(fullgraph=True) of a unit-scaled module inside DDP, against eager: the
    local gradient before DDP's average (read by a hook), and one process's."""
    torch.manual_seed(0)
    layer = us.Linear(16, 8)
    x = torch.randn(4, 16)
    single = copy.deepcopy(layer)
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True)
    local: dict[str, torch.Tensor] = {}
    for key, module in (("compiled", compiled), ("eager", layer)):
        module.weight.register_hook(lambda g, key=key: local.__setitem__(key, g.clone()))
        DistributedDataParallel(module)(x).sum().backward()
    single(x).sum().backward()
    compiled_grad, eager_grad = local["compiled"], local["eager"]
    return {
        "compiled_vs_eager": float((compiled_grad - eager_grad).norm() / eager_grad.norm()),
        "ratio_to_one_process": float(eager_grad.norm() / single.weight.grad.norm()),
    }


class CountCollectives:
    """Counts torch.distributed.all_reduce calls while installed (the reduction looks the
    function up at call time)."""

    def __init__(self) -> None:
        self.calls = 0
        self.original = dist.all_reduce

    def __enter__(self) -> CountCollectives:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self.original(*args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self.original


def _records(graph: Any) -> dict[tuple[str, str], dict[str, float]]:
    from unitscale.tracking.records import graph_records

    return {(r.name, r.direction): r.metrics for r in graph_records(graph)}


def _compare(
    ref: dict[tuple[str, str], dict[str, float]], got: dict[tuple[str, str], dict[str, float]]
) -> dict[str, Any]:
    worst, where, numel_equal, numel_diff = 0.0, "", True, []
    for key, metrics in ref.items():
        other = got.get(key)
        if other is None:
            return {
                "missing": list(key),
                "max_error": float("inf"),
                "numel_equal": False,
                "records": len(ref),
            }
        if other["numel"] != metrics["numel"]:
            numel_equal = False
            numel_diff.append([*key, metrics["numel"], other["numel"]])
        for metric, value in metrics.items():
            error = abs(other[metric] - value) / max(abs(value), 1e-12)
            if metric in ("abs_mean", "abs_min"):  # cancelling or tiny: relative to the rms
                error = abs(other[metric] - value) / max(metrics["rms"], 1e-12)
            if metric.startswith(("underflow", "overflow")):
                error = abs(other[metric] - value)
            if error > worst:
                worst, where = error, f"{key[0]}/{key[1]}/{metric}"
    return {
        "missing": [],
        "max_error": worst,
        "worst": where,
        "numel_equal": numel_equal,
        "numel_diff": numel_diff[:5],
        "records": len(ref),
        "extra": len(set(got) - set(ref)),
    }


def check_statistics(wrapper: str) -> dict[str, Any]:
    """scales_graph() of a tracked model under DDP/FSDP2 equals one process's (reference)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, labels = batch()
    torch.manual_seed(0)
    model = track_scales(unit_scale(plain_gpt(CONFIG, seed=0)))
    reference = copy.deepcopy(model)
    set_data_parallel(size=1)
    reference(inputs, labels=labels).backward()
    ref = _records(reference.scales_graph())
    set_data_parallel()
    wrapped = fully_shard(model) if wrapper == "fsdp" else DistributedDataParallel(model)
    local = GLOBAL_BATCH // world
    rows = slice(rank * local, (rank + 1) * local)
    wrapped(inputs[rows], labels=labels[rows]).backward()
    with CountCollectives() as counter:
        got = _records(model.scales_graph())
    result = _compare(ref, got)
    result["collectives"] = counter.calls
    result["local_numel_of_input"] = int(inputs[rows].numel())
    return result


def check_parameter_grad_statistics() -> dict[str, Any]:
    """Parameter-gradient statistics of a tracked model describe ``param.grad``, the same
    quantity in one process and under DDP, with or without accumulation: one call on the
    whole batch (one process), 4 accumulated micro-batches (one process), and 2 ranks each
    accumulating 2 micro-batches under DDP give the same statistics of every parameter's
    gradient."""
    from unitscale.data_parallel import gradient_accumulation

    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, labels = batch()
    torch.manual_seed(0)
    base = track_scales(unit_scale(plain_gpt(CONFIG, seed=0)))
    names = [n for n, _ in base.named_parameters()]

    def param_records(graph: Any) -> dict[tuple[str, str], dict[str, float]]:
        return {key: value for key, value in _records(graph).items() if key[0] in names}

    def accumulate(model: nn.Module, wrapped: nn.Module, row_blocks: list[slice]) -> None:
        with gradient_accumulation(len(row_blocks)):
            for rows in row_blocks:
                wrapped(inputs[rows], labels=labels[rows]).backward()

    set_data_parallel(size=1)
    whole = copy.deepcopy(base)
    whole(inputs, labels=labels).backward()
    ref = param_records(whole.scales_graph())
    micro = copy.deepcopy(base)
    accumulate(micro, micro, [slice(2 * i, 2 * i + 2) for i in range(4)])
    one_process = param_records(micro.scales_graph())
    set_data_parallel()
    ddp_model = copy.deepcopy(base)
    local = GLOBAL_BATCH // world
    blocks = [slice(rank * local + i * 2, rank * local + i * 2 + 2) for i in range(local // 2)]
    accumulate(ddp_model, DistributedDataParallel(ddp_model), blocks)
    distributed = param_records(ddp_model.scales_graph())
    one = _compare(ref, one_process)
    two = _compare(ref, distributed)
    return {
        "records": len(ref),
        "bwd_records": sum(direction == "bwd" for _, direction in ref),
        "one_process_error": one["max_error"],
        "one_process_worst": one.get("worst", ""),
        "ddp_error": two["max_error"],
        "ddp_worst": two.get("worst", ""),
        "missing": one["missing"] + two["missing"],
    }


def check_monitor() -> dict[str, Any]:
    """ScaleMonitor inside DDP: its table equals one process's; rank 0 alone writes the CSV."""
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, labels = batch()
    torch.manual_seed(0)
    base = unit_scale(plain_gpt(CONFIG, seed=0))
    ref_monitor = us.ScaleMonitor(copy.deepcopy(base), every=1)
    set_data_parallel(size=1)
    ref_monitor.module(inputs, labels=labels).backward()
    ref_monitor.step()
    set_data_parallel()
    monitor = us.ScaleMonitor(base, every=1)
    ddp = DistributedDataParallel(monitor.module)
    local = GLOBAL_BATCH // world
    rows = slice(rank * local, (rank + 1) * local)
    ddp(inputs[rows], labels=labels[rows]).backward()
    with CountCollectives() as counter:
        monitor.step()
    ref_table = ref_monitor.table().set_index(["tensor", "direction", "metric"])["value"]
    table = monitor.table().set_index(["tensor", "direction", "metric"])["value"]
    joined = ref_table.to_frame("ref").join(table.to_frame("got"), how="outer")
    scale = joined.xs("rms", level="metric")["ref"].abs().clip(lower=1e-12)
    by_tensor = scale.reindex(joined.index.droplevel("metric")).to_numpy()
    relative = (joined["got"] - joined["ref"]).abs() / joined["ref"].abs().clip(lower=1e-12)
    metric = joined.index.get_level_values("metric")
    against_rms = (joined["got"] - joined["ref"]).abs() / by_tensor
    fraction = metric.str.startswith(("underflow", "overflow"))
    error = relative.where(~metric.isin(["abs_mean", "abs_min"]), against_rms)
    error = error.where(~fraction, (joined["got"] - joined["ref"]).abs()).max()
    out = Path(sys.argv[2]) / f"monitor-rank{rank}.csv"
    monitor.to_csv(out)
    dist.barrier()
    return {
        "rows": len(joined),
        "nan_rows": int(joined.isna().any(axis=1).sum()),
        "max_error": float(error),
        "collectives": counter.calls,
        "csv_written": out.exists(),
    }


def check_fsdp_averages() -> dict[str, Any]:
    """Whether this torch's FSDP2 averages gradients over gloo for a plain ``nn.Linear``
    (torch 2.7.1 sums them: then no model, unit-scaled or not, matches one process)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layer = nn.Linear(4, 6)
    reference = copy.deepcopy(layer)
    x = torch.randn(8, 4)
    reference(x).mean().backward()
    fully_shard(layer)
    local = 8 // world
    layer(x[rank * local : (rank + 1) * local]).mean().backward()
    ratio = float(_full(layer.weight.grad).norm() / reference.weight.grad.norm())
    return {"averages": abs(ratio - 1) < 1e-5, "ratio": ratio, "torch": torch.__version__}


def check_fp8_scaling() -> dict[str, Any]:
    """simulate_fp8(scaling="tensorwise") under DDP: each rank scales by its local amax (as
    torchao's default, reduce_amax=False), so DDP equals the mean of per-rank runs and not one
    process on the whole batch (whose amax is the largest rank's)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    inputs = torch.randn(GLOBAL_BATCH, 16, generator=torch.Generator().manual_seed(1))
    local = GLOBAL_BATCH // world
    # The ranks' shards far apart in scale (inputs x1000 per rank, their output gradients
    # x1/1000, so that every rank contributes alike to the weight gradients): their amaxes
    # differ, forward and backward.
    weights = torch.ones(GLOBAL_BATCH, 1)
    for r in range(world):
        inputs[r * local : (r + 1) * local] *= 1000.0**r
        weights[r * local : (r + 1) * local] /= 1000.0**r
    rows = slice(rank * local, (rank + 1) * local)

    def grads(model: nn.Module, x: torch.Tensor, w: torch.Tensor, ranks: int) -> dict[str, Any]:
        ((model(x) * w).sum() / ranks).backward()  # DDP averages over the ranks
        return {_strip(n): p.grad.detach().clone() for n, p in model.named_parameters()}

    one_process = grads(simulate_fp8(mlp, scaling="tensorwise"), inputs, weights, world)
    per_rank = grads(simulate_fp8(mlp, scaling="tensorwise"), inputs[rows], weights[rows], 1)
    for grad in per_rank.values():
        dist.all_reduce(grad)
        grad /= world
    ddp_model = DistributedDataParallel(simulate_fp8(mlp, scaling="tensorwise"))
    ddp = grads(ddp_model, inputs[rows], weights[rows], 1)
    return {
        "ddp_vs_per_rank": max(_relative_errors(per_rank, ddp).values()),
        "ddp_vs_one_process": max(_relative_errors(one_process, ddp).values()),
    }


def check_mismatch() -> dict[str, Any]:
    """Ranks that read different numbers of tensors get a clear error, not a hang."""
    from unitscale.tracking._distributed import DistributedStatsError, reduce_stats
    from unitscale.tracking.metrics import tensor_stats

    count = 2 + dist.get_rank()
    rows = torch.stack([tensor_stats(torch.ones(3)) for _ in range(count)])
    try:
        reduce_stats(rows, [3] * count, [False] * count, None)
    except DistributedStatsError as error:
        return {"error": str(error)}
    return {"error": ""}


def run_check(check: str) -> dict[str, Any]:
    if check == "compile":
        return check_compile()
    if check == "fsdp-averages":
        return check_fsdp_averages()
    if check == "mismatch":
        return check_mismatch()
    if check == "fp8-scaling":
        return check_fp8_scaling()
    if check == "monitor":
        return check_monitor()
    if check == "parameter-grad-statistics":
        return check_parameter_grad_statistics()
    if check.startswith("statistics:"):
        return check_statistics(check.split(":")[1])
    if check.startswith("local"):  # local<B>:<model>: B rows per rank under DDP
        name = check.split(":")[1]
        return check_gradients(name, "ddp", local=int(check.split(":")[0][5:]))
    if check.startswith("before-init:"):  # built, run and compiled before init_process_group
        name = check.split(":")[1]
        return check_gradients(name, "ddp", model=BUILT_BEFORE_INIT[name])
    name, wrapper = check.rsplit(":", 1)
    return check_gradients(name, wrapper)


#: Models built (and run once, so captured or compiled) before ``init_process_group``.
BUILT_BEFORE_INIT: dict[str, nn.Module] = {}


def build_before_init(checks: list[str]) -> None:
    """The models of the ``before-init:`` checks, each run once with its scales of one process
    (a compiled one compiled then), before the process group exists."""
    for check in checks:
        if not check.startswith("before-init:"):
            continue
        name = check.split(":")[1]
        torch.manual_seed(0)
        if name == "compiled":
            # Dynamo's eager backend runs the unit-scaled ops when called; a compiling
            # backend bakes the size into the backward at its first call (see
            # unitscale.data_parallel and tests/test_data_parallel.py).
            model: nn.Module = torch.compile(
                unit_scaled_gpt(CONFIG, seed=0), fullgraph=True, backend="eager"
            )
        else:
            model = MODELS[name]()
        inputs, labels = batch(GLOBAL_BATCH // 2)  # the local shape of the 2-rank run
        model(inputs, labels=labels).backward()
        model.zero_grad(set_to_none=True)
        BUILT_BEFORE_INIT[name] = model


def main() -> None:
    checks, out = sys.argv[1].split(","), Path(sys.argv[2])
    torch.set_num_threads(1)
    build_before_init(checks)
    dist.init_process_group("gloo")
    results: dict[str, Any] = {}
    try:
        for check in checks:
            try:
                results[check] = run_check(check)
            except Exception as error:  # reported per check: the others still run
                results[check] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    finally:
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
        # As unitscale's launcher does: what holds the group let go of first, so that its
        # threads end now rather than abort the rank at exit (see cli._launch).
        BUILT_BEFORE_INIT.clear()
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
