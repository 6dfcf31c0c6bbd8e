"""Numbers with uncertainty: every mean, rate and ratio the lab reports, with its interval.

This module is the one owner of "a number and how sure we are of it". Writers and the report ask
it for an `Estimate` (a value, an optional interval, how many observations stand behind it and
the method that made the interval) and never compute an interval of their own. Quantiles,
standard errors and the bootstrap come from `scipy.stats`; the functions here only choose which
one fits the data. Every interval is two-sided at `CONFIDENCE` (95 %) unless asked otherwise.

Methods, by question:

- **Mean step time of one run** (`batch_means`). Consecutive step times are correlated (warm
  caches, clock boosts, a slow data worker), so the plain t interval of the steps is too narrow.
  The batch-means method splits the series into `b` non-overlapping consecutive batches of equal
  length `m = n // b` — the `n mod b` values at the *end* are dropped so the lengths are equal —
  and treats the `b` batch means as nearly independent: mean of the batch means
  ± t(b-1) · sd(batch means) / √b. By default `b = min(20, max(2, ⌊√n⌋))`. Fewer than 4 values
  (less than 2 batches of 2) give the plain mean and no interval.
- **Throughput of one run** (`rate`). Units per step divided by the mean step time of *all* the
  steps given; the interval is units per step divided by the batch-means interval of the step
  times, bounds swapped (a longer step is a lower rate). When the batch-means lower bound of the
  time is not positive the rate has no finite upper bound, and no interval is given.
- **Repeats of one configuration** (`across_repeats`). Mean ± t(n-1) · sd / √n. The mean, not
  the median: with 3–5 repeats no distribution-free interval of the median reaches 95 %
  coverage (its widest one, the range of 5 values, covers 1 - 2/2⁵ ≈ 94 %), and a bootstrap of 3
  values under-covers badly; the t interval of the mean is honest at these sizes. For figures
  that may be negative or zero.
- **Repeats of a rate** (`across_repeats_log`: throughputs, samples/s). The t interval of the
  logs, taken back with exp: the value is the geometric mean, and neither bound can reach 0 (a
  t interval of 3 spread-out throughputs can: "554.8 (−81.9–1191.5)"). Rates are positive and
  their noise multiplicative (a neighbour slows a run by a share, not by a number of samples).
- **Ratio of two configurations** (`ratio`: speedup, AMP gain), each side given as its repeats'
  per-run estimates:
  - *paired* (repeat i of each side ran next to each other, same length ≥ 2): the log ratios
    log(num_i / den_i) get a t interval, and value and bounds are taken back with exp — the
    value is the geometric mean of the per-pair ratios. Pairing cancels the drift both sides
    of a pair share.
  - *unpaired*, both sides ≥ 2 runs: percentile bootstrap (`scipy.stats.bootstrap`, 9999
    resamples of each side independently, seeded) of mean(num) / mean(den); the value is
    mean(num) / mean(den). A degenerate bootstrap (all values equal) gives the interval
    (value, value).
  - a side with one run: value mean(num) / mean(den) and the delta method on logs. Each side's
    standard error of the log is read back from its interval as
    (log high - log low) / (2 z), z the normal quantile — a single run's own (batch-means)
    interval, or the `across_repeats` interval of a side with ≥ 2 runs (a t interval, so this
    errs wide) — and the two add in quadrature: log value ± z · √(se_num² + se_den²). A side
    with no interval (or one reaching zero) leaves the ratio without one.
- **Ratio in lockstep** (`lockstep_ratio`: jobs that took turns, `accelexp.lockstep`): per
  incarnation (a fresh set of processes, one per configuration) the mean of the log ratios of
  its paired slices, round by round (the drift a round's slices share cancels); across
  incarnations the t interval of those means, exp back — a process's own lifelong bias differs
  between incarnations and so is inside it. One incarnation: the batch-means interval of its
  rounds' log ratios, its method saying that a process's own bias is not in it.
- **Efficiency** (`efficiency`): a speedup divided by the ratio of workers, bounds too.
- **Accuracy over seeds** (`mean_sd`): mean and sample standard deviation (ddof 1); spread, not
  an interval, because seeds vary the result itself, not our measurement of it.
- **Time to train** (`olympic_mean`): MLPerf's rule — drop the fastest and the slowest run,
  average the rest.

`verdict` turns a ratio's interval into words and `format_estimate` into the compact text the
tables print, e.g. "1.82× (1.75–1.90)".
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy import special  # t and normal quantiles; scipy.stats (0.5 s to import) loads lazily

CONFIDENCE = 0.95
MIN_BATCH_MEANS = 4  # fewer values than 2 batches of 2: no batch-means interval
MAX_BATCHES = 20
BOOTSTRAP_RESAMPLES = 9999
NO_DIFFERENCE = "no measurable difference"  # what a ratio whose interval holds 1.0 reads as


@dataclass(frozen=True)
class Estimate:
    """A value with an optional two-sided interval [low, high] and how it was made.

    `n` counts the observations behind it (steps, batches or repeats); `method` names the
    interval's method ("batch means", "t", "paired t (log ratio)", "bootstrap", "delta (log)"),
    or is "" when there is no interval.
    """

    value: float
    low: float | None = None  # None: no interval (too few observations)
    high: float | None = None
    n: int = 1
    method: str = ""

    def __post_init__(self) -> None:
        if (self.low is None) != (self.high is None):
            raise ValueError(f"an interval needs both bounds, got low={self.low} high={self.high}")
        if self.low is not None and self.low > self.high:
            raise ValueError(f"interval low {self.low} is above high {self.high}")

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None

    def contains(self, x: float) -> bool:
        """Whether x lies in the interval (bounds included); False when there is none."""
        return self.has_interval and self.low <= x <= self.high

    def relative_halfwidth(self) -> float | None:
        """Half the interval's width as a fraction of the value; None without an interval."""
        if not self.has_interval or self.value == 0:
            return None
        return (self.high - self.low) / 2 / abs(self.value)

    def scaled(self, factor: float) -> Estimate:
        """The same estimate with value and bounds multiplied by a positive factor."""
        if not factor > 0:
            raise ValueError(f"scale factor must be positive, got {factor}")
        if not self.has_interval:
            return replace(self, value=self.value * factor)
        return replace(
            self, value=self.value * factor, low=self.low * factor, high=self.high * factor
        )


def _array(values: Sequence[float], what: str) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{what} needs a non-empty sequence of numbers")
    return array


def _t_halfwidth(sample: np.ndarray, confidence: float) -> float:
    """Half width of the t interval of the sample's mean (sample of 2 or more)."""
    quantile = special.stdtrit(sample.size - 1, (1 + confidence) / 2)  # scipy.stats.t.ppf
    return float(quantile * sample.std(ddof=1) / math.sqrt(sample.size))  # x its standard error


def _z(confidence: float) -> float:
    return float(special.ndtri((1 + confidence) / 2))  # scipy.stats.norm.ppf


def _default_batches(n: int) -> int:
    """The batch count `batch_means` uses for n values: min(20, max(2, ⌊√n⌋))."""
    return min(MAX_BATCHES, max(2, math.isqrt(n)))


def batch_means(
    values: Sequence[float], confidence: float = CONFIDENCE, batches: int | None = None
) -> Estimate:
    """Mean of a correlated series (consecutive step times) with its batch-means interval.

    The series is cut into `batches` consecutive batches of n // batches values (the remainder
    at the end is dropped); value and interval come from the batch means, and `n` counts the
    values used. Fewer than 4 values: the plain mean, no interval.
    """
    series = _array(values, "batch_means")
    if series.size < MIN_BATCH_MEANS:
        return Estimate(float(series.mean()), n=series.size)
    b = _default_batches(series.size) if batches is None else batches
    length = series.size // b
    if b < 2 or length < 2:
        raise ValueError(f"{series.size} values do not make {b} batches of 2 or more")
    means = series[: b * length].reshape(b, length).mean(axis=1)
    value = float(means.mean())
    half = _t_halfwidth(means, confidence)
    return Estimate(value, value - half, value + half, n=b * length, method="batch means")


def rate(
    step_seconds: Sequence[float], units_per_step: float, confidence: float = CONFIDENCE
) -> Estimate:
    """Throughput (units/s) from step durations, with the inverted batch-means interval.

    The value uses the mean of all the step times given; the interval is the batch means'
    half-width (from the values they keep) about that mean, so the value is always inside it
    (about the batch means' own mean, a remainder of slow steps left the value outside its
    interval, and the report's error bar with it). No interval when the time's lower bound is
    not positive.
    """
    seconds = _array(step_seconds, "rate")
    mean_seconds = float(seconds.mean())
    if not (mean_seconds > 0 and units_per_step > 0):
        raise ValueError("rate needs positive step times and units per step")
    value = units_per_step / mean_seconds
    time = batch_means(seconds, confidence)
    if not time.has_interval:
        return Estimate(value, n=time.n)
    half = time.value - time.low
    if mean_seconds - half <= 0:
        return Estimate(value, n=time.n)
    return Estimate(
        value,
        units_per_step / (mean_seconds + half),
        units_per_step / (mean_seconds - half),
        time.n,
        time.method,
    )


def across_repeats(values: Sequence[float], confidence: float = CONFIDENCE) -> Estimate:
    """Mean of a configuration's repeats with its t interval; one value has no interval."""
    sample = _array(values, "across_repeats")
    value = float(sample.mean())
    if sample.size < 2:
        return Estimate(value, n=1)
    half = _t_halfwidth(sample, confidence)
    return Estimate(value, value - half, value + half, n=sample.size, method="t")


def across_repeats_log(values: Sequence[float], confidence: float = CONFIDENCE) -> Estimate:
    """Geometric mean of a rate's repeats (positive values) with the t interval of the logs,
    taken back with exp: bounds always positive. One value has no interval."""
    sample = _array(values, "across_repeats_log")
    if not np.all(sample > 0):
        raise ValueError(f"across_repeats_log needs positive values, got {sample.tolist()}")
    if sample.size < 2:
        return Estimate(float(sample[0]), n=1)
    return _t_of_logs(np.log(sample), confidence, "t (log)")


def _t_of_logs(logs: np.ndarray, confidence: float, method: str, n: int | None = None) -> Estimate:
    """The t interval of the mean of `logs` (2 or more), value and bounds taken back with exp."""
    centre, half = float(logs.mean()), _t_halfwidth(logs, confidence)
    return Estimate(
        math.exp(centre),
        math.exp(centre - half),
        math.exp(centre + half),
        n=logs.size if n is None else n,
        method=method,
    )


def _values(side: Sequence[Estimate], what: str) -> np.ndarray:
    array = _array([e.value for e in side], f"ratio's {what}")
    if not np.all(array > 0):
        raise ValueError(f"ratio's {what} needs positive values, got {array.tolist()}")
    return array


def _paired_ratio(num: np.ndarray, den: np.ndarray, confidence: float) -> Estimate:
    return _t_of_logs(np.log(num / den), confidence, "paired t (log ratio)")


def _ratio_of_means(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(a, axis=axis) / np.mean(b, axis=axis)


def _seed_argument(seed: int) -> dict[str, int]:
    """`rng=` in scipy >= 1.15, `random_state=` before it."""
    from scipy import stats

    parameters = inspect.signature(stats.bootstrap).parameters
    return {"rng": seed} if "rng" in parameters else {"random_state": seed}


def _bootstrap_ratio(num: np.ndarray, den: np.ndarray, confidence: float, seed: int) -> Estimate:
    value = float(_ratio_of_means(num, den))
    low = high = value
    if np.ptp(num) > 0 or np.ptp(den) > 0:
        from scipy import stats

        result = stats.bootstrap(
            (num, den),
            _ratio_of_means,
            vectorized=True,
            axis=-1,
            confidence_level=confidence,
            n_resamples=BOOTSTRAP_RESAMPLES,
            method="percentile",
            **_seed_argument(seed),
        )
        interval = result.confidence_interval
        if np.isfinite(interval.low) and np.isfinite(interval.high):
            low, high = float(interval.low), float(interval.high)
    return Estimate(value, low, high, n=num.size + den.size, method="bootstrap")


def _log_se(side: Sequence[Estimate], confidence: float) -> float | None:
    """Standard error of a side's log value, read back from its interval; None without one."""
    interval = side[0] if len(side) == 1 else across_repeats([e.value for e in side], confidence)
    if not interval.has_interval or interval.low <= 0:
        return None
    return (math.log(interval.high) - math.log(interval.low)) / (2 * _z(confidence))


def _delta_ratio(
    num: Sequence[Estimate], den: Sequence[Estimate], value: float, confidence: float
) -> Estimate:
    n = len(num) + len(den)
    se_num, se_den = _log_se(num, confidence), _log_se(den, confidence)
    if se_num is None or se_den is None:
        return Estimate(value, n=n)
    half = _z(confidence) * math.hypot(se_num, se_den)
    centre = math.log(value)
    return Estimate(
        value, math.exp(centre - half), math.exp(centre + half), n=n, method="delta (log)"
    )


def ratio(
    num: Sequence[Estimate],
    den: Sequence[Estimate],
    paired: bool,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> Estimate:
    """Ratio of two configurations' throughputs, each side given as its runs' estimates.

    Paired equal sides of 2 or more: paired t on the log ratios (geometric mean). Unpaired,
    2 or more runs a side: seeded percentile bootstrap of mean / mean. A side of one run: the
    delta method on logs from each side's interval. See the module docstring.
    """
    a, b = _values(num, "numerator"), _values(den, "denominator")
    if paired and a.size == b.size >= 2:
        return _paired_ratio(a, b, confidence)
    if a.size >= 2 and b.size >= 2:
        return _bootstrap_ratio(a, b, confidence, seed)
    return _delta_ratio(num, den, float(a.mean() / b.mean()), confidence)


def lockstep_ratio(
    incarnations: Sequence[Sequence[tuple[float, float]]],
    confidence: float = CONFIDENCE,
    shared: bool = False,
) -> Estimate:
    """Ratio of two configurations measured in lockstep (`accelexp.lockstep`): each incarnation
    (a fresh set of processes) gives its paired slices as (num, den) rates, round by round.

    Within an incarnation the log ratios of its rounds are averaged: the drift the two slices of
    a round share cancels. Across incarnations the t interval of those means (value and bounds
    taken back with exp): what a process carries for its whole life (memory placement, where
    its threads landed) differs between incarnations, so it is inside this interval. With one
    incarnation, the batch-means interval of its rounds, whose `method` says that a process's own
    bias is not in it. Incarnations without a pair are left out.

    `shared`: both sides ran in one process in each incarnation (`lockstep.process=shared`).
    What a process carries is then in both slices of every round, but it cancels only where the
    two sides are the same work (an A/A); for unlike work it does not: bf16 against fp32 in one
    process, 10 processes on an AMX host, each alone ±1-2 % over 47 rounds, read 1.24 to 1.63
    (both sides' rates moved by process, each its own way). So the same rule holds: t over the
    incarnations, batch means only for a single one; `shared` names the design in `method`."""
    design = "lockstep in one process" if shared else "lockstep"
    means, rounds = [], 0
    series = []
    for pairs in incarnations:
        if not pairs:
            continue
        num, den = _array([p[0] for p in pairs], "lockstep"), _array([p[1] for p in pairs], "")
        logs = np.log(num / den)
        means.append(float(logs.mean()))
        series.append(logs)
        rounds += logs.size
    if not means:
        raise ValueError("lockstep_ratio needs at least one paired round")
    if len(means) >= 2:
        method = f"{design}: t over {len(means)} incarnations ({rounds} rounds)"
        return _t_of_logs(np.asarray(means), confidence, method, n=rounds)
    within = batch_means(series[0], confidence)
    if not within.has_interval:
        return Estimate(math.exp(within.value), n=rounds)
    return Estimate(
        math.exp(within.value),
        math.exp(within.low),
        math.exp(within.high),
        rounds,
        f"{design}: 1 incarnation, {rounds} rounds (a process's own bias not in the interval)",
    )


def efficiency(speedup: Estimate, workers_ratio: float) -> Estimate:
    """Scaling efficiency: a speedup divided by the ratio of workers, bounds too."""
    if not workers_ratio > 0:
        raise ValueError(f"workers ratio must be positive, got {workers_ratio}")
    return speedup.scaled(1 / workers_ratio)


def mean_sd(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (ddof 1); the sd is None for one value."""
    sample = _array(values, "mean_sd")
    sd = float(np.std(sample, ddof=1)) if sample.size >= 2 else None
    return float(sample.mean()), sd


def olympic_mean(values: Sequence[float]) -> float:
    """MLPerf's time-to-train rule: drop the fastest and the slowest, average the rest.

    With fewer than 3 values, the plain mean.
    """
    sample = np.sort(_array(values, "olympic_mean"))
    kept = sample[1:-1] if sample.size >= 3 else sample
    return float(kept.mean())


def verdict(estimate: Estimate, null: float = 1.0) -> str:
    """A ratio's interval in words: "faster" (wholly above `null`), "slower" (wholly below),
    "no measurable difference" (contains it), or "" when there is no interval."""
    if not estimate.has_interval:
        return ""
    if estimate.contains(null):
        return NO_DIFFERENCE
    return "faster" if estimate.low > null else "slower"


def format_estimate(e: Estimate, fmt: str = "{:.2f}", suffix: str = "") -> str:
    """Compact text: "1.82× (1.75–1.90)"; just the value (and suffix) without an interval."""
    text = fmt.format(e.value) + suffix
    if not e.has_interval:
        return text
    return f"{text} ({fmt.format(e.low)}–{fmt.format(e.high)})"
