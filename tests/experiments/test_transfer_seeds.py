"""Transfer claims judged on every seed (the worst seed and the spread, never a mean that
hides a seed), and sweeps of other seeds loaded back and combined into one."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from unitscale.experiments.transfer import (
    DEFAULT_MUP_LR,
    TransferConfig,
    TransferConfigError,
    combine_results,
    default_config,
    evaluate_claims,
    final_frame,
    fp8_not_at_best,
    load_transfer,
    rerun_fp8,
    run_transfer,
    runs_frame,
    summary_text,
    write_transfer_outputs,
)

COLUMNS = ["parametrisation", "precision", "width", "depth", "lr_step", "lr", "heldout_loss"]
STEPS = (-2, -1, 0, 1, 2)
ROOT = Path(__file__).resolve().parents[2]


def table(curves: dict[int, list[float]], seed: int, fp8: dict[int, float] | None = None,
          fp8_step: int = 0) -> pd.DataFrame:  # fmt: skip
    """u-muP's losses per step at each width (a standard curve copied from it), one seed."""
    rows = []
    for width, losses in curves.items():
        for p, centre in (("u-muP", DEFAULT_MUP_LR), ("standard", 3e-3)):
            for k, loss in zip(STEPS, losses, strict=True):
                rows.append((p, "fp32", width, 2, k, centre * 2.0**k, loss))
    for width, loss in (fp8 or {}).items():
        rows.append(("u-muP", "fp8", width, 2, fp8_step, DEFAULT_MUP_LR * 2.0**fp8_step, loss))
    return pd.DataFrame(rows, columns=COLUMNS).assign(seed=seed)


def test_claim_one_held_on_the_mean_but_broken_on_a_seed_is_not_held() -> None:
    seed0 = {32: [2.6, 2.3, 2.2, 2.3, 2.6], 64: [2.6, 2.4, 2.0, 2.4, 2.6]}  # both k=0
    seed1 = {32: [2.6, 2.19, 2.2, 2.3, 2.6], 64: [2.6, 2.4, 2.2, 2.19, 2.6]}  # k=-1, k=+1
    one = evaluate_claims(pd.concat([table(seed0, 0), table(seed1, 1)]))[0]
    assert "moves +0 steps" in one.detail  # the mean's optimum stays at k=0 at both widths
    assert one.held is False and one.verdict == "NOT held"
    assert "held on its own by 1 of 2 seeds" in one.detail
    assert one.every_seed.startswith("on every seed, the optimum within 2 grid step(s)")
    assert "(worst: seed 1, 2 step(s) at width 64)" in one.every_seed
    assert one.statement.endswith("on the mean over seeds and on every seed")
    # one seed alone: no per-seed text, the verdict as before
    alone = evaluate_claims(table(seed0, 0))[0]
    assert alone.held is True and alone.every_seed == ""


def test_a_seed_s_optimum_on_the_grid_s_edge_makes_claim_one_inconclusive() -> None:
    seed0 = {32: [2.6, 2.3, 2.2, 2.3, 2.6], 64: [2.6, 2.4, 2.0, 2.4, 2.6]}
    seed1 = {32: [2.6, 2.3, 2.2, 2.3, 2.6], 64: [2.6, 2.4, 2.3, 2.25, 2.2]}  # 64: k=+2, edge
    one = evaluate_claims(pd.concat([table(seed0, 0), table(seed1, 1)]))[0]
    assert one.held is None and one.verdict == "inconclusive"
    assert one.detail.startswith("inconclusive: a seed's optimum is on the grid's edge")


def test_claim_two_states_each_seed_s_move_and_the_spread() -> None:
    seed0 = {32: [2.6, 2.3, 2.2, 2.3, 2.6], 64: [2.6, 2.4, 2.0, 2.4, 2.6]}
    seed1 = {32: [2.6, 2.19, 2.2, 2.3, 2.6], 64: [2.6, 2.4, 2.2, 2.19, 2.6]}
    two = evaluate_claims(pd.concat([table(seed0, 0), table(seed1, 1)]))[1]
    assert two.held is None
    assert two.every_seed == (
        "per seed, smallest to largest width: seed 0 +0, seed 1 +2 (spread +0 to +2 steps)"
    )


def test_claim_four_held_on_the_mean_but_broken_on_a_seed_is_not_held() -> None:
    curve = {32: [2.6, 2.3, 2.2, 2.3, 2.6], 64: [2.6, 2.3, 2.2, 2.3, 2.6]}
    # FP8 +3% on seed 0 and -3% on seed 1 at width 32: +0.00% on the mean.
    final = pd.concat([table(curve, 0, fp8={32: 2.2 * 1.03, 64: 2.2}),
                       table(curve, 1, fp8={32: 2.2 * 0.97, 64: 2.2})])  # fmt: skip
    four = evaluate_claims(final)[3]
    assert "on the mean over seeds, FP8 vs FP32 held-out: width 32: +0.00%" in four.detail
    assert four.held is False
    assert four.every_seed.startswith("FP8 within 3.00% of FP32 on every seed")
    assert "width 32: -3.00% to +3.00%; width 64: +0.00% to +0.00%" in four.every_seed
    # Within 2% on both seeds: held, the worst seed named.
    final = pd.concat([table(curve, 0, fp8={32: 2.2 * 1.015, 64: 2.2}),
                       table(curve, 1, fp8={32: 2.2 * 0.99, 64: 2.2})])  # fmt: skip
    four = evaluate_claims(final)[3]
    assert four.held is True and "(worst: seed 0 at width 32, +1.50%)" in four.every_seed


def test_fp8_runs_off_the_mean_s_best_are_listed_and_not_compared() -> None:
    curve = {32: [2.6, 2.3, 2.2, 2.3, 2.6], 64: [2.6, 2.3, 2.2, 2.3, 2.6]}
    # seed 1's FP8 ran at k=+1 (its part's best), the combined mean's best is k=0
    final = pd.concat([table(curve, 0, fp8={32: 2.2, 64: 2.2}),
                       table(curve, 1, fp8={32: 2.3, 64: 2.3}, fp8_step=1)])  # fmt: skip
    assert fp8_not_at_best(final) == [(1, 32, 2, 0), (1, 64, 2, 0)]
    four = evaluate_claims(final)[3]
    assert four.held is None and four.verdict == "not evaluated"
    assert "not comparable" in four.detail and "width 32 (FP8 at k=[1], best k=+0)" in four.detail


def test_combining_checks_the_settings_and_the_seeds() -> None:
    from unitscale.experiments.transfer import TransferResult

    a = TransferResult(default_config(quick=True, seed=0, seeds=2), [], date="2026-01-01")
    with pytest.raises(TransferConfigError, match=r"seed\(s\) \[1\] ran in more than one"):
        combine_results(a, TransferResult(default_config(quick=True, seed=1), []))
    with pytest.raises(TransferConfigError, match=r"differ in more than their seeds \(steps"):
        combine_results(a, TransferResult(default_config(quick=True, seed=5, steps=30), []))
    with pytest.raises(TransferConfigError, match="pass two or more"):
        combine_results(a)
    both = combine_results(a, TransferResult(default_config(quick=True, seed=17), []))
    assert both.config.seed_list == [0, 1, 17] and both.config.seeds == 3
    assert TransferConfig(seed_values=(4, 3)).seed_values == ()  # consecutive: seed, seeds
    with pytest.raises(TransferConfigError, match="distinct non-negative"):
        TransferConfig(seed_values=(1, 1))


TINY = {"steps": 4, "eval_every": 2, "eval_batches": 1, "batch_size": 2, "seq_len": 16}


def _same_runs(a: list, b: list) -> None:  # type: ignore[type-arg]
    keys = ("parametrisation", "precision", "seed", "width", "depth", "lr_step", "lr", "evals",
            "final_train_loss", "stopped_at", "data_digest")  # fmt: skip
    assert [[getattr(r, k) for k in keys] for r in a] == [[getattr(r, k) for k in keys] for r in b]


@pytest.mark.slow
def test_two_sweeps_combined_equal_one_sweep_over_both_seeds(
    single_thread: None, tmp_path: Path
) -> None:
    config = default_config(quick=True, **TINY, seed=5, seeds=2, widths=(32, 64), lr_steps=(0, 1))
    both = run_transfer(config)
    parts = [run_transfer(replace(config, seed=s, seeds=1)) for s in (5, 6)]
    combined = combine_results(*parts)
    assert combined.config == config
    # FP32: run for run, loss for loss; FP8: re-run where the combined best moved
    fp32 = [r for r in combined.runs if r.precision == "fp32"]
    _same_runs(fp32, [r for r in both.runs if r.precision == "fp32"])
    rerun, _ = rerun_fp8(combined)
    assert fp8_not_at_best(final_frame(runs_frame(rerun.runs))) == []
    _same_runs(rerun.runs, both.runs)
    # An FP8 run off the combined best (as a part's own best can be): exactly it is re-run.
    off = [replace(r, lr_step=1 - r.lr_step) if (r.precision, r.seed, r.width) == ("fp8", 6, 64)
           else r for r in rerun.runs]  # fmt: skip
    stale = fp8_not_at_best(final_frame(runs_frame(off)))
    assert [(s, w) for s, w, _, _ in stale] == [(6, 64)]
    assert evaluate_claims(final_frame(runs_frame(off)))[3].verdict == "not evaluated"
    assert "claim 4 not comparable until re-run" in summary_text(replace(rerun, runs=off))
    again_, done = rerun_fp8(replace(rerun, runs=off))
    assert done == stale
    _same_runs(again_.runs, both.runs)
    assert summary_text(rerun).split("\ntime:")[0] == summary_text(both).split("\ntime:")[0]
    # written and loaded back: the same CSV bytes and the same claims
    write_transfer_outputs(both, tmp_path / "a")
    loaded = load_transfer(tmp_path / "a")
    write_transfer_outputs(loaded, tmp_path / "b")
    for name in ("transfer.csv", "transfer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    # the script: two folders in, the combined outputs out
    for part, seed in zip(parts, (5, 6), strict=True):
        write_transfer_outputs(part, tmp_path / f"seed{seed}")
    script = ROOT / "benchmarks" / "transfer_combine_seeds.py"
    args = [str(tmp_path / "seed5"), str(tmp_path / "seed6"), "--out", str(tmp_path / "c")]
    ran = subprocess.run([sys.executable, str(script), *args, "--rerun-fp8"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert "seeds 5-6 (losses: means over seeds)" in ran.stdout
    again = load_transfer(tmp_path / "c")
    assert [r.final_heldout_loss for r in again.runs] == pytest.approx(
        [r.final_heldout_loss for r in both.runs], rel=0, abs=0, nan_ok=True
    )
