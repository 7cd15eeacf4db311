"""The two implementations of the scale statistics (the native CPU kernel, and the PyTorch
kernel of accelerators and of CPUs without the native build) against float64 arithmetic and
against each other on the same tensors: same statistics, whichever path runs."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import unitscale
from unitscale import _native as native_build
from unitscale.tracking import _native, metrics
from unitscale.tracking._native import native_stats
from unitscale.tracking.metrics import _OVERFLOW_ABOVE, _UNDERFLOW_BELOW, _stats_kernel

UNDER, OVER = _UNDERFLOW_BELOW, _OVERFLOW_ABOVE
# Sizes of the cases below (several of these are still one piece of the native kernel's).
PIECE = 1 << 14
needs_native = pytest.mark.skipif(
    not _native.native.available(), reason="the native extension was not built at install"
)


def truth(x: torch.Tensor) -> list[float]:
    """The statistics in float64 arithmetic, in the kernels' layout."""
    d = x.detach().double().reshape(-1)
    a = d.abs()
    finite = bool(torch.isfinite(d).all())
    head = [a.sum().item(), d.mean().item(), d.var(correction=0).item()]
    if finite:
        head += [a.max().item(), a.min().item()]
    else:
        head += [math.nan, math.nan] if bool(torch.isnan(d).any()) else [math.inf, a.min().item()]
    head += [float(torch.isnan(d).sum()), float(torch.isinf(d).sum())]
    # Counts by comparison with the thresholds as the tensor's dtype rounds them (as torch
    # compares a tensor with a Python number).
    x32 = x.detach().float().reshape(-1).abs()
    under = [float(((x32 <= b) & (x32 > 0)).sum()) for b in UNDER]
    over = [float((x32 > b).sum()) for b in OVER]
    return head + under + over


def assert_agrees(got: list[float], want: list[float], rel: float = 1e-6) -> None:
    """Sums to ``rel`` (the variance also to ``rel`` of the second moment), extremes and
    counts exactly; NaN where the reference is NaN."""
    assert len(got) == len(want)
    mean_sq = want[2] + want[1] ** 2
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        if math.isnan(w):
            assert math.isnan(g), (k, got, want)
        elif math.isinf(w):
            assert g == w, (k, got, want)
        elif k == 2 and math.isfinite(w):
            assert abs(g - w) <= rel * max(abs(w), 1e-12 * mean_sq) + 1e-300, (k, got, want)
        elif k in (0, 1):
            scale = abs(w) if k == 0 else math.sqrt(max(mean_sq, 0.0))
            assert abs(g - w) <= rel * scale + 1e-300, (k, got, want)
        else:
            assert g == w, (k, got, want)


def cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    ties = torch.tensor([2.0**-10, 2.0**-10 * (1 + 2**-23), 448.0, 448.0 * (1 + 2**-23)])
    return {
        "vector": randn(1000),
        "one element": torch.tensor([-2.5]),
        "0-d": torch.tensor(3.0),
        "several pieces": randn(3 * PIECE + 17) * 0.01,
        "transposed": randn(700, 300).t(),
        "strided slice": randn(64, 2 * PIECE)[:, ::3],
        "float16": (randn(100_000) * 1e-3).half(),
        "float16 transposed": randn(300, 200).half().t(),
        "bfloat16": randn(200_000).bfloat16(),
        "bfloat16 transposed": randn(300, 200).bfloat16().t(),
        "relu (zeros)": randn(200_000).relu(),
        "all zeros": torch.zeros(5000),
        "ones": torch.ones(5000),
        "huge": randn(100_000) * 1e37,
        "tiny": randn(100_000) * 1e-30,
        "mean far above spread": randn(100_000) * 1e-3 + 1000.0,
        "outlier first": torch.cat([torch.tensor([1e6]), randn(5000) * 1e-3 + 5.0]),
        # The native kernel sums about the first element: here (x - x[0])**2 ~ 1e6 where the
        # variance is 0.24, and only its second, centred pass keeps 1e-9.
        "outlier first, 4M elements": torch.cat([torch.tensor([1e3]), randn(1 << 22) * 1e-3]),
        "subnormals and ties": torch.cat(
            [ties.repeat(1000), torch.tensor([2.0**-134, 2.0**-140, 2.0**-149])]
        ),
        "beyond every format": torch.cat([randn(1000), torch.tensor([1e5, -7e4, 3e38])]),
        "1M elements": randn(1 << 20) * 0.05,
    }


CASES = cases()


@pytest.mark.parametrize("name", list(CASES))
def test_pytorch_kernel_matches_float64(name: str) -> None:
    x = CASES[name]
    assert_agrees(_stats_kernel(x).tolist(), truth(x))


@needs_native
@pytest.mark.parametrize("name", list(CASES))
def test_native_kernel_matches_float64(name: str) -> None:
    x = CASES[name]
    got = native_stats(x, UNDER, OVER)
    assert got is not None
    assert_agrees(got, truth(x), rel=1e-9)


@pytest.mark.parametrize(
    "x",
    [
        torch.tensor([1.0, float("nan"), 2.0]),
        torch.tensor([1.0, float("inf"), -3.0]),
        torch.tensor([float("-inf"), float("inf")]),
        torch.cat([torch.randn(3 * PIECE), torch.tensor([float("nan")])]),
        torch.cat([torch.randn(2 * PIECE), torch.tensor([float("inf")])]),
    ],
    ids=["nan", "inf", "both infs", "nan in one piece", "inf in one piece"],
)
def test_nan_and_inf_follow_ieee(x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    """IEEE semantics: NaN where float64 arithmetic has NaN; the native kernel hands such
    tensors to the PyTorch kernel, so tracking's values are its values."""
    want = _stats_kernel(x).tolist()
    assert_agrees(want, truth(x))
    assert native_stats(x, UNDER, OVER) is None
    monkeypatch.setenv("UNITSCALE_STATS", "auto")
    assert_agrees(metrics.tensor_stats(x).tolist(), want)


@needs_native
@pytest.mark.parametrize(
    "x",
    [
        torch.randn(2, 16, 4, 8).transpose(1, 2),  # attention's heads
        torch.randn(3, 5, 7).permute(2, 0, 1) * 1e3 + 5,
        torch.randn(1, 64, 1, 32).transpose(1, 3),
        torch.randn(64, 32).t().to(torch.bfloat16),
    ],
    ids=["transpose", "permute", "size-1 dims", "bfloat16"],
)
def test_native_kernel_reads_a_permuted_dense_tensor_in_place(
    x: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transpose of a contiguous tensor is read in memory order, without a copy or
    pieces, with the statistics of its contiguous copy."""
    assert not x.is_contiguous()
    want = native_stats(x.contiguous(), UNDER, OVER)

    def no_pieces(_: torch.Tensor) -> list[torch.Tensor]:
        raise AssertionError("a dense tensor was split into pieces")

    monkeypatch.setattr(_native, "_pieces", no_pieces)
    got = native_stats(x, UNDER, OVER)
    assert got is not None and want is not None
    assert got[3:] == want[3:]  # extremes and counts exactly
    assert_agrees(got, want, rel=1e-12)
    assert_agrees(got, truth(x), rel=1e-9)


@needs_native
@pytest.mark.parametrize(
    "x",
    [
        torch.randn(8, 8)[:, :4],
        torch.randn(4, 1).expand(4, 3),
        torch.randn(8, 6)[::2],
        (torch.randn(2, 4, 16, 16) * 1e3 + 7)[..., 8:],  # rotate_half's slice
        torch.randn(4, 4, dtype=torch.float16).t(),
        torch.randn(_native.PIECE + 8, 2)[:, 0],  # more than a piece
    ],
    ids=["slice", "expand", "step", "far from zero", "float16", "pieces"],
)
def test_native_kernel_reads_a_tensor_with_gaps(x: torch.Tensor) -> None:
    assert not x.is_contiguous()
    got = native_stats(x, UNDER, OVER)
    assert got is not None
    assert_agrees(got, truth(x), rel=1e-9)


@needs_native
def test_native_kernel_gives_the_same_result_on_any_number_of_threads() -> None:
    x = torch.randn(1 << 22) * 0.01
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_stats(x, UNDER, OVER)
        torch.set_num_threads(2)
        two = native_stats(x, UNDER, OVER)
    finally:
        torch.set_num_threads(threads)
    assert one is not None and two is not None
    assert one[3:] == two[3:]  # extremes and counts exactly
    assert_agrees(two, one, rel=1e-12)


@pytest.mark.parametrize("mode", ["auto", "eager"])
def test_tracked_statistics_are_the_same_on_every_path(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tracked model's statistics, read by the native kernel or by the PyTorch kernel,
    agree with float64 arithmetic on the values the model computed."""
    from unitscale.transforms import track_scales

    monkeypatch.setenv("UNITSCALE_STATS", mode)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    x = torch.randn(8, 16)
    tracked = track_scales(model)
    tracked(x).square().mean().backward()
    graph = tracked.scales_graph()
    hidden = model[1](model[0](x)).detach()
    gelu = next(n for n in graph.nodes if n.target is torch.nn.functional.gelu)
    fwd = gelu.meta["metrics"].fwd
    assert fwd.mean_abs == pytest.approx(hidden.double().abs().mean().item(), rel=1e-6)
    assert fwd.std == pytest.approx(hidden.double().std(correction=0).item(), rel=1e-6)
    assert fwd.abs_max == hidden.abs().max().item()
    assert gelu.meta["metrics"].bwd is not None


def test_without_the_extension_the_pytorch_path_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.setattr(native_build, "_warned", [])
    monkeypatch.setattr(native_build, "missing", {})
    import_module = native_build.importlib.import_module

    def unbuilt(name: str) -> object:
        if name.startswith("unitscale._native."):
            raise ImportError(f"No module named {name!r}")
        return import_module(name)

    monkeypatch.setattr(native_build.importlib, "import_module", unbuilt)
    kernel = _native.NativeStats()
    with pytest.warns(RuntimeWarning, match="native kernels were not built at install"):
        assert not kernel.available()
    assert "_stats" in kernel.failure
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not kernel.available()  # once: no second warning, no second attempt
        assert not _native.NativeStats().available()  # one warning for every kernel
    monkeypatch.setattr(_native, "native", kernel)
    x = torch.randn(1000)
    assert native_stats(x, UNDER, OVER) is None
    assert_agrees(metrics.tensor_stats(x).tolist(), truth(x))


def test_statistics_do_not_modify_their_input() -> None:
    for mode in ("auto", "eager"):
        for x in (torch.randn(100, requires_grad=True), torch.randn(64, 64).half().t()):
            before = x.detach().clone()
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("UNITSCALE_STATS", mode)
                v = metrics.tensor_stats(x)
            assert not v.requires_grad and v.dtype == torch.float64
            assert torch.equal(x.detach(), before)


@pytest.mark.parametrize("mode", ["auto", "eager"])
def test_parameters_take_the_cpu_path(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter (a Tensor subclass) is read like a tensor, never by the compiled device
    kernel (whose compilation takes seconds on a CPU)."""

    def device_kernel(x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the device kernel ran for a CPU parameter")

    monkeypatch.setenv("UNITSCALE_STATS", mode)
    monkeypatch.setattr(metrics, "_kernel", device_kernel)
    # unitscale.Parameter too (a subclass of Parameter): u-muP models are made of them, and
    # `unitscale analyse` compiled the device kernel for them (12 s on a cold cache).
    for weight in (
        torch.nn.Parameter(torch.randn(300, 70)),
        unitscale.Parameter(torch.randn(300, 70), "weight"),
    ):
        assert_agrees(metrics.tensor_stats(weight).tolist(), truth(weight))
        assert_agrees(metrics.tensor_stats(weight.t()).tolist(), truth(weight.t()))


class _Tagged(torch.Tensor):
    pass


@pytest.mark.parametrize("mode", ["auto", "eager"])
def test_nothing_is_compiled_for_cpu_tensors(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the CPU tensor (a Tensor subclass, float64, NaN: what the native kernel does
    not read), its statistics never go to torch.compile: only UNITSCALE_STATS=compiled
    compiles on a CPU."""

    def compiled_kernel(x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the compiled kernel ran for a CPU tensor")

    monkeypatch.setenv("UNITSCALE_STATS", mode)
    monkeypatch.setattr(metrics, "_kernel", compiled_kernel)
    for x in (
        torch.randn(30, 7).as_subclass(_Tagged),
        torch.randn(50, dtype=torch.float64),
        torch.tensor([1.0, math.nan]),
    ):
        assert_agrees(metrics.tensor_stats(x).tolist(), truth(x))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_repeated_call_path_gives_the_first_calls_values(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tracking passes the same thresholds at every call, which then skip the checks: the
    values are those of the general path, for a contiguous tensor as for a transposed one,
    and a kernel swapped in later (unbuilt here) is asked as the general path would ask it."""
    x = torch.randn(33, 17).to(dtype)
    for tensor in (x, x.t(), x[:, 1:]):
        monkeypatch.setattr(_native, "_last_thresholds", (None,) * 4)
        general = native_stats(tensor, UNDER, OVER)
        assert _native._last_thresholds[0] is UNDER  # noted for the next call
        assert general is not None and native_stats(tensor, UNDER, OVER) == general
    monkeypatch.setattr(_native, "native", _native.NativeStats())
    monkeypatch.setattr(_native.native, "available", lambda: False)
    assert native_stats(x, UNDER, OVER) is None


# -- the native kernel as a CPython extension (the tracking hot path) ------------------------
needs_extension = pytest.mark.skipif(
    metrics.fast_stats(load=True) is None,
    reason=f"the statistics extension was not built at install: {_native.native.failure}",
)
_BASE = torch.randn(2, 16, 4, 16, generator=torch.Generator().manual_seed(0))
_FAST_CASES = {
    "contiguous": _BASE,
    "bfloat16": _BASE.bfloat16(),
    "one element": torch.tensor([3.0]),
    "zeros": torch.zeros(7),
    "mean dominates (centred pass)": torch.randn(500) * 1e-3 + 1e3,
    "beyond E4M3 and float16": torch.randn(300) * 1e5,
    "below every subnormal": torch.randn(300) * 1e-40,
    "large (GIL released)": torch.randn(70_000),
    "slice": _BASE[..., :8],
    "transpose": _BASE.transpose(1, 2),
    "permute": _BASE.permute(3, 0, 2, 1),
    "size-1 dimensions": torch.randn(1, 8, 1, 4).transpose(0, 2),
    "expand": torch.randn(5, 1).expand(5, 7),
    "two strides": torch.randn(300, 300)[::3, 1::2],
    "bfloat16 transpose slice": torch.randn(64, 64).bfloat16().t()[:, :30],
    "column": torch.randn(3, 4)[:, 1],
    "parameter": torch.nn.Parameter(torch.randn(4, 4)),
}


@needs_extension
@pytest.mark.parametrize("name", list(_FAST_CASES))
def test_the_extension_gives_the_kernels_statistics(name: str) -> None:
    """``summary(x)`` is ``(x.numel(), statistics)`` with the statistics of the general native
    path value for value, strided tensors read as that path reads them."""
    x = _FAST_CASES[name]
    got = metrics.fast_stats().summary(x)
    assert got is not None
    numel, values = got
    assert numel == x.numel()
    assert values == metrics.deferred_stats(x)
    assert_agrees(values, truth(x), rel=1e-5)


class _Sub(torch.Tensor):
    pass


@needs_extension
@pytest.mark.parametrize(
    "x",
    [
        torch.randn(8).half(),
        torch.randn(8).double(),
        torch.tensor([1.0, math.nan]),
        torch.tensor([1.0, -math.inf]),
        torch.empty(0),
        torch.randn(8).as_subclass(_Sub),
        torch.randn(2100, 1000)[:, ::2],  # strided, over a piece: read in pieces
    ],
    ids=["float16", "float64", "nan", "inf", "empty", "subclass", "strided-large"],
)
def test_the_extension_declines_what_the_general_path_reads(x: torch.Tensor) -> None:
    assert metrics.fast_stats().summary(x) is None


@needs_extension
def test_the_extensions_records_equal_stats_to_data() -> None:
    to_data = metrics.fast_stats().to_data
    gen = torch.Generator().manual_seed(1)
    n = 7 + 2 * len(metrics.FORMAT_KEYS)
    for trial in range(50):
        values = (torch.randn(n, generator=gen, dtype=torch.float64) * 10).abs().tolist()
        values[1] = -values[1] if trial % 2 else values[1]
        values[2] = [math.nan, -0.0, -1e-12, 0.0][trial % 4] if trial < 8 else values[2]
        values[5] = values[6] = float(trial % 3)
        numel = 1 + trial * 37
        got, want = to_data(values, numel), metrics.stats_to_data(values, numel)
        assert type(got) is type(want)
        assert repr(got.__dict__) == repr(want.__dict__)  # NaN and -0.0 alike
        assert list(got.__dict__) == list(want.__dict__)
    assert to_data([0.0] * n, 0) == metrics.stats_to_data([0.0] * n, 0)
    with pytest.raises(ValueError, match="expected 15 values"):
        to_data([1.0, 2.0], 4)


@needs_extension
def test_tracking_without_the_extension_gives_the_same_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The extension changes the cost of tracking, not its statistics: every node's records
    are those of the general path."""
    import unitscale.tracking._recording._pass as recorder
    from unitscale.transforms import track_scales

    def records() -> list[tuple[str, object, object]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)
        )
        tracked = track_scales(model)
        tracked(torch.randn(8, 16)).t().square().mean().backward()
        graph = tracked.scales_graph()
        return [
            (n.name, n.meta["metrics"].fwd, n.meta["metrics"].bwd)
            for n in graph.nodes
            if n.meta.get("metrics") is not None
        ]

    with_extension = records()
    monkeypatch.setattr(recorder, "fast_stats", lambda: None)
    without = records()
    assert len(with_extension) >= 6
    assert with_extension == without


def test_the_extension_is_looked_for_only_once_cpu_statistics_are_needed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fresh process tracking only accelerator tensors looks for no extension (and, where
    the install built none, warns of nothing): it is looked for at the first CPU
    statistics."""
    kernel = _native.NativeStats()
    monkeypatch.setattr(_native, "native", kernel)
    monkeypatch.setattr(metrics, "_fast_module", [])
    assert metrics.fast_stats() is None
    assert not kernel.loaded()
    if kernel.available():  # the first CPU statistics look for it...
        module = metrics.fast_stats()  # ...and the next call finds the extension
        assert module is not None and not kernel.failure


# -- the two implementations on the same tensors: native and PyTorch -------------------------
_EDGE = {
    "empty": torch.zeros(0),
    "empty bfloat16": torch.zeros(0, 3).bfloat16(),
    "all zeros": torch.zeros(4097),
    "negative zeros": -torch.zeros(300),
    "NaN": torch.tensor([1.0, math.nan, -2.0]),
    "Inf": torch.tensor([1.0, math.inf, -2.0, -math.inf]),
    "NaN and Inf, bfloat16": torch.tensor([math.nan, math.inf, 3.0]).bfloat16(),
    "float32 subnormals": torch.tensor([2.0**-149, -(2.0**-130), 2.0**-126, 0.0, 1e-40]),
    "float16 subnormals": torch.tensor([2.0**-24, -(2.0**-20), 2.0**-14, 6e-5]).half(),
    "bfloat16 subnormals": torch.tensor([2.0**-133, -(2.0**-127), 2.0**-126]).bfloat16(),
    "float16": (torch.randn(5000) * 300).half(),
    "bfloat16": (torch.randn(5000) * 1e4).bfloat16(),
    "bfloat16 largest": torch.tensor([3.3895e38, -1.0]).bfloat16(),
}


_BOTH = {**_EDGE, **CASES}


@needs_native
@pytest.mark.parametrize("name", list(_BOTH))
def test_native_and_pytorch_kernels_agree(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The two implementations on the same tensors: edge cases, float16/bfloat16, strided
    and large tensors."""
    x = _BOTH[name]
    monkeypatch.setenv("UNITSCALE_STATS", "auto")
    native_values = metrics.tensor_stats(x).tolist()
    monkeypatch.setenv("UNITSCALE_STATS", "eager")
    pytorch_values = metrics.tensor_stats(x).tolist()
    if x.numel():
        assert_agrees(native_values, truth(x))
        assert_agrees(pytorch_values, truth(x))
        # The native kernel declines what holds NaN or Inf (the PyTorch path keeps IEEE).
        finite = bool(torch.isfinite(x).all())
        assert (native_stats(x, UNDER, OVER) is None) == (not finite)
    assert_agrees(native_values, pytorch_values)
    fast = metrics.fast_stats(load=True)
    if (
        fast is not None
        and x.numel()
        and bool(torch.isfinite(x).all())
        and x.dtype != torch.float16
    ):
        numel, values = fast.summary(x)
        assert numel == x.numel()
        assert_agrees(values, pytorch_values)
