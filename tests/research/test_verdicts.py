"""research/verdicts: known answers. The scaling fit recovers a law it was given and is no worse a least-squares fit
than scipy's curve_fit started at the truth; speedup reads k back from a loss reached with k× the data; the bootstrap
covers the truth, repeats itself and narrows with less noise, its t draws give the t interval of a contender's mean
where the baseline is exact and cover 95% at 3 seeds where resampling them covers ~75%; lr_optimum finds an exact
parabola's vertex and flags edges, divergence and a downward parabola; lr_band reads the lrs within a tolerance of
the best off a hand-worked scan; speedup_trend recovers a known plane in log width and log tokens per parameter,
refuses points on one line, and its standard errors match the estimates' spread over noise draws; speedup_slope
recovers an exact power of width, matches a two-width slope's standard error and a three-width reduced χ² worked by
hand and the spread of its estimates over heteroscedastic noise; fit_check's lack-of-fit F matches a hand-worked
case, is calibrated under a true law (5% of p below 0.05) and rejects the accelerating curve AdamW drew at d_model
32; interpolated_data reads hand-worked crossings (the first one where the means rise again) and a dense power law's
inverse; Welch's statistic and degrees of freedom match the formulas written here in NumPy; Holm's adjustment matches
a hand-worked family and pairwise holds the family-wise error under a null; spread_ratio matches F(2, 2)'s closed form
and a pooled variance worked by hand, ignores a shift between groups and holds its level under a null; the
performance profile matches a hand-worked example. The whole chains to the ladder's exponents (se_log →
speedup_slope → Knapp–Hartung; stage D's points → speedup_trend) cover 95% on simulated ladders."""

import math

import numpy as np
import pytest
from scipy import optimize, stats

from research.verdicts import (
    LrBand,
    PowerLaw,
    bootstrap_speedup,
    compare,
    extrapolates,
    fit_check,
    fit_power_law,
    holm,
    interpolated_data,
    lr_band,
    lr_optimum,
    optimum_table,
    pairwise,
    performance_profile,
    profile_area,
    speedup,
    speedup_slope,
    speedup_trend,
    spread_ratio,
    transfer_slope,
)

LAW = PowerLaw(alpha=1e3, exponent=0.35, floor=2.0)
BUDGETS = np.array([1.0, 2.0, 4.0, 8.0, 16.0]) * 1e8  # 1-16x a budget, as the paper's 1-8x Chinchilla ladder
TOKENS = 4e8  # the contender's budget


def relative(a, b):
  return abs(a - b) / abs(b)


@pytest.mark.parametrize("law", [LAW, PowerLaw(alpha=30.0, exponent=0.12, floor=1.1)])
def test_the_fit_recovers_a_noise_free_law(law):
  fit = fit_power_law(BUDGETS, law.loss(BUDGETS))
  assert relative(fit.alpha, law.alpha) < 1e-4
  assert relative(fit.exponent, law.exponent) < 1e-4
  assert relative(fit.floor, law.floor) < 1e-4
  assert fit.tokens_range == (1e8, 1.6e9)


def test_with_small_noise_the_fit_is_close_and_at_least_as_good_as_curve_fit_from_the_truth():
  tokens = np.repeat(BUDGETS, 3)  # three seeds per budget: repeated token counts
  noise = 2e-3
  losses = LAW.loss(tokens) + np.random.default_rng(0).normal(0, noise, tokens.size)
  fit = fit_power_law(tokens, losses)
  assert 0 <= fit.floor < losses.min()
  assert np.abs(fit.loss(BUDGETS) - LAW.loss(BUDGETS)).max() < 2 * noise
  # scipy's own least squares, started at the true parameters, tokens in units of 1e8 (α' = α·1e8^-B)
  model = lambda d, a, b, f: a * d ** -b + f
  truth = np.array([LAW.alpha * 1e8**-LAW.exponent, LAW.exponent, LAW.floor])
  p, cov = optimize.curve_fit(model, tokens / 1e8, losses, p0=truth)
  sse = lambda law: float(((law.loss(tokens) - losses) ** 2).sum())
  assert sse(fit) <= float(((model(tokens / 1e8, *p) - losses) ** 2).sum()) * (1 + 1e-9)
  ours = np.array([fit.alpha * 1e8**-fit.exponent, fit.exponent, fit.floor])
  assert np.all(np.abs(ours - truth) < 3 * np.sqrt(np.diag(cov)))  # within 3 standard errors of the truth


@pytest.mark.parametrize("k", [0.5, 0.8, 1.25, 2.0, 3.0])
def test_speedup_is_the_data_multiple_at_equal_loss(k):
  fit = fit_power_law(BUDGETS, LAW.loss(BUDGETS))
  assert speedup(fit, LAW.loss(k * TOKENS), TOKENS) == pytest.approx(k, rel=1e-6)
  assert speedup(LAW, LAW.loss(k * TOKENS), TOKENS) == pytest.approx(k, rel=1e-12)
  assert not extrapolates(fit, LAW.loss(k * TOKENS))  # 0.5 x 4e8 ... 3 x 4e8 lie within 1e8 ... 1.6e9


def test_extrapolation_is_flagged_and_a_loss_below_the_floor_is_never_reached():
  fit = fit_power_law(BUDGETS, LAW.loss(BUDGETS))
  assert extrapolates(fit, LAW.loss(8 * TOKENS)) and extrapolates(fit, LAW.loss(0.1 * TOKENS))
  assert speedup(fit, LAW.loss(8 * TOKENS), TOKENS) == pytest.approx(8, rel=1e-6)  # returned all the same
  assert not extrapolates(LAW, LAW.loss(100 * TOKENS))  # a hand-written law has no fitted range
  assert LAW.data_for(2.0) == math.inf and speedup(LAW, 1.9, TOKENS) == math.inf and math.isnan(LAW.data_for(math.nan))
  assert LAW.data_for(LAW.loss(TOKENS)) == pytest.approx(TOKENS, rel=1e-12)


@pytest.mark.parametrize("tokens", [[1e8, 2e8], [1e8, 1e8, 2e8, 2e8, 2e8]])
def test_fewer_than_three_budgets_is_refused(tokens):
  with pytest.raises(ValueError, match="at least 3 distinct token budgets"):
    fit_power_law(tokens, LAW.loss(np.asarray(tokens)))
  with pytest.raises(ValueError, match="at least 3 distinct token budgets"):
    bootstrap_speedup({t: [LAW.loss(t)] * 2 for t in tokens}, [2.5, 2.6], TOKENS)


def test_bad_fit_input_is_refused():
  with pytest.raises(ValueError, match="finite"):
    fit_power_law(BUDGETS, [3.0, 2.9, math.nan, 2.7, 2.6])
  with pytest.raises(ValueError, match="positive"):
    fit_power_law([0.0, 1.0, 2.0], [3.0, 2.9, 2.8])
  with pytest.raises(ValueError, match="5 token counts but 4 losses"):
    fit_power_law(BUDGETS, [3.0, 2.9, 2.8, 2.7])


def noisy_ladder(noise: float, k: float = 1.4, seeds: int = 5):
  """The baseline's final losses (budget -> seeds) and a contender's at TOKENS with k x the baseline's efficiency."""
  z = np.random.default_rng(7).standard_normal((len(BUDGETS) + 1, seeds))
  baseline = {float(d): list(LAW.loss(d) + noise * z[i]) for i, d in enumerate(BUDGETS)}
  return baseline, list(LAW.loss(k * TOKENS) + noise * z[-1])


def test_the_bootstrap_interval_covers_the_truth_and_repeats_itself():
  baseline, contender = noisy_ladder(0.01)
  interval = bootstrap_speedup(baseline, contender, TOKENS, n_resamples=500, seed=3)
  assert interval.low < 1.4 < interval.high and interval.low < interval.estimate < interval.high
  assert interval.n_resamples == 500 and not interval.extrapolated
  means = [float(np.mean(baseline[d])) for d in sorted(baseline)]
  assert interval.estimate == speedup(fit_power_law(sorted(baseline), means), float(np.mean(contender)), TOKENS)
  assert bootstrap_speedup(baseline, contender, TOKENS, n_resamples=500, seed=3) == interval
  assert bootstrap_speedup(baseline, contender, TOKENS, n_resamples=500, seed=4) != interval


def test_the_bootstrap_interval_narrows_when_the_noise_shrinks():
  wide = bootstrap_speedup(*noisy_ladder(0.01), TOKENS, n_resamples=300)
  narrow = bootstrap_speedup(*noisy_ladder(0.002), TOKENS, n_resamples=300)
  assert narrow.high - narrow.low < 0.5 * (wide.high - wide.low)
  assert narrow.low < 1.4 < narrow.high


def test_the_bootstrap_refuses_an_empty_sample_or_a_bad_confidence():
  baseline, contender = noisy_ladder(0.01)
  with pytest.raises(ValueError, match="no contender losses"):
    bootstrap_speedup(baseline, [], TOKENS)
  with pytest.raises(ValueError, match="no losses at baseline budget"):
    bootstrap_speedup({**baseline, 3.2e9: []}, contender, TOKENS)
  with pytest.raises(ValueError, match="confidence"):
    bootstrap_speedup(baseline, contender, TOKENS, confidence=1.0)
  with pytest.raises(ValueError, match="every contender loss must be finite"):
    bootstrap_speedup(baseline, contender + [math.nan], TOKENS)
  with pytest.raises(ValueError, match="every loss must be finite"):
    bootstrap_speedup({**baseline, 1e8: [3.5, math.inf]}, contender, TOKENS)


GRID = np.geomspace(1e-4, 1e-1, 7)  # lrs a factor 10^0.5 apart


def parabola(lrs, best_lr, bottom=2.0, curvature=0.6):
  return bottom + 0.5 * curvature * (np.log(lrs) - np.log(best_lr)) ** 2


def test_lr_optimum_finds_an_exact_parabolas_vertex():
  opt = lr_optimum(GRID, parabola(GRID, 3e-3))
  assert opt.fitted and not opt.at_edge
  assert opt.lr == pytest.approx(3e-3, rel=1e-9)
  assert opt.loss == pytest.approx(2.0, abs=1e-9) and opt.curvature == pytest.approx(0.6, rel=1e-9)


def test_lr_optimum_averages_seeds_first():
  lrs = np.concatenate([GRID, GRID])
  shift = np.concatenate([np.full(7, 0.01), np.full(7, -0.01)])  # two seeds that average to the parabola
  opt = lr_optimum(lrs, parabola(lrs, 3e-3) + shift)
  assert opt.fitted and opt.lr == pytest.approx(3e-3, rel=1e-9)


def test_an_optimum_at_the_grid_edge_is_flagged():
  outside = lr_optimum(GRID, parabola(GRID, 1e-5))  # below the grid: the vertex is outside the tried range
  assert outside.at_edge and not outside.fitted and outside.lr == GRID[0] and outside.curvature > 0
  inside = lr_optimum(GRID, parabola(GRID, 1.3e-4))  # best grid point is the smallest, the vertex just above it
  assert inside.at_edge and inside.fitted and inside.lr == pytest.approx(1.3e-4, rel=1e-9)
  top = lr_optimum(GRID, parabola(GRID, 1.0))
  assert top.at_edge and not top.fitted and top.lr == GRID[-1]


def test_diverged_runs_are_dropped():
  lrs = np.concatenate([GRID, [0.3, 1.0, 3e-3]])
  losses = np.concatenate([parabola(GRID, 3e-3), [math.nan, math.inf, math.nan]])
  assert lr_optimum(lrs, losses) == lr_optimum(GRID, parabola(GRID, 3e-3))
  with pytest.raises(ValueError, match="every run diverged"):
    lr_optimum([1e-3, 1e-2], [math.nan, math.inf])


def test_a_downward_parabola_is_not_fitted():
  opt = lr_optimum(GRID, 3.0 - 0.1 * (np.log(GRID) - np.log(2e-3)) ** 2)
  assert not opt.fitted and opt.curvature < 0 and opt.at_edge
  assert opt.lr in (GRID[0], GRID[-1])
  two = lr_optimum(GRID[:2], parabola(GRID[:2], 3e-3))  # too few lrs for a parabola
  assert not two.fitted and two.lr == GRID[1] and math.isnan(two.curvature)


def test_lr_inverse_in_width_has_transfer_slope_minus_one():
  widths = [128, 256, 512, 1024]
  results = {w: {float(lr): [float(parabola(lr, 0.5 / w))] * 2 for lr in np.geomspace(1e-5, 1e-1, 9)}
             for w in widths}
  table = optimum_table(results)
  assert list(table) == widths and all(table[w].fitted for w in widths)
  assert [table[w].lr for w in widths] == pytest.approx([0.5 / w for w in widths], rel=1e-9)
  assert transfer_slope(widths, [table[w].lr for w in widths]) == pytest.approx(-1.0, abs=1e-9)
  assert transfer_slope(widths, [3e-3] * 4) == pytest.approx(0.0, abs=1e-12)
  with pytest.raises(ValueError, match="width 256: lr_optimum: every run diverged"):
    optimum_table({128: results[128], 256: {1e-3: [math.nan]}})
  with pytest.raises(ValueError, match="two distinct widths"):
    transfer_slope([128, 128], [1e-3, 1e-3])


def test_compare_finds_a_large_difference_and_not_a_null_one():
  rng = np.random.default_rng(0)
  lower, higher = rng.normal(3.00, 0.01, 5), rng.normal(3.10, 0.01, 5)
  result = compare(lower, higher)
  assert result.p_value < 0.01 and result.diff < 0 and result.test == "Welch t, one-sided"
  assert compare(higher, lower).p_value > 0.99
  assert compare(lower, higher, alternative="two-sided").test == "Welch t, two-sided"
  # under the null (one distribution), p is uniform: about 5% of pairs fall below 0.05, not more
  null = [compare(x, y).p_value for x, y in np.random.default_rng(1).normal(3.0, 0.01, (2000, 2, 5))]
  assert 0.035 < np.mean(np.asarray(null) < 0.05) < 0.065 and 0.45 < np.median(null) < 0.55
  tie = compare(lower, lower)
  assert tie.statistic == 0 and tie.p_value == pytest.approx(0.5)


def test_compare_matches_welchs_formulas():
  a, b = np.array([3.10, 3.00, 3.20, 3.05]), np.array([3.30, 3.10, 3.25, 3.40, 3.20, 3.35])
  va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
  t = (a.mean() - b.mean()) / np.sqrt(va + vb)
  df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
  result = compare(a, b)
  assert result.statistic == pytest.approx(t, rel=1e-12) and result.df == pytest.approx(df, rel=1e-12)
  assert result.p_value == pytest.approx(stats.t.cdf(t, df), rel=1e-10)
  assert (result.mean_a, result.mean_b) == pytest.approx((a.mean(), b.mean()))


def test_compare_refuses_too_few_seeds_or_a_diverged_one():
  with pytest.raises(ValueError, match="at least 2 values per sample"):
    compare([3.0], [3.1, 3.2])
  with pytest.raises(ValueError, match="finite"):
    compare([3.0, math.nan], [3.1, 3.2])
  with pytest.raises(ValueError, match="alternative"):
    compare([3.0, 3.1], [3.1, 3.2], alternative="lower")


def test_spread_ratio_matches_f_2_2s_closed_form_and_pools_groups_about_their_own_means():
  # variances 1 and 4 on (2, 2) df: F(2, 2)'s CDF is x / (1 + x), so P(F <= 1/4) = 0.2
  r = spread_ratio([[1.0, 2.0, 3.0]], [[1.0, 3.0, 5.0]], alternative="less")
  assert (r.var_a, r.var_b, r.ratio, r.df_a, r.df_b) == pytest.approx((1.0, 4.0, 0.25, 2, 2))
  assert r.p_value == pytest.approx(0.2, rel=1e-12) and r.test == "F, one-sided"
  assert spread_ratio([[1.0, 2.0, 3.0]], [[1.0, 3.0, 5.0]]).p_value == pytest.approx(0.4, rel=1e-12)
  assert spread_ratio([[1.0, 2.0, 3.0]], [[1.0, 3.0, 5.0]], alternative="greater").p_value == pytest.approx(0.8)
  # pooled: squares about each group's mean 0.5 and 2 over 1 + 1 df; a lone value adds nothing; a shift, nothing
  pooled = spread_ratio([[0.0, 1.0], [10.0, 12.0], [7.0]], [[5.0, 6.0], [100.0, 101.0]])
  assert (pooled.var_a, pooled.df_a, pooled.var_b, pooled.df_b) == pytest.approx((1.25, 2, 0.5, 2))
  assert spread_ratio([[0.0, 1.0], [10.0, 12.0]], [[0.0, 1.0], [10.0, 12.0]]).ratio == pytest.approx(1.0)


def test_spread_ratio_holds_its_level_under_a_null_and_finds_a_five_fold_variance():
  rng = np.random.default_rng(3)  # 4 widths x 3 seeds each, as the ladder has; means differ between widths
  shift = np.array([1.6, 1.4, 1.2, 1.1])[:, None]
  draw = lambda sd: shift + rng.normal(0.0, sd, (4, 3))
  null = np.array([spread_ratio(draw(0.01), draw(0.01)).p_value for _ in range(2000)])
  assert 0.035 < np.mean(null < 0.05) < 0.065
  found = np.array([spread_ratio(draw(0.01), draw(0.01 * 5**0.5), alternative="less").p_value for _ in range(500)])
  assert np.mean(found < 0.05) > 0.6  # F(8, 8) at a true ratio of 1/5: power ~0.7


def test_spread_ratio_refuses_a_diverged_seed_no_pair_or_an_unknown_alternative():
  with pytest.raises(ValueError, match="finite"):
    spread_ratio([[1.0, math.inf]], [[1.0, 2.0]])
  with pytest.raises(ValueError, match="at least 2 values"):
    spread_ratio([[1.0], [2.0]], [[1.0, 2.0]])
  with pytest.raises(ValueError, match="alternative"):
    spread_ratio([[1.0, 2.0]], [[1.0, 2.0]], alternative="lower")
  assert math.isnan(spread_ratio([[1.0, 1.0]], [[2.0, 2.0]]).p_value)  # no spread on either side: no verdict


# best per problem: p1 10 (A), p2 20 (A, B), p3 15 (B), p4 5 (B); A fails p4 (NaN), C fails p3 (inf) and lacks p4
COSTS = {"A": {"p1": 10.0, "p2": 20.0, "p3": 30.0, "p4": math.nan},
         "B": {"p1": 20.0, "p2": 20.0, "p3": 15.0, "p4": 5.0},
         "C": {"p1": 40.0, "p2": 50.0, "p3": math.inf}}
# ratios: A 1, 1, 2, inf; B 2, 1, 1, 1; C 4, 2.5, inf, inf


def test_performance_profile_of_a_hand_example():
  taus = [1.0, 1.5, 2.0, 3.0, 4.0, 10.0]
  rho = performance_profile(COSTS, taus)
  np.testing.assert_array_equal(rho["A"], [0.5, 0.5, 0.75, 0.75, 0.75, 0.75])
  np.testing.assert_array_equal(rho["B"], [0.75, 0.75, 1.0, 1.0, 1.0, 1.0])
  np.testing.assert_array_equal(rho["C"], [0.0, 0.0, 0.0, 0.25, 0.5, 0.5])
  nobody = performance_profile({m: {**c, "p5": math.inf} for m, c in COSTS.items()}, [10.0])
  assert [float(nobody[m][0]) for m in "ABC"] == [0.6, 0.8, 0.4]  # a problem no method solved still counts


def test_profile_area_is_the_normalised_integral():
  area = profile_area(COSTS)
  assert area == pytest.approx({"A": 8 / 12, "B": 11 / 12, "C": 1.5 / 12}, rel=1e-12)
  taus = np.linspace(1, 4, 300_001)
  for method, rho in performance_profile(COSTS, taus).items():
    assert area[method] == pytest.approx(np.trapezoid(rho, taus) / 3, abs=1e-5)
  with pytest.raises(ValueError, match="positive"):
    performance_profile({"A": {"p1": 0.0}}, [1.0])


def test_the_relative_speedup_cancels_a_fit_biased_at_the_contenders_budget():
  """relative=True divides by the baseline's own point on its fit: on an exact law it equals the plain speedup; when
  the baseline at TOKENS sits below the law (its fit then reads it as a speedup of its own), the baseline read
  against itself is exactly 1, and the contender's plain speedup over the baseline's own reading is the relative one."""
  exact = {float(d): [LAW.loss(d)] * 3 for d in BUDGETS}
  k_loss = [LAW.loss(1.4 * TOKENS)] * 3
  plain = bootstrap_speedup(exact, k_loss, TOKENS, n_resamples=20)
  rel = bootstrap_speedup(exact, k_loss, TOKENS, n_resamples=20, relative=True)
  assert rel.estimate == pytest.approx(plain.estimate, rel=1e-6) == pytest.approx(1.4, rel=1e-4)
  biased = {**exact, TOKENS: [LAW.loss(TOKENS) - 0.02] * 3}
  own = bootstrap_speedup(biased, biased[TOKENS], TOKENS, n_resamples=20)
  assert own.estimate > 1.01  # the fit does not pass through the lowered point: the baseline "beats" itself
  assert bootstrap_speedup(biased, biased[TOKENS], TOKENS, n_resamples=20, relative=True).estimate == pytest.approx(1.0)
  plain = bootstrap_speedup(biased, k_loss, TOKENS, n_resamples=20)
  rel = bootstrap_speedup(biased, k_loss, TOKENS, n_resamples=20, relative=True)
  assert rel.estimate == pytest.approx(plain.estimate / own.estimate, rel=1e-9)
  # the resamples: with the baseline noise-free, every resample's fit is the same, so each relative draw is the plain
  # draw over the same constant, and so are the interval's ends (the same seed draws the same contender seeds)
  noisy = [LAW.loss(1.4 * TOKENS) + e for e in (-0.03, 0.0, 0.02)]
  plain = bootstrap_speedup(biased, noisy, TOKENS, n_resamples=200, seed=3)
  rel = bootstrap_speedup(biased, noisy, TOKENS, n_resamples=200, seed=3, relative=True)
  assert plain.high > plain.low and (rel.low, rel.high) == pytest.approx(
      (plain.low / own.estimate, plain.high / own.estimate), rel=1e-9)
  # jointly: a noise-free contender at the baseline's own mean at TOKENS reads exactly 1 on the full data, and a
  # spread around 1 over the resamples, as the baseline's mean there moves in each (a denominator kept at the full
  # data's mean would read 1 in every resample)
  shaky = {**exact, TOKENS: [LAW.loss(TOKENS) + e for e in (-0.03, 0.0, 0.03)]}
  same = bootstrap_speedup(shaky, [float(np.mean(shaky[TOKENS]))] * 3, TOKENS, n_resamples=200, relative=True)
  assert same.estimate == pytest.approx(1.0) and same.low < 0.99 and same.high > 1.01
  with pytest.raises(ValueError, match="relative needs the baseline"):
    bootstrap_speedup(exact, k_loss, 3e8, relative=True)


def test_the_lr_band_is_where_the_scans_loss_is_within_the_tolerance_of_its_best():
  lrs = [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2]
  losses = [1.50, 1.30, 1.28, 1.29, 1.60]  # flat on the right, steep on the left
  band = lr_band(lrs, losses, 0.02)  # level 1.30: 2e-3 exactly; right of 8e-3, 1/31 of the way (in log lr) to 1.6e-2
  assert band.low == pytest.approx(2e-3, rel=1e-12) and not band.open_low
  assert band.high == pytest.approx(8e-3 * 2 ** (0.01 / 0.31), rel=1e-12) and not band.open_high
  exact = lr_band(lrs, losses, 0.0)
  assert (exact.low, exact.high) == pytest.approx((4e-3, 4e-3), rel=1e-12) and exact.open_low == exact.open_high == 0
  wide = lr_band(lrs, losses, 0.5)  # every lr is within: the band reaches both ends of the scan
  assert (wide.low, wide.high, wide.open_low, wide.open_high) == (1e-3, 1.6e-2, True, True)
  seeds = lr_band(lrs + [4e-3], losses + [1.30], 0.0)  # 4e-3's two seeds average to 1.29, as 8e-3 does
  assert (seeds.low, seeds.high) == pytest.approx((4e-3, 8e-3), rel=1e-12)
  for diverged in (math.inf, math.nan):  # 1.6e-2 diverged: however wide the tolerance, the band ends at 8e-3
    band = lr_band(lrs, losses[:-1] + [diverged], 0.5)
    assert band.high == 8e-3 and not band.open_high and band == LrBand(1e-3, 8e-3, True, False)
  with pytest.raises(ValueError, match="non-negative"):
    lr_band(lrs, losses, -0.1)


def test_speedup_trend_recovers_a_known_plane_and_parts_width_from_data():
  widths, tpp = np.meshgrid([32.0, 64.0, 128.0, 256.0], [0.5, 1.0, 2.5, 5.0])
  truth = np.exp(0.4) * widths ** -0.15 * tpp ** -0.2
  t = speedup_trend(widths, tpp, truth)
  assert t.width_exponent == pytest.approx(-0.15, abs=1e-12) and t.data_exponent == pytest.approx(-0.2, abs=1e-12)
  assert t.intercept == pytest.approx(0.4, abs=1e-12) and t.points == 16 and t.width_se < 1e-12
  ladder = ([32, 64, 128, 256], [20.0, 10.0, 5.0, 2.5])  # tokens per parameter halving as width doubles: one line
  with pytest.raises(ValueError, match="independently"):
    speedup_trend(*ladder, [1.5, 1.4, 1.3, 1.2])
  with pytest.raises(ValueError, match="positive and finite"):
    speedup_trend([32, 64, 128], [1.0, 2.0, 1.0], [1.2, math.inf, 1.1])


def test_speedup_trends_standard_error_is_the_estimates_spread_over_noise_draws():
  widths, tpp = (a.ravel() for a in np.meshgrid([32.0, 64.0, 128.0, 256.0], [0.5, 1.0, 2.5, 5.0]))
  clean = 0.4 - 0.15 * np.log(widths) - 0.2 * np.log(tpp)
  rng = np.random.default_rng(0)
  fits = [speedup_trend(widths, tpp, np.exp(clean + rng.normal(0, 0.05, clean.size))) for _ in range(2000)]
  spread = np.std([f.width_exponent for f in fits]), np.std([f.data_exponent for f in fits])
  mean_se = np.mean([f.width_se for f in fits]), np.mean([f.data_se for f in fits])
  assert mean_se == pytest.approx(spread, rel=0.1)
  assert np.mean([f.width_exponent for f in fits]) == pytest.approx(-0.15, abs=0.01)


def test_speedup_slope_recovers_an_exact_power_and_a_hand_worked_standard_error():
  widths = np.array([32.0, 64.0, 128.0, 256.0])
  truth = 1.5 * widths**-0.2
  s = speedup_slope(widths, truth, [0.05, 0.1, 0.08, 0.2])
  assert s.exponent == pytest.approx(-0.2, abs=1e-12) and s.points == 4
  assert s.reduced_chi2 == pytest.approx(0, abs=1e-20)
  assert s.scaled_se == s.se  # no scatter beyond the errors: the error is not inflated
  # two widths, each σ = 0.1 in log speedup: slope (y₂ − y₁) / log 4, its variance (σ₁² + σ₂²) / (log 4)²
  two = speedup_slope([32, 128], [1.2, 1.8], [0.1, 0.1])
  assert two.exponent == pytest.approx(math.log(1.8 / 1.2) / math.log(4), rel=1e-12)
  assert two.se == pytest.approx(math.sqrt(0.02) / math.log(4), rel=1e-12) and math.isnan(two.reduced_chi2)
  # a third width 4σ off the line: the residuals, worked by hand, give χ²/1 and widen the error by its root
  off = speedup_slope([32, 64, 128], [1.2, 1.2 * 1.5**0.5 * np.exp(0.4), 1.8], [0.1] * 3)
  assert off.exponent == pytest.approx(math.log(1.5) / math.log(4), rel=1e-9)
  # the weighted mean of y shifts by 0.4/3: residuals (−0.4/3, +0.8/3, −0.4/3), each weighted by 1/0.01
  assert off.reduced_chi2 == pytest.approx((2 * (0.4 / 3) ** 2 + (0.8 / 3) ** 2) / 0.01, rel=1e-9)
  assert off.scaled_se == pytest.approx(off.se * math.sqrt(off.reduced_chi2), rel=1e-12)


def test_speedup_slopes_standard_error_is_the_estimates_spread_over_heteroscedastic_noise():
  widths, sigma = np.array([32.0, 64.0, 128.0, 256.0]), np.array([0.02, 0.05, 0.05, 0.12])
  clean = 0.5 - 0.1 * np.log(widths)
  rng = np.random.default_rng(0)
  fits = []
  for _ in range(4000):
    fits.append(speedup_slope(widths, np.exp(clean + rng.normal(0, sigma)), sigma))
  exps = np.array([f.exponent for f in fits])
  assert fits[0].se == pytest.approx(np.std(exps), rel=0.05) and np.mean(exps) == pytest.approx(-0.1, abs=0.005)
  assert np.mean([f.reduced_chi2 for f in fits]) == pytest.approx(1.0, abs=0.05)  # χ² on 2 degrees of freedom, / 2
  ols = np.std([np.polyfit(np.log(widths), np.log(f), 1)[0] for f in
                (np.exp(clean + rng.normal(0, sigma)) for _ in range(4000))])
  assert fits[0].se < ols  # weighting by the errors beats equal weights when the noise differs by width


def test_speedup_slope_refuses_bad_input():
  with pytest.raises(ValueError, match="two distinct widths"):
    speedup_slope([64, 64], [1.2, 1.3], [0.1, 0.1])
  with pytest.raises(ValueError, match="positive and finite"):
    speedup_slope([32, 64], [1.2, 1.3], [0.1, 0.0])
  with pytest.raises(ValueError, match="positive and finite"):
    speedup_slope([32, 64], [1.2, 1.3], [0.1, math.inf])
  with pytest.raises(ValueError, match="2 widths, 1 speedups"):
    speedup_slope([32, 64], [1.2], [0.1])


def test_fit_check_of_a_law_through_every_mean_and_a_hand_worked_miss():
  through = {d: [LAW.loss(d) - 0.01, LAW.loss(d), LAW.loss(d) + 0.01] for d in BUDGETS}
  c = fit_check(LAW, through)
  assert c.f_statistic < 1e-20 and c.p_value == pytest.approx(1) and np.allclose(c.z, 0) and c.floor_bound is None
  assert c.df == (2, 10) and c.tokens == tuple(BUDGETS)
  # 4 budgets × 2 seeds at ±s around mean = law + dᵢ: pure error 8s² on 4 df, lack of fit Σ 2dᵢ² on 1 df
  s, d = 0.02, np.array([0.01, -0.03, 0.02, 0.005])
  missed = {b: [LAW.loss(b) + di - s, LAW.loss(b) + di + s] for b, di in zip(BUDGETS[:4], d)}
  c = fit_check(LAW, missed)
  f = np.sum(2 * d**2) / 1 / (8 * s**2 / 4)
  assert c.df == (1, 4) and c.f_statistic == pytest.approx(f, rel=1e-9)
  assert c.p_value == pytest.approx(stats.f.sf(f, 1, 4), rel=1e-9)
  assert np.allclose(c.z, d / s, rtol=1e-9)  # the standard error of a mean of 2 at pooled variance 2s²: s
  assert np.allclose(c.stds, s * math.sqrt(2)) and np.allclose(np.subtract(c.means, c.fitted), d)
  assert np.allclose(c.z_own, d / s)  # each budget's own std s·√2 over √2 seeds: the same s
  assert c.p_own == pytest.approx(min(1, 4 * 2 * stats.t.sf(0.03 / s, 1)), rel=1e-9)  # the worst, Bonferroni ×4
  # unequal seed counts (2, 3, 2, 3): pure error Σ(nᵢ − 1)·varᵢ on 6 df, lack of fit Σ nᵢ·dᵢ² on 1, z at √(mse / nᵢ)
  uneven = {b: [LAW.loss(b) + di + e for e in ((-s, s) if k % 2 == 0 else (-s, 0.0, s))]
            for k, (b, di) in enumerate(zip(BUDGETS[:4], d))}
  c = fit_check(LAW, uneven)
  n, var = np.array([2, 3, 2, 3]), np.array([2 * s**2, s**2] * 2)
  mse = np.sum((n - 1) * var) / 6
  assert c.df == (1, 6) and c.f_statistic == pytest.approx(np.sum(n * d**2) / mse, rel=1e-9)
  assert np.allclose(c.z, d / np.sqrt(mse / n), rtol=1e-9)


def test_fit_check_is_calibrated_under_a_true_law_and_rejects_adamws_curve_at_width_32():
  rng = np.random.default_rng(0)
  ps = []
  for _ in range(300):
    runs = {d: LAW.loss(d) + rng.normal(0, 0.01, 3) for d in BUDGETS}
    ps.append(fit_check(fit_power_law(list(runs), [r.mean() for r in runs.values()]), runs).p_value)
  assert np.mean(np.array(ps) < 0.05) == pytest.approx(0.05, abs=0.03)
  # AdamW's means at d_model 32 over 1/8 .. 1 of its tokens: each halving costs less than the one after it, a shape a
  # power law with a floor ≥ 0 cannot follow (its floor hits 0); seeds spread ±0.01
  means = [2.677, 2.405, 2.044, 1.626]
  runs = {1.234944e6 * 2.0**k: [m - 0.01, m, m + 0.01] for k, m in zip(range(-3, 1), means)}
  c = fit_check(fit_power_law(list(runs), means), runs)
  assert c.p_value < 1e-6 and c.floor_bound == "zero" and max(abs(z) for z in c.z) > 5
  assert c.df == (2, 8)  # the floor held at 0 is not a fitted parameter
  # a floor at its upper bound (the lowest mean) is flagged; a true law whose floor lies between the lowest seed and
  # the lowest mean is not
  risen = {b: [m - 0.01, m + 0.01] for b, m in zip(BUDGETS, [3.0, 2.5, 2.0, 2.1, 2.2])}
  c = fit_check(fit_power_law(list(risen), [np.mean(r) for r in risen.values()]), risen)
  assert c.floor_bound == "lowest loss" and c.df == (3, 5)
  near = PowerLaw(alpha=1e3, exponent=0.5, floor=1.5)  # 1.525 at the largest budget, seeds ±0.05
  close = {b: [float(near.loss(b)) - 0.05, float(near.loss(b)), float(near.loss(b)) + 0.05] for b in BUDGETS}
  c = fit_check(fit_power_law(list(close), [np.mean(r) for r in close.values()]), close)
  assert c.floor_bound is None and c.p_value == pytest.approx(1, abs=1e-6)
  with pytest.raises(ValueError, match="finite"):
    fit_check(LAW, {1e8: [2.5, math.inf], 2e8: [2.4, 2.41], 4e8: [2.3, 2.31]})


def test_fit_checks_null_rates_are_5_percent_for_alike_spreads_and_flag_spreads_that_differ():
  """Under the law with one spread at every budget the pooled F is exact: its simulated false-alarm rate is 5% within
  two binomial standard errors of 400 draws, and the Bonferroni-adjusted per-budget tests run at or below it; with
  spreads 18× apart (AdamW's at d_model 32) the per-budget tests' rate rises well past 5% (measured 14.5%): the
  fit's error from the noisy budgets lands on the quiet ones, which their own seeds do not see."""
  law = fit_power_law(BUDGETS, LAW.loss(BUDGETS))
  alike = {d: LAW.loss(d) + np.array([-0.01, 0.0, 0.01]) for d in BUDGETS}
  f_rate, own_rate = fit_check(law, alike, n_resamples=400, seed=1).null_rates
  assert abs(f_rate - 0.05) <= 2 * math.sqrt(0.05 * 0.95 / 400) and own_rate <= 0.05
  spread = np.array([0.145, 0.055, 0.008, 0.019, 0.009])
  unlike = {d: LAW.loss(d) + s * np.array([-1.0, 0.0, 1.0]) for d, s in zip(BUDGETS, spread)}
  assert fit_check(law, unlike, n_resamples=400, seed=1).null_rates[1] > 0.05 + 3 * math.sqrt(0.05 * 0.95 / 400)
  assert math.isnan(fit_check(law, alike).null_rates[0])  # not drawn by default
  three = {d: alike[d] for d in BUDGETS[:3]}  # 3 budgets, a free floor: the F has no df, so no rate; the other has
  f_rate, own_rate = fit_check(fit_power_law(BUDGETS[:3], LAW.loss(BUDGETS[:3])), three, n_resamples=50).null_rates
  assert math.isnan(f_rate) and 0 <= own_rate <= 1
  with pytest.raises(ValueError, match="at least 0"):
    fit_check(law, alike, n_resamples=-1)


def test_interpolated_data_reads_the_first_crossing_between_budgets():
  d = np.array([1.0, 2.0, 4.0, 8.0]) * 1e8
  assert interpolated_data(d, [3.0, 2.6, 2.4, 2.3], 2.5) == pytest.approx(2e8 * math.sqrt(2), rel=1e-12)
  assert interpolated_data(d, [3.0, 2.6, 2.4, 2.3], 2.4) == pytest.approx(4e8, rel=1e-12)
  assert interpolated_data(d, [3.0, 2.6, 2.4, 2.3], 2.2) == math.inf
  assert interpolated_data(d, [3.0, 2.6, 2.4, 2.3], 3.1) == 0.0
  assert interpolated_data(d, [3.0, 2.6, 2.4, 2.3], 3.0) == 1e8  # reached exactly at the smallest budget
  # the means rise again after 2e8: the first crossing (0.8 of the way from 1e8 to 2e8 in log tokens) counts
  assert interpolated_data(d, [3.0, 2.5, 2.7, 2.2], 2.6) == pytest.approx(1e8 * 2**0.8, rel=1e-12)
  dense = np.geomspace(1e8, 1.6e9, 65)  # a true law read between budgets 2^(1/16) apart: its inverse, within 0.1%
  assert interpolated_data(dense, LAW.loss(dense), float(LAW.loss(5e8))) == pytest.approx(5e8, rel=1e-3)
  with pytest.raises(ValueError, match="ascending"):
    interpolated_data([2e8, 1e8], [2.5, 2.6], 2.55)


def test_the_interpolated_bootstrap_collapses_without_noise_and_flags_a_loss_outside_the_budgets():
  same = {b: [float(LAW.loss(b))] * 3 for b in BUDGETS}
  iv = bootstrap_speedup(same, [float(LAW.loss(8e8))] * 3, 4e8, method="interpolate", n_resamples=50)
  assert iv.estimate == pytest.approx(2.0, rel=1e-12) and iv.low == iv.high == iv.estimate and not iv.extrapolated
  past = bootstrap_speedup(same, [float(LAW.loss(1e10))] * 3, 4e8, method="interpolate", n_resamples=50)
  assert past.estimate == math.inf and past.extrapolated
  short = bootstrap_speedup(same, [float(LAW.loss(5e7))] * 3, 4e8, method="interpolate", n_resamples=50)
  assert short.estimate == 0.0 and short.extrapolated  # worse than the baseline's smallest budget: a bound below
  with pytest.raises(ValueError, match="not with relative"):
    bootstrap_speedup(same, [2.5] * 3, 4e8, method="interpolate", relative=True)


def test_the_t_draws_give_the_contenders_t_interval_when_the_baseline_is_exact():
  """A baseline without noise leaves the contender's mean alone: its draws are t on n − 1 = 2 degrees of freedom, so
  the interval is the classical t interval of its mean loss, m ∓ t(0.975, 2)·s/√3, read off the baseline's runs."""
  same = {b: [float(LAW.loss(b))] * 3 for b in BUDGETS}
  mine = [float(LAW.loss(8e8)) + e for e in (-0.004, 0.001, 0.006)]
  m, half = np.mean(mine), stats.t.ppf(0.975, 2) * np.std(mine, ddof=1) / math.sqrt(3)
  means = [float(LAW.loss(b)) for b in BUDGETS]
  iv = bootstrap_speedup(same, mine, 4e8, method="interpolate", n_resamples=40000, seed=1)
  # the draws' 2.5% quantile of t(2) errs by ~2% of its value at 40000 draws: 0.03 on the loss offset
  lo_loss = np.interp(np.log(iv.high * 4e8), np.log(BUDGETS), means)  # the speedup's ends mapped back to losses
  hi_loss = np.interp(np.log(iv.low * 4e8), np.log(BUDGETS), means)
  assert (m - lo_loss) / half == pytest.approx(1.0, abs=0.03) and (hi_loss - m) / half == pytest.approx(1.0, abs=0.03)
  seeds = bootstrap_speedup(same, mine, 4e8, method="interpolate", n_resamples=2000, seed=1, draws="seeds")
  assert iv.low < seeds.low and seeds.high < iv.high  # resampling 3 seeds spans no more than their range
  with pytest.raises(ValueError, match="two contender seeds"):
    bootstrap_speedup(same, mine[:1], 4e8, method="interpolate")
  with pytest.raises(ValueError, match="draws must be"):
    bootstrap_speedup(same, mine, 4e8, draws="normal")


def test_se_log_is_the_delta_method_at_each_means_own_error_and_matches_the_estimates_spread():
  """With the baseline exact, se_log is half the log-speedup change across the contender's mean ± its standard error,
  read off the baseline's runs; over 1500 noisy ladders its root-mean-square matches the spread of the log estimate
  within 10%, and over 300 on the fit ÷ the baseline's own point (a noisier one) within 12%; at the edge of the
  baseline's runs the side that stays inside stands in, one-sided; identical seeds give an interval and an error of
  exactly nothing."""
  same = {b: [float(LAW.loss(b))] * 3 for b in BUDGETS}
  mine = [float(LAW.loss(8e8)) + e for e in (-0.004, 0.001, 0.006)]
  h = np.std(mine, ddof=1) / math.sqrt(3)
  up, down = (interpolated_data(BUDGETS, LAW.loss(BUDGETS), float(np.mean(mine)) + x) for x in (h, -h))
  iv = bootstrap_speedup(same, mine, 4e8, method="interpolate", n_resamples=1)
  assert iv.se_log == pytest.approx(abs(math.log(up / down)) / 2, rel=1e-12)
  rng = np.random.default_rng(2)
  logs, ses = [], []
  for _ in range(1500):
    base = {b: list(LAW.loss(b) + 0.003 * rng.standard_normal(3)) for b in BUDGETS[:4]}
    iv = bootstrap_speedup(base, list(LAW.loss(4e8) + 0.003 * rng.standard_normal(3)), 2e8, method="interpolate",
                           n_resamples=1)
    logs.append(math.log(iv.estimate))
    ses.append(iv.se_log)
  assert math.sqrt(np.mean(np.square(ses))) == pytest.approx(np.std(logs), rel=0.1)
  logs, ses = [], []  # on the fit ÷ the baseline's own point, that point 3× noisier: moved in both at once
  for _ in range(300):
    base = {b: list(LAW.loss(b) + (0.009 if b == 4e8 else 0.003) * rng.standard_normal(3)) for b in BUDGETS}
    iv = bootstrap_speedup(base, list(LAW.loss(8e8) + 0.003 * rng.standard_normal(3)), 4e8, relative=True,
                           n_resamples=1)
    logs.append(math.log(iv.estimate))
    ses.append(iv.se_log)
  assert math.sqrt(np.mean(np.square(ses))) == pytest.approx(np.std(logs), rel=0.12)
  edge = [float(LAW.loss(15.5e8)) + e for e in (-0.03, 0.0, 0.03)]  # one standard error down leaves the budgets
  h, m = 0.03 / math.sqrt(3), float(np.mean(edge))
  assert interpolated_data(BUDGETS, LAW.loss(BUDGETS), m - h) == math.inf  # so the upper side alone stands in
  iv = bootstrap_speedup(same, edge, 4e8, method="interpolate", n_resamples=1)
  read = lambda loss: interpolated_data(BUDGETS, LAW.loss(BUDGETS), loss)
  assert iv.se_log == pytest.approx(abs(math.log(read(m + h) / read(m))), rel=1e-12)
  for kw in ({}, {"relative": True}, {"method": "interpolate"}):
    flat = bootstrap_speedup(same, [float(LAW.loss(8e8))] * 3, 4e8, n_resamples=20, **kw)
    assert flat.low == flat.high == flat.estimate and flat.se_log == 0.0


@pytest.mark.parametrize("contender, bracket", [(1.0, 1.0), (3.0, 1.0), (1.0, 3.0)])
def test_the_t_draws_cover_95_percent_at_three_seeds_where_resampling_covers_four_in_five(contender, bracket):
  """200 noisy ladders (3 seeds per budget, the contender at 2× the baseline's efficiency, its noise `contender` × the
  baseline's, the baseline's budget at the contender's loss `bracket` × noisier than its others): the t draws' 95%
  interval covers 2 at least 93% of the time (measured 95.5–98%: each spread on its own 2 degrees of freedom; one
  spread pooled over five budgets covered 85% with the bracket 3× noisier), resampling the seeds at most 87% (measured
  72–76%)."""
  budgets, tokens = BUDGETS[:4], 2e8
  noise = 0.003 * np.where(budgets == 2 * tokens, bracket, 1.0)
  rng = np.random.default_rng(5)
  hits = {"t": 0, "seeds": 0}
  for i in range(200):
    base = {b: list(LAW.loss(b) + e * rng.standard_normal(3)) for b, e in zip(budgets, noise)}
    mine = list(LAW.loss(2 * tokens) + contender * 0.003 * rng.standard_normal(3))
    for draws in hits:
      iv = bootstrap_speedup(base, mine, tokens, method="interpolate", n_resamples=200, seed=i, draws=draws)
      hits[draws] += iv.low <= 2.0 <= iv.high
  assert hits["t"] >= 0.93 * 200 and hits["seeds"] <= 0.87 * 200, hits


def test_holm_adjusts_a_hand_worked_family():
  """m = 4: sorted 0.005, 0.01, 0.03, 0.04 scale by 4, 3, 2, 1 to 0.02, 0.03, 0.06, 0.04, and the step-down keeps them
  non-decreasing (0.04 → 0.06); a NaN stays NaN and counts in m; nothing exceeds 1; tied p-values adjust alike."""
  assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02], rel=1e-12)
  got = holm([0.01, math.nan])
  assert got[0] == pytest.approx(0.02) and math.isnan(got[1])
  assert holm([0.6, 0.7]).tolist() == [1.0, 1.0]
  assert holm([0.01, 0.01, 0.01]).tolist() == pytest.approx([0.03] * 3)  # ties step down together
  with pytest.raises(ValueError, match=r"\[0, 1\]"):
    holm([1.5, -0.1])


def test_pairwise_is_welchs_two_sided_test_on_every_pair_holm_adjusted_and_holds_the_family_error():
  """Each pair's p is scipy's two-sided Welch p, the better (lower mean) first, Holm over the 3 pairs of 3 methods;
  under a null of three equal methods (3 seeds each, 600 draws) some pair reaches adjusted p < 0.05 in at most 5% of
  draws plus two binomial standard errors (measured 2.5%; unadjusted, 9.3%)."""
  samples = {"a": [2.0, 2.1, 2.05], "b": [1.8, 1.85, 1.79], "c": [2.02, 2.2, 2.1]}
  pairs = pairwise(samples)
  raw = {(q.better, q.worse): q.comparison.p_value for q in pairs}
  assert set(raw) == {("b", "a"), ("b", "c"), ("a", "c")}
  for (x, y), p in raw.items():
    assert p == pytest.approx(stats.ttest_ind(samples[x], samples[y], equal_var=False).pvalue, rel=1e-12)
  assert [q.p_holm for q in pairs] == pytest.approx(holm([q.comparison.p_value for q in pairs]).tolist())
  assert all(q.comparison.diff <= 0 for q in pairs) and [q.comparison.p_value for q in pairs] == sorted(raw.values())
  rng = np.random.default_rng(11)
  errors = sum(min(q.p_holm for q in pairwise({n: rng.standard_normal(3) for n in "xyz"})) < 0.05 for _ in range(600))
  assert errors <= 600 * (0.05 + 2 * math.sqrt(0.05 * 0.95 / 600))
  with pytest.raises(ValueError, match="at least two methods"):
    pairwise({"a": [1.0, 2.0]})


def test_the_t_draws_cover_on_the_fit_divided_by_the_baseline_own_point():
  """The main table's column: the speedup on the baseline's fit ÷ its own point at the contender's budget, over 80
  noisy ladders (3 seeds each): the t draws' 95% interval covers the true 2 at least 90% of the time."""
  budgets, tokens = BUDGETS, 2e8
  rng = np.random.default_rng(9)
  hits = 0
  for i in range(80):
    base = {b: list(LAW.loss(b) + 0.003 * rng.standard_normal(3)) for b in budgets}
    mine = list(LAW.loss(2 * tokens) + 0.003 * rng.standard_normal(3))
    iv = bootstrap_speedup(base, mine, tokens, relative=True, n_resamples=150, seed=i)
    hits += iv.low <= 2.0 <= iv.high
  assert hits >= 0.9 * 80, hits


@pytest.mark.parametrize("widths", [[32, 64, 128], [32, 64, 128, 256]])
def test_the_chain_to_the_ladders_exponent_covers_95_percent_with_knapp_hartung(widths):
  """The ladder's whole chain on 400 simulated ladders (3 seeds per run, the same 2× speedup at every width, so the
  true exponent is 0): each width's `se_log`, `speedup_slope`, and the t interval on widths − 2 df with Knapp and
  Hartung's scaled error covers 0 within two binomial standard errors of 95% (measured 93.75% and 95.25%); the floored
  variant √max(1, χ²) overcovers (≥ 99%), and the normal on the seeds' errors alone undercovers (≤ 91%)."""
  rng = np.random.default_rng(11)
  hits = {"kh": 0, "floored": 0, "normal": 0}
  t = stats.t.ppf(0.975, len(widths) - 2)
  for _ in range(400):
    ivs = []
    for _ in widths:
      base = {b: list(LAW.loss(b) + 0.003 * rng.standard_normal(3)) for b in BUDGETS}
      ivs.append(bootstrap_speedup(base, list(LAW.loss(8e8) + 0.003 * rng.standard_normal(3)), 4e8,
                                   method="interpolate", n_resamples=1))
    s = speedup_slope(widths, [iv.estimate for iv in ivs], [iv.se_log for iv in ivs])
    hits["kh"] += abs(s.exponent) <= t * s.kh_se
    hits["floored"] += abs(s.exponent) <= t * s.scaled_se
    hits["normal"] += abs(s.exponent) <= stats.norm.ppf(0.975) * s.se
  assert abs(hits["kh"] / 400 - 0.95) <= 2 * math.sqrt(0.05 * 0.95 / 400), hits
  assert hits["floored"] >= 0.99 * 400 and hits["normal"] <= 0.91 * 400, hits


def test_the_chain_to_stage_ds_exponents_covers_95_percent_though_points_share_a_baseline():
  """Stage D's chain on 400 simulated ladders: per width AdamW at 1/8 .. 4× a budget (3 seeds each), the contender
  at 1/8 .. 1× with 2× AdamW's efficiency everywhere (both true exponents 0), each speedup read between AdamW's runs,
  `speedup_trend` over the 3 widths' points with t on points − 3 df: points of one width share AdamW's runs, yet both
  exponents' intervals cover 0 within two binomial standard errors of 95% (measured 96% and 95%)."""
  tpp = {32: 20.0, 64: 10.0, 128: 2.5}
  rng = np.random.default_rng(3)
  hits = np.zeros(2)
  for _ in range(400):
    pts = []
    for w in tpp:
      base = {4e8 * f: LAW.loss(4e8 * f) + 0.01 * rng.standard_normal(3) for f in (0.125, 0.25, 0.5, 1, 2, 4)}
      means = [float(base[d].mean()) for d in sorted(base)]
      for f in (0.125, 0.25, 0.5, 1):
        s = interpolated_data(sorted(base), means, float(np.mean(LAW.loss(8e8 * f) + 0.01 * rng.standard_normal(3))))
        if 0 < s < math.inf:
          pts.append((w, tpp[w] * f, s / (4e8 * f)))
    t = speedup_trend(*zip(*pts))
    q = stats.t.ppf(0.975, t.points - 3)
    hits += [abs(t.width_exponent) <= q * t.width_se, abs(t.data_exponent) <= q * t.data_se]
  assert np.all(np.abs(hits / 400 - 0.95) <= 2 * math.sqrt(0.05 * 0.95 / 400)), hits


def test_the_baselines_own_row_draws_its_runs_once_in_both_roles():
  """contender=None reads the baseline's own runs at `tokens`: on its fit ÷ its own point the speedup is 1 in every
  draw (an interval and an error of nothing), on the fit alone its interval is narrower than for an independent copy
  of the same runs (drawn twice, their noise counted twice); a `tokens` that is not a budget is refused."""
  base, _ = noisy_ladder(0.01, seeds=3)
  own = bootstrap_speedup(base, None, TOKENS, relative=True, n_resamples=200)
  assert own.estimate == own.low == own.high == pytest.approx(1.0, abs=1e-12) and own.se_log == 0.0
  once = bootstrap_speedup(base, None, TOKENS, n_resamples=400)
  twice = bootstrap_speedup(base, base[TOKENS], TOKENS, n_resamples=400)
  assert once.estimate == twice.estimate and once.high / once.low < twice.high / twice.low
  assert 0 < once.se_log < twice.se_log
  with pytest.raises(ValueError, match="not a budget"):
    bootstrap_speedup(base, None, 3e8)
