"""accelexp.stats: every interval against arithmetic done here by hand on small fixed data.

The t and normal quantiles are literal constants (t_{0.975,df}, z_{0.975}), so a test checks the
module's choice of method, degrees of freedom and data, not scipy against itself.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from accelexp.stats import (
    Estimate,
    across_repeats,
    across_repeats_log,
    batch_means,
    efficiency,
    format_estimate,
    mean_sd,
    olympic_mean,
    rate,
    ratio,
    verdict,
)

T_975_2 = 4.302652729749464  # t quantile 0.975, 2 degrees of freedom
Z_975 = 1.959963984540054  # normal quantile 0.975


def approx(x: float) -> pytest.approx:
    return pytest.approx(x, rel=1e-9)


def assert_interval(e: Estimate, value: float, low: float, high: float) -> None:
    assert (e.value, e.low, e.high) == (approx(value), approx(low), approx(high))


def test_estimate_helpers():
    e = Estimate(10.0, 9.0, 12.0, n=5, method="t")
    assert e.contains(9.0) and e.contains(12.0) and not e.contains(12.5)
    assert e.relative_halfwidth() == approx(0.15)
    assert e.scaled(2.0) == Estimate(20.0, 18.0, 24.0, n=5, method="t")
    bare = Estimate(10.0)
    assert not bare.has_interval and not bare.contains(10.0)
    assert bare.relative_halfwidth() is None
    with pytest.raises(ValueError):
        e.scaled(-1.0)
    with pytest.raises(ValueError):
        Estimate(1.0, low=0.5)


def test_batch_means_with_three_batches():
    series = [1, 2, 3, 4, 5, 6, 7, 8, 3, 3, 3, 3]
    # batch means 2.5, 6.5, 3.0: mean 4.0, variance (1.5² + 2.5² + 1²) / 2 = 4.75
    half = T_975_2 * math.sqrt(4.75 / 3)
    e = batch_means(series, batches=3)
    assert_interval(e, 4.0, 4.0 - half, 4.0 + half)
    assert (e.n, e.method) == (12, "batch means")


def test_batch_means_default_batches_drop_the_end():
    # 10 values: ⌊√10⌋ = 3 batches of 3, the last value (1000) dropped; means 2, 5, 8, sd 3
    e = batch_means([1, 2, 3, 4, 5, 6, 7, 8, 9, 1000])
    half = T_975_2 * 3 / math.sqrt(3)
    assert_interval(e, 5.0, 5.0 - half, 5.0 + half)
    assert e.n == 9
    # 510 values: ⌊√510⌋ = 22, capped at 20 batches of 25 -> 500 used
    assert batch_means(np.arange(510.0)).n == 500
    few = batch_means([1.0, 2.0, 6.0])
    assert (few.value, few.has_interval, few.n) == (3.0, False, 3)


def test_rate_inverts_the_time_interval():
    steps = [0.20] * 4 + [0.21] * 4 + [0.22] * 4 + [0.34]
    # 13 steps -> 3 batches of 4 (the 0.34 dropped): means 0.20, 0.21, 0.22, sd 0.01
    half = T_975_2 * 0.01 / math.sqrt(3)
    e = rate(steps, units_per_step=64)
    # the value uses all 13 steps: mean (2.52 + 0.34) / 13 = 0.22; the interval is the batch
    # means' half-width about it
    assert_interval(e, 64 / 0.22, 64 / (0.22 + half), 64 / (0.22 - half))
    # a tail of slow steps the batches leave out moves the value: its interval goes with it
    # (20 steps of 0.100 and 0.101 s in turn, 4 batches of 5, then 2 fast ones of 0.05 s: about
    # the batch means alone the value, 667/s, was above the interval's top, 638/s)
    tail = rate([0.100, 0.101] * 10 + [0.05] * 2, units_per_step=64)
    assert tail.low < tail.value < tail.high and tail.value == approx(64 / (2.11 / 22))
    # batch means 0.1, 0.2, 0.3: the time's lower bound 0.2 - 4.30 * 0.1 / √3 < 0, no interval
    noisy = rate([0.1] * 4 + [0.2] * 4 + [0.3] * 4, units_per_step=64)
    assert noisy.value == approx(64 / 0.2) and not noisy.has_interval


def test_across_repeats():
    # mean 302 / 3; squares about the mean sum to 30420 - 302² / 3 = 56 / 3, variance 28 / 3
    half = T_975_2 * math.sqrt(28 / 3 / 3)
    e = across_repeats([100, 104, 98])
    assert_interval(e, 302 / 3, 302 / 3 - half, 302 / 3 + half)
    assert (e.n, e.method) == (3, "t")
    assert not across_repeats([100]).has_interval


def runs(*values: float) -> list[Estimate]:
    return [Estimate(v) for v in values]


def test_paired_ratio_is_a_t_interval_on_log_ratios():
    e = ratio(runs(210, 180, 228), runs(100, 90, 120), paired=True)
    logs = np.log([2.1, 2.0, 1.9])
    half = T_975_2 * logs.std(ddof=1) / math.sqrt(3)
    centre = logs.mean()
    assert_interval(
        e, (2.1 * 2.0 * 1.9) ** (1 / 3), math.exp(centre - half), math.exp(centre + half)
    )
    assert (e.n, e.method) == (3, "paired t (log ratio)")


def test_unpaired_ratio_bootstrap():
    num, den = runs(200, 210, 190, 205), runs(100, 104, 98)
    e = ratio(num, den, paired=False, seed=3)
    assert e == ratio(num, den, paired=False, seed=3)
    assert e.method == "bootstrap" and e.value == approx(201.25 / (302 / 3))
    assert e.contains(e.value)
    # a resample's ratio of means lies between min(num) / max(den) and max(num) / min(den)
    assert 190 / 104 <= e.low < e.high <= 210 / 98
    far = ratio(runs(1000, 1010, 990), runs(10, 11, 9), paired=False)
    assert far.low > 1.0 and verdict(far) == "faster"
    # paired, but sides of unequal length: not pairs, so the bootstrap
    assert ratio(num, den, paired=True).method == "bootstrap"
    same = ratio(runs(5, 5), runs(2, 2), paired=False)
    assert (same.value, same.low, same.high) == (2.5, 2.5, 2.5)


def test_delta_ratio_of_two_single_runs():
    e = ratio([Estimate(200, 190, 210)], [Estimate(100, 98, 102)], paired=True)
    # se of each log is ln(high / low) / (2 z); the half width z·√(se² + se²) drops z
    half = math.sqrt((math.log(210 / 190) / 2) ** 2 + (math.log(102 / 98) / 2) ** 2)
    assert_interval(e, 2.0, 2.0 * math.exp(-half), 2.0 * math.exp(half))
    assert (e.n, e.method) == (2, "delta (log)")


def test_delta_ratio_with_a_side_of_repeats():
    e = ratio([Estimate(200, 190, 210)], runs(100, 104, 98), paired=False)
    den_half = T_975_2 * math.sqrt(28 / 9)  # the across_repeats interval of 100, 104, 98
    se_den = math.log((302 / 3 + den_half) / (302 / 3 - den_half)) / (2 * Z_975)
    se_num = math.log(210 / 190) / (2 * Z_975)
    half = Z_975 * math.sqrt(se_num**2 + se_den**2)
    value = 200 / (302 / 3)
    assert_interval(e, value, value * math.exp(-half), value * math.exp(half))
    no_interval = ratio(runs(200), runs(100, 104, 98), paired=False)
    assert no_interval.value == approx(value) and not no_interval.has_interval
    with pytest.raises(ValueError):
        ratio([], runs(100), paired=False)


def test_efficiency():
    e = efficiency(Estimate(3.6, 3.2, 4.0, n=3, method="t"), workers_ratio=4)
    assert_interval(e, 0.9, 0.8, 1.0)
    assert (e.n, e.method) == (3, "t")


def test_olympic_mean_and_mean_sd():
    assert olympic_mean([5, 1, 3, 9, 4]) == 4.0
    assert olympic_mean([2, 4]) == 3.0
    mean, sd = mean_sd([1, 2, 3, 4])
    assert (mean, sd) == (2.5, approx(math.sqrt(5 / 3)))
    assert mean_sd([7]) == (7.0, None)


def test_verdict():
    assert verdict(Estimate(1.05, 0.98, 1.12)) == "no measurable difference"
    assert verdict(Estimate(1.5, 1.2, 1.8)) == "faster"
    assert verdict(Estimate(0.7, 0.6, 0.8)) == "slower"
    assert verdict(Estimate(1.5)) == ""


def test_format_estimate():
    assert format_estimate(Estimate(1.8234, 1.7512, 1.8967), suffix="×") == "1.82× (1.75–1.90)"
    thousands = Estimate(5105.2, 4980.4, 5230.1)
    assert format_estimate(thousands, "{:,.0f}") == "5,105 (4,980–5,230)"
    assert format_estimate(Estimate(1.5), suffix="×") == "1.50×"


def test_across_repeats_log_is_the_geometric_mean_and_never_crosses_zero():
    values = [900.0, 100.0, 664.0]  # a plain t interval of these reaches below 0
    assert across_repeats(values).low < 0
    e = across_repeats_log(values)
    logs = [math.log(v) for v in values]
    centre = sum(logs) / 3
    sd = math.sqrt(sum((x - centre) ** 2 for x in logs) / 2)
    half = T_975_2 * sd / math.sqrt(3)
    assert e.value == pytest.approx(math.exp(centre))
    assert (e.low, e.high) == pytest.approx((math.exp(centre - half), math.exp(centre + half)))
    assert 0 < e.low < e.value < e.high and e.n == 3 and e.method == "t (log)"
    assert not across_repeats_log([100]).has_interval
    with pytest.raises(ValueError):
        across_repeats_log([100, 0])
