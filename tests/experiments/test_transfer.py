"""Learning-rate transfer sweeps (unitscale.experiments.transfer): configuration, the claims
computed from a table, and short sweeps (slow: they train)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch

from unitscale.experiments.transfer import (
    CSV_COLUMNS,
    DEFAULT_CONFIG,
    DEFAULT_MUP_LR,
    MODELS,
    TransferConfig,
    TransferConfigError,
    _eval_data,
    _train_data,
    best_points,
    build_model,
    command_line,
    default_config,
    evaluate_claims,
    final_frame,
    run_transfer,
    runs_frame,
    summary_text,
    train_one,
    write_transfer_csv,
)

COLUMNS = ["parametrisation", "precision", "width", "depth", "lr_step", "lr", "heldout_loss"]


def table(curves: dict[tuple[str, int], list[float]], fp8: dict[int, float] | None = None,
          steps: tuple[int, ...] = (-2, -1, 0, 1, 2)) -> pd.DataFrame:  # fmt: skip
    """A synthetic final table: ``curves[(parametrisation, width)]`` lists the loss per step."""
    rows = []
    for (p, width), losses in curves.items():
        centre = DEFAULT_MUP_LR if p == "u-muP" else 3e-3
        for k, loss in zip(steps, losses, strict=True):
            rows.append((p, "fp32", width, 2, k, centre * 2.0**k, loss))
    for width, loss in (fp8 or {}).items():
        best = min((loss_, k) for k, loss_ in zip(steps, curves[("u-muP", width)], strict=True))[1]
        rows.append(("u-muP", "fp8", width, 2, best, DEFAULT_MUP_LR * 2.0**best, loss))
    return pd.DataFrame(rows, columns=COLUMNS)


# -- configuration ---------------------------------------------------------------------------
def test_default_config_is_the_documented_sweep() -> None:
    c = DEFAULT_CONFIG
    assert c.sizes == [(32, 2), (64, 2), (128, 2), (256, 2)]
    assert c.lr_steps == (-3, -2, -1, 0, 1, 2, 3)
    grid = c.grid("u-muP")
    assert dict(grid)[0] == DEFAULT_MUP_LR == 0.5
    # A 2x grid: each point is twice the one before.
    assert all(b / a == 2.0 for (_, a), (_, b) in itertools.pairwise(grid))
    assert next(lr for _, lr in c.grid("standard")) == pytest.approx(3e-3 / 8)
    assert default_config("depth").sizes == [(64, 1), (64, 2), (64, 4), (64, 8)]
    assert default_config(quick=True, seed=3, steps=None).seed == 3


def test_schedule_is_unitscale_trains() -> None:
    c = TransferConfig(steps=100)
    # Warm-up over 5 steps, peak, cosine decay to 10% at the last step.
    assert c.lr_factor(0) == pytest.approx(0.2)
    assert c.lr_factor(5) == pytest.approx(1.0)
    assert c.lr_factor(99) == pytest.approx(0.1)
    factors = [c.lr_factor(s) for s in range(5, 100)]
    assert all(a >= b for a, b in itertools.pairwise(factors))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"widths": (48, 64)}, r"widths \[48\] are not multiples of the head size 32"),
        ({"widths": (64,)}, r"vary='width' needs at least two widths, got \[64\]"),
        ({"depths": (1, 2)}, r"vary='width' takes one value of depths, got \[1, 2\]"),
        ({"vary": "depth", "depths": (1, 2)}, r"takes one value of widths, got \[32, 64, 128"),
        ({"widths": (32, 0)}, r"widths=\(32, 0\) must be a non-empty sequence of positive"),
        ({"widths": (32, 32)}, r"lists a value twice"),
        ({"lr_steps": (-1, 1)}, r"must be integers including 0"),
        ({"mup_lr": -1.0}, r"mup_lr=-1.0 must be positive"),
        ({"steps": 0}, r"TransferConfig: steps=0 must be a positive integer"),
        ({"vary": "heads"}, r"vary='heads' must be 'width' or 'depth'"),
        ({"fp8_recipe": "bf16"}, r"fp8_recipe='bf16'; choose from"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(TransferConfigError, match=message):
        TransferConfig(**kwargs)  # type: ignore[arg-type]


def test_unknown_parametrisation_is_an_error() -> None:
    with pytest.raises(TransferConfigError, match=r"unknown parametrisation 'mup'"):
        DEFAULT_CONFIG.grid("mup")


# -- claims from a table ---------------------------------------------------------------------
def test_best_points_take_the_lowest_finite_loss_and_flag_grid_edges() -> None:
    t = table(
        {
            ("u-muP", 32): [3.0, 2.5, 2.2, 2.3, math.nan],  # best k=0; the diverged run is out
            ("u-muP", 64): [1.9, 2.0, 2.1, 2.2, 2.3],  # best at the grid's low edge
            ("standard", 32): [2.4, 2.4, 2.5, 2.6, 2.7],  # a tie: the smaller step wins
            ("standard", 64): [math.nan] * 5,  # every run diverged
        }
    )
    best = best_points(t).set_index(["parametrisation", "width"])
    assert best.loc[("u-muP", 32), "lr_step"] == 0
    assert not best.loc[("u-muP", 32), "at_edge"]
    assert best.loc[("u-muP", 64), "lr_step"] == -2
    assert best.loc[("u-muP", 64), "at_edge"]
    assert best.loc[("u-muP", 64), "default_loss"] == 2.1
    assert best.loc[("standard", 32), "lr_step"] == -2
    assert math.isnan(best.loc[("standard", 64), "lr_step"])


def test_claims_held_on_a_table_where_only_u_mup_transfers() -> None:
    curves = {
        ("u-muP", 32): [2.6, 2.3, 2.20, 2.25, 2.5],  # best k=0
        ("u-muP", 256): [2.0, 1.85, 1.80, 1.83, 2.2],  # best k=0
        ("standard", 32): [2.8, 2.6, 2.4, 2.3, 2.35],  # best k=+1
        ("standard", 256): [2.1, 2.3, 2.5, 2.7, 3.0],  # best k=-2: moved 3 steps down
    }
    claims = evaluate_claims(table(curves, fp8={32: 2.21, 256: 1.90}))
    assert [c.number for c in claims] == [1, 2, 3, 4]
    one, two, three, four = claims
    assert one.held is True and one.verdict == "held" and "moves +0 steps" in one.detail
    assert two.held is None and two.verdict == "measured"
    assert "moves -3 steps (0.125x)" in two.detail
    assert "width 256: k=-2 (lr 0.00075) (grid edge)" in two.detail
    assert three.held is True and "width 32: +0.00%; width 256: +0.00%" in three.detail
    # FP8 within 2% at width 32 (+0.45%), not at width 256 (+5.56%): the claim fails.
    assert four.held is False and four.verdict == "NOT held"
    assert "width 32: +0.45%; width 256: +5.56%" in four.detail


def test_claims_fail_when_u_mup_optimum_moves_and_default_is_far() -> None:
    curves = {
        ("u-muP", 32): [2.6, 2.3, 2.2, 2.1, 2.5],  # best k=+1
        ("u-muP", 64): [2.0, 1.8, 2.0, 2.3, 2.6],  # best k=-1: moved 2 steps
        ("standard", 32): [2.8, 2.6, 2.4, 2.3, 2.35],
        ("standard", 64): [2.8, 2.6, 2.4, 2.3, 2.35],
    }
    one, two, three, four = evaluate_claims(table(curves))
    assert one.held is False and "moves -2 steps" in one.detail
    assert "moves +0 steps (1x)" in two.detail
    # Default (k=0) vs best: 2.2 / 2.1 - 1 = +4.76%, 2.0 / 1.8 - 1 = +11.11%.
    assert three.held is False and "width 32: +4.76%; width 64: +11.11%" in three.detail
    assert four.held is None and four.verdict == "not evaluated"


def test_claims_across_depth_name_the_depth() -> None:
    rows = [
        ("u-muP", "fp32", 64, d, k, 0.5 * 2.0**k, 2.0 + abs(k)) for d in (1, 4) for k in (-1, 0, 1)
    ]
    one = evaluate_claims(pd.DataFrame(rows, columns=COLUMNS))[0]
    assert "every depth" in one.statement and "depth 4: k=+0" in one.detail


def test_claim_one_is_judged_at_every_size_not_only_the_largest() -> None:
    # The largest width's optimum matches the smallest's, a width between moves 2 steps.
    curves = {
        ("u-muP", 32): [2.6, 2.3, 2.20, 2.25, 2.5],  # best k=0
        ("u-muP", 64): [2.6, 2.3, 2.25, 2.25, 2.1],  # best k=+2
        ("u-muP", 128): [2.6, 2.3, 2.25, 2.2, 2.25],  # best k=+1
        ("u-muP", 256): [2.0, 1.85, 1.80, 1.83, 2.2],  # best k=0
    }
    one = evaluate_claims(table(curves))[0]
    assert one.held is None and "width 64 is on the grid's edge" in one.detail
    curves[("u-muP", 64)] = [2.6, 2.3, 2.25, 2.1, 2.15]  # best k=+1: within one step
    curves[("u-muP", 128)] = [2.0, 1.9, 2.25, 2.3, 2.35]  # best k=-1: within one step
    one = evaluate_claims(table(curves))[0]
    assert one.held is True
    assert "from the smallest width's optimum: width 64 +1, width 128 -1, width 256 +0" in (
        one.detail
    )
    curves[("u-muP", 256)] = [2.6, 2.1, 2.25, 2.3, 2.5]  # k=-1
    curves[("u-muP", 32)] = [2.6, 2.1, 2.25, 2.3, 2.5]  # k=-1: the largest is 0 away, 64 +2
    one = evaluate_claims(table(curves))[0]
    assert one.held is False and "moves +0 steps" in one.detail and "width 64 +2" in one.detail


def _seeded(tables: list[pd.DataFrame]) -> pd.DataFrame:
    return pd.concat([t.assign(seed=i) for i, t in enumerate(tables)], ignore_index=True)


def test_claims_over_seeds_use_the_mean_and_show_each_seed_s_optimum() -> None:
    # Seed 0 puts width 64's optimum at k=-1, seed 1 at k=+1; their mean at k=0.
    seed0 = {("u-muP", 32): [2.6, 2.3, 2.2, 2.3, 2.6], ("u-muP", 64): [2.6, 2.1, 2.2, 2.4, 2.6]}
    seed1 = {("u-muP", 32): [2.6, 2.3, 2.2, 2.3, 2.6], ("u-muP", 64): [2.6, 2.4, 2.2, 2.1, 2.6]}
    final = _seeded([table(seed0, fp8={32: 2.2, 64: 2.2}), table(seed1, fp8={32: 2.2, 64: 2.2})])
    one, _, three, _ = evaluate_claims(final)
    assert one.held is True and "optima of the mean over seeds" in one.detail
    assert "width 64: k=+0" in one.detail  # the mean: 2.2 at k=0 against 2.25 at k=+-1
    assert "seed 0: 32 k=+0, 64 k=-1; seed 1: 32 k=+0, 64 k=+1" in one.detail
    assert "held on its own by 2 of 2 seeds" in one.detail
    # The mean's default is its best at width 64 (+0.00%), but seed 0's default ends 4.76%
    # from seed 0's own best (2.2 vs 2.1): one seed breaks claim 3, so it is NOT held.
    assert "on the mean over seeds, default vs best" in three.detail
    assert "width 64: +0.00%" in three.detail and three.held is False
    assert three.every_seed.startswith("the default within 4.76% of each seed's best point")
    assert "(worst: seed 0 at width 64, +4.76%)" in three.every_seed
    assert "width 64: +4.76% to +4.76%" in three.every_seed
    # A diverged seed makes the point diverged in the mean, whatever the other seed's loss.
    seed1[("u-muP", 64)] = [2.6, 2.4, math.nan, 2.1, 2.6]
    three = evaluate_claims(_seeded([table(seed0), table(seed1)]))[2]
    assert three.held is False and "width 64: n/a (diverged)" in three.detail


def test_a_sweep_logs_each_report_of_a_transformed_model_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The same model built at every grid point reports the same ops each time: once is enough.
    import logging

    from unitscale.experiments.transfer._sweep import _each_report_once

    with caplog.at_level(logging.WARNING, logger="unitscale"), _each_report_once():
        for _ in range(3):
            logging.getLogger("unitscale.unit_scale").warning("left 45 op(s) as they are")
            logging.getLogger("unitscale").warning("simulate_fp8 rounded 12 operands")
        logging.getLogger("unitscale.unit_scale").warning("left 3 op(s) as they are")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "left 45 op(s) as they are",
        "simulate_fp8 rounded 12 operands",
        "left 3 op(s) as they are",
    ]
    logging.getLogger("unitscale").warning("simulate_fp8 rounded 12 operands")  # after: again
    assert len(caplog.records) == 4


def test_seed_mean_averages_each_grid_point_over_seeds() -> None:
    from unitscale.experiments.transfer import seed_mean

    a = table({("u-muP", 32): [2.0, 3.0, 4.0, 5.0, 6.0]})
    b = table({("u-muP", 32): [4.0, 5.0, 6.0, 7.0, math.nan]})
    mean = seed_mean(_seeded([a, b]))
    assert mean["heldout_loss"].tolist()[:4] == [3.0, 4.0, 5.0, 6.0]
    assert math.isnan(mean["heldout_loss"].iloc[4]) and set(mean["seeds"]) == {2}
    assert seed_mean(a.assign(seed=0)) is not None and len(seed_mean(a.assign(seed=0))) == 5


def test_a_diverged_default_fails_claim_three() -> None:
    curves = {("u-muP", 32): [2.3, 2.2, math.nan], ("u-muP", 64): [2.3, 2.2, 2.1]}
    three = evaluate_claims(table(curves, steps=(-1, 1, 0)))[2]
    assert three.held is False and "width 32: n/a (diverged)" in three.detail


def test_an_optimum_on_the_grid_s_edge_makes_claims_one_and_three_inconclusive() -> None:
    curves = {
        ("u-muP", 32): [2.6, 2.3, 2.20, 2.25, 2.5],  # best k=0
        ("u-muP", 64): [2.0, 1.85, 1.81, 1.83, 1.80],  # best k=+2: the grid's high edge
    }
    one, _, three, _ = evaluate_claims(table(curves))
    assert one.held is None and one.verdict == "inconclusive"
    assert "the optimum at width 64 is on the grid's edge" in one.detail
    assert "moves +2 steps" in one.detail  # the numbers are still shown
    # Default within 2% of the grid's best (+0.56%), but the true best may be lower.
    assert three.held is None and three.verdict == "inconclusive"
    assert "width 64: +0.56%" in three.detail


def test_a_default_too_far_from_an_edge_optimum_still_fails_claim_three() -> None:
    curves = {("u-muP", 32): [2.6, 2.3, 2.2, 2.1, 2.0], ("u-muP", 64): [2.6, 2.3, 2.2, 2.1, 2.0]}
    three = evaluate_claims(table(curves))[2]
    assert three.held is False and "width 32: +10.00%" in three.detail


def test_a_quick_run_holds_no_claim() -> None:
    curves = {
        ("u-muP", 32): [2.6, 2.3, 2.20, 2.25, 2.5],
        ("u-muP", 256): [2.0, 1.85, 1.80, 1.83, 2.2],
        ("standard", 32): [2.8, 2.6, 2.4, 2.3, 2.35],
        ("standard", 256): [2.1, 2.3, 2.5, 2.7, 3.0],
    }
    final = table(curves, fp8={32: 2.21, 256: 1.90})
    full = evaluate_claims(final)
    quick = evaluate_claims(final, quick=True)
    assert [c.verdict for c in full] == ["held", "measured", "held", "NOT held"]
    # A quick run judges no claim, either way: no "NOT held" after "none is judged".
    assert [c.verdict for c in quick] == ["not judged"] * 4
    assert all(c.held is None for c in quick)
    assert quick[3].detail.startswith("not judged: a --quick smoke run is no evidence either way; ")
    assert quick[3].detail.endswith(full[3].detail)  # the numbers are still shown
    assert default_config(quick=True).quick and not default_config().quick


def test_the_transfer_plot_labels_every_axis() -> None:
    from unitscale.experiments.transfer import plot_transfer

    curves = {(p, w): [2.6, 2.3, 2.2, 2.25, 2.5] for p in ("u-muP", "standard") for w in (32, 64)}
    figure = plot_transfer(table(curves, fp8={32: 2.21, 64: 2.2}), default_config())
    panels = [ax for ax in figure.axes if ax.has_data()]
    assert len(panels) == 2
    for ax in panels:
        assert ax.get_xlabel().startswith("peak learning rate (log2 axis)")
        assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
        assert ax.get_ylabel() == "final held-out loss (nats per byte)"


# -- sweeps (train) --------------------------------------------------------------------------
TINY = {"steps": 4, "eval_every": 2, "eval_batches": 1, "batch_size": 2, "seq_len": 16}


@pytest.mark.slow
def test_a_sweep_over_seeds_runs_each_seed_and_fp8_at_the_mean_s_best(
    single_thread: None,
) -> None:
    config = default_config(quick=True, **TINY, seed=5, seeds=2, widths=(32, 64), lr_steps=(0, 1))
    assert command_line(config).endswith("--seed 5 --seeds 2")
    result = run_transfer(config)
    frame = runs_frame(result.runs)
    # 2 seeds x 2 parametrisations x 2 widths x 2 learning rates, then 2 seeds x 2 FP8 runs.
    assert len(result.runs) == 2 * 2 * 2 * 2 + 2 * 2
    assert [r.seed for r in result.runs[:8]] == [5] * 8 and result.runs[8].seed == 6
    # each seed its own batches (one digest per seed) and its own initial weights
    assert frame.groupby("seed")["data_digest"].nunique().tolist() == [1, 1]
    assert frame["data_digest"].nunique() == 2
    seed5 = [r for r in result.runs if r.seed == 5 and r.precision == "fp32"]
    seed6 = [r for r in result.runs if r.seed == 6 and r.precision == "fp32"]
    pairs = zip(seed5, seed6, strict=True)
    assert all(a.final_heldout_loss != b.final_heldout_loss for a, b in pairs)
    # The FP8 runs of both seeds use the learning rate best on the mean over seeds.
    final = final_frame(frame)
    best = best_points(final).set_index(["parametrisation", "width"])
    for r in result.runs[-4:]:
        assert r.precision == "fp8" and r.lr_step == best.loc[("u-muP", r.width), "lr_step"]
    text = summary_text(result)
    assert "seeds 5-6 (losses: means over seeds)" in text and "per seed" in text
    # A one-seed sweep of seed 6 gives seed 6's runs of the two-seed sweep, loss for loss.
    alone = run_transfer(replace(config, seed=6, seeds=1, fp8=False))
    assert [r.final_heldout_loss for r in alone.runs] == [r.final_heldout_loss for r in seed6]


@pytest.mark.slow
def test_sweep_table_shape_same_batches_and_fp8_at_best(single_thread: None) -> None:
    config = default_config(quick=True, **TINY)
    result = run_transfer(config)
    frame = runs_frame(result.runs)
    assert list(frame.columns) == list(CSV_COLUMNS)
    # 2 parametrisations x 2 widths x 3 learning rates in FP32, then one FP8 run per width.
    assert len(result.runs) == 2 * 2 * 3 + 2
    diverged = [r for r in result.runs if r.stopped_at is not None]
    assert len(frame) == 2 * (len(result.runs) - len(diverged)) + len(diverged)
    final = final_frame(frame)
    assert len(final) == len(result.runs)
    assert set(final["step"][final["heldout_loss"].notna()]) == {4}
    # Every run trained on the same batches in the same order.
    assert frame["data_digest"].nunique() == 1
    # Each size's FP8 run uses the best FP32 learning rate of u-muP at that size.
    best = best_points(final).set_index(["parametrisation", "width"])
    for _, row in final[final["precision"] == "fp8"].iterrows():
        assert row["lr_step"] == best.loc[("u-muP", row["width"]), "lr_step"]
    text = summary_text(result)
    assert text.count("claim (") == 4 and "u-muP: final held-out loss at lr = 0.5 x 2^k" in text


@pytest.mark.slow
def test_the_digest_sees_the_batches(single_thread: None) -> None:
    config = default_config(quick=True, **TINY)
    held = _eval_data(config, "heldout")
    data = _train_data(config)
    other = _train_data(default_config(quick=True, **{**TINY, "seed": 1}))
    a = train_one("u-muP", 32, 2, 0, config, data, held, held)
    b = train_one("standard", 32, 2, 0, config, data, held, held)
    c = train_one("standard", 32, 2, 0, config, other, held, held)
    assert a.data_digest == b.data_digest != c.data_digest
    # Different batches, different losses: the digest is of what was trained on.
    assert b.evals[0][1] != c.evals[0][1]


@pytest.mark.slow
def test_sweep_is_deterministic_under_the_seed(tmp_path: Path, single_thread: None) -> None:
    config = default_config(quick=True, widths=(32, 64), lr_steps=(0, 1), **TINY)
    state = torch.random.get_rng_state()
    paths = [write_transfer_csv(run_transfer(config), tmp_path / f"{i}.csv") for i in range(2)]
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is untouched
    other = write_transfer_csv(
        run_transfer(default_config(quick=True, widths=(32, 64), lr_steps=(0, 1),
                                    **{**TINY, "seed": 1})),
        tmp_path / "seed1.csv",
    )  # fmt: skip
    assert other.read_bytes() != paths[0].read_bytes()


@pytest.mark.slow
def test_the_sweep_runs_on_its_pinned_threads_whatever_the_caller_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from unitscale.experiments import transfer

    seen: list[int] = []
    real = transfer.train_one

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(transfer._sweep, "train_one", spy)  # where run_transfer looks it up
    config = default_config(quick=True, widths=(32, 64), lr_steps=(0,), fp8=False, **TINY)
    caller = torch.get_num_threads()
    paths = []
    try:
        for i, threads in enumerate((2, 1)):
            torch.set_num_threads(threads)
            paths.append(write_transfer_csv(run_transfer(config), tmp_path / f"{i}.csv"))
            assert torch.get_num_threads() == threads  # the caller's count is restored
    finally:
        torch.set_num_threads(caller)
    assert set(seen) == {config.threads} == {1} and len(seen) == 8
    assert paths[0].read_bytes() == paths[1].read_bytes()


def _weight_matrices(model: torch.nn.Module) -> list[tuple[int, ...]]:
    """The shapes of the 2-D parameters (embedding, projections, readout), in order."""
    return [tuple(p.shape) for p in model.parameters() if p.dim() == 2]


@pytest.mark.parametrize("family", ["builtin", "hf:llama"])
@pytest.mark.parametrize("width", [32, 256])
def test_both_parametrisations_are_the_same_decoder(family: str, width: int) -> None:
    """Same heads, depth, embedding and readout; no position embedding; hf:llama's weight
    matrices the same (the built-in sides differ in their block: a GPT-2 block against the
    library's Llama-style one). Biases and norm parameters are the standard side's own
    (u-muP's default decoder has none)."""
    if family == "hf:llama":
        pytest.importorskip("transformers")
    config = replace(DEFAULT_CONFIG, model=family)
    standard, mup = (build_model(p, width, 2, config) for p in ("standard", "u-muP"))
    if family == "hf:llama":
        assert _weight_matrices(standard) == _weight_matrices(mup)
    else:  # embedding first, readout last, one attention and one MLP pair per block
        ends = [_weight_matrices(m)[i] for m in (standard, mup) for i in (0, -1)]
        assert ends == [(256, width), (256, width)] * 2
        assert len(_weight_matrices(standard)) == len(_weight_matrices(mup))
    assert len(_weight_matrices(mup)) == 2 + 2 * (4 if family == "builtin" else 7)
    assert not any("position" in name for name, _ in standard.named_parameters())
    if family == "builtin":
        # u-muP: the paper's scheme, every parameter a weight matrix; standard: GPT-2's.
        assert {p.mup_type for p in mup.parameters()} == {"weight", "output"}
        assert all(p.dim() == 2 for p in mup.parameters())
        assert [layer.attn.heads for layer in mup.layers] == [width // 32] * 2
        assert [block.attn.heads for block in standard.blocks] == [width // 32] * 2
        assert any(name.endswith(".bias") for name, _ in standard.named_parameters())
        assert standard.token_embedding.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert mup.embedding.weight.std().item() == pytest.approx(1.0, rel=0.05)
    else:
        for model in (standard, mup):
            llama = model.lm.config
            assert (llama.num_attention_heads, llama.num_hidden_layers) == (width // 32, 2)
            assert llama.intermediate_size == 4 * width and llama.vocab_size == 256
        # unit_scale made it u-muP: the head is the readout, the embedding a weight.
        types = {n: p.mup_type for n, p in mup.named_parameters()}
        assert types["lm.lm_head.weight"] == "output"
        assert types["lm.model.embed_tokens.weight"] == "weight"
        assert not any(hasattr(p, "mup_type") for p in standard.parameters())
        assert standard.lm.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_the_u_mup_side_is_the_library_default_decoder_without_rope() -> None:
    from unitscale import TransformerDecoder

    torch.manual_seed(DEFAULT_CONFIG.seed)
    default = TransformerDecoder(64, 2, 2, 256, rope=False)  # the Llama-style block
    built = build_model("u-muP", 64, 2, DEFAULT_CONFIG)
    assert built.state_dict().keys() == default.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(
        built.state_dict().values(), default.state_dict().values(), strict=True))  # fmt: skip


def test_models_are_a_config_field_with_a_clear_error() -> None:
    assert DEFAULT_CONFIG.model == "builtin" and set(MODELS) == {"builtin", "hf:llama"}
    assert default_config(model="hf:llama").grid("u-muP") == DEFAULT_CONFIG.grid("u-muP")
    with pytest.raises(TransferConfigError, match=r"model='hf:gpt9'; choose from builtin, hf:"):
        TransferConfig(model="hf:gpt9")


def test_command_line_reproduces_the_config() -> None:
    assert command_line(DEFAULT_CONFIG) == "unitscale transfer"
    config = default_config("depth", model="hf:llama", steps=80, fp8=False, widths=(128,))
    assert command_line(config) == (
        "unitscale transfer --vary depth --model hf:llama --widths 128 --steps 80 --no-fp8"
    )
    assert command_line(default_config(quick=True)) == "unitscale transfer --quick"


@pytest.mark.slow
def test_llama_sweep_trains_both_parametrisations_and_fp8(single_thread: None) -> None:
    pytest.importorskip("transformers")
    config = default_config(quick=True, model="hf:llama", lr_steps=(0, 1), **TINY)
    result = run_transfer(config)
    # 2 parametrisations x 2 widths x 2 learning rates in FP32, then one FP8 run per width.
    assert [(r.parametrisation, r.precision) for r in result.runs].count(("u-muP", "fp8")) == 2
    assert len(result.runs) == 2 * 2 * 2 + 2
    assert all(r.stopped_at is None for r in result.runs)
    # The same batches as the built-in sweep, and losses that fell from log(256).
    assert len({r.data_digest for r in result.runs}) == 1
    builtin = train_one("standard", 32, 2, 0, replace(config, model="builtin"),
                        _train_data(config), _eval_data(config, "heldout"),
                        _eval_data(config, "train"))  # fmt: skip
    assert builtin.data_digest == result.runs[0].data_digest
    # Four steps of two sequences: every run stays near or below a uniform guess (none
    # diverged; which ones end just above it moves with the torch release), and the best fell.
    finals = [r.evals[-1][1] for r in result.runs]
    assert all(math.isfinite(loss) and loss < math.log(256) + 0.5 for loss in finals), finals
    assert min(finals) < math.log(256), finals
    text = summary_text(result)
    assert "model hf:llama" in text and "unit_scale(LlamaForCausalLM)" in text


@pytest.mark.slow
def test_depth_sweep_reports_claims_across_depth(single_thread: None) -> None:
    config = default_config("depth", quick=True, lr_steps=(0, 1), fp8=False, **TINY)
    result = run_transfer(config)
    assert {(r.width, r.depth) for r in result.runs} == {(32, 1), (32, 2)}
    text = summary_text(result)
    assert "sweeps across depth (1, 2; width 32)" in text
    assert "claim (1) u-muP's best learning rate at every depth" in text
    assert "claim (4)" in text and "not evaluated: no FP8 run at some depth" in text
