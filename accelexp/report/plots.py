"""The report's plots as PNGs (matplotlib, Agg): throughput and scaling efficiency against workers,
the AMP gain's bars, accuracy against time, the speed-up ladder's bars, and (with --diagnose) where
each run's step time went. No plot claims more than its intervals hold: runs all of one worker
count get throughput as bars per configuration and no efficiency plot (nothing scaled), figures
carry their 95 % intervals as error bars, and the accuracy axis spans at least
MIN_ACCURACY_SPAN.

Each plot has a builder (`*_figure`) that returns the matplotlib `Figure`, or None when there is
nothing to plot, so a test can read the real figure; `write_plots` and `write_time_plot` save them.
What makes them readable at a glance:

- every series has its own colour and its own marker (`series_styles`: tab10 × 12 markers, so no
  two of the first 60 series look alike, and the markers tell colours apart for colour-blind eyes);
- the legend sits right of the axes, never on the data;
- titles name the plotted model(s), data and device(s) (`title_subject`);
- throughput, efficiency, gains and the time axis start at 0, so heights compare honestly;
- each series' ideal-scaling line is dashed in the series' own colour, and their one legend entry
  (IDEAL_LABEL) shows a dash in every series' colour;
- series are nudged sideways (`_dodge`) so that equal points (amp and bf16 at one worker) both
  show, and the AMP gain's precisions stand side by side.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from accelexp import stats
from accelexp.record import ELAPSED_S, FINISHED, RUNNING, VAL_ACC
from accelexp.report.compare import PRECISION_ORDER, Row, group
from accelexp.report.diagnose import SEGMENTS, DiagnosisRow
from accelexp.report.ladder import LadderRow, ladder_subject
from accelexp.tracking.query import RunRecord

THROUGHPUT_PLOT = "throughput.png"
EFFICIENCY_PLOT = "efficiency.png"
AMP_GAIN_PLOT = "amp_gain.png"
ACCURACY_PLOT = "accuracy_vs_time.png"
PLOT_NAMES = (THROUGHPUT_PLOT, EFFICIENCY_PLOT, AMP_GAIN_PLOT, ACCURACY_PLOT)
LADDER_PLOT = "ladder.png"
TIME_PLOT = "time_breakdown.png"
SEGMENT_COLOURS = {  # (bar, label on it): compute in blues, waiting in warm colours
    "input": ("#f28e2b", "black"),
    "forward": ("#1f4e99", "white"),
    "backward": ("#6fa8dc", "black"),
    "optimizer": ("#59a14f", "black"),
    "comm": ("#e15759", "black"),
    "other": ("#bab0ac", "black"),
}
VARYING_KEYS = ("speed", "model", "data", "device")  # in a legend when they differ between runs
PALETTE = (  # matplotlib's tab10
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h", "p")
HATCHES = ("", "//", "..", "xx", "\\\\", "--")  # bars told apart without their colour
REFERENCE = {"color": "black", "linestyle": ":", "linewidth": 1.2}  # the 1.0 lines
NAMED_AT_MOST = 2  # more distinct models (data, devices) than this are counted in a title
DODGE = 0.3  # the sideways spread of all series, as a share of the smallest gap between workers
DPI = 120
MIN_ACCURACY_SPAN = 0.05  # the accuracy axis's least span: 5 points, not a 0.0007-wide zoom
IDEAL_LABEL = "dashed: ideal linear scaling"  # its legend dash comes in every series' colour


# --- shared pieces ------------------------------------------------------------------------------
def _figure(size: tuple[float, float] = (9, 4.8)) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    return figure, figure.add_subplot()


def _save(figure: Any | None, path: Path) -> Path | None:
    if figure is None:
        return None
    figure.savefig(path, dpi=DPI)
    return path


def save_or_remove(figure: Any | None, path: Path) -> list[Path]:
    """[path], `figure` saved there; with no figure (nothing to plot), [] and no file at `path`,
    not even an older report's."""
    if figure is None:
        path.unlink(missing_ok=True)
        return []
    return [_save(figure, path)]


def _legend_outside(figure: Any, entries: Sequence[tuple[Any, str]] = (), **options: Any) -> None:
    """The legend right of the axes, top-aligned, so it never covers the data: the labelled
    artists, or `entries` (handle, label) when given; a tuple handle draws its artists side by
    side."""
    from matplotlib.legend_handler import HandlerTuple

    if entries:
        options["handles"], options["labels"] = map(list, zip(*entries, strict=True))
    figure.legend(
        loc="outside right upper",
        fontsize="small",
        handler_map={tuple: HandlerTuple(ndivide=None, pad=0)},
        **options,
    )


def series_styles(labels: Iterable[Hashable]) -> dict[Hashable, tuple[str, str]]:
    """label -> (colour, marker), in order: the i-th label gets PALETTE[i % 10] and
    MARKERS[i % 12], so the first 60 labels all differ in colour or marker (most in both)."""
    return {
        label: (PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)])
        for i, label in enumerate(dict.fromkeys(labels))
    }


def title_subject(
    models: Iterable[str | None], data: Iterable[str | None], devices: Iterable[str | None] = ()
) -> str:
    """What was trained where, for a title: `simple_cnn on fashion_mnist, cpu`; two names
    are joined (`simple_cnn / resnet18`), more counted (`3 models`); unknown devices left out."""

    def named(values: Iterable[str | None], plural: str) -> str:
        distinct = list(dict.fromkeys(v for v in values if v))
        if len(distinct) > NAMED_AT_MOST:
            return f"{len(distinct)} {plural}"
        return " / ".join(distinct)

    text = f"{named(models, 'models') or '?'} on {named(data, 'data sets') or '?'}"
    where = named(devices, "devices")
    return f"{text}, {where}" if where else text


def _rows_subject(rows: Sequence[Row]) -> str:
    return title_subject(
        [row.model for row in rows],
        [row.data for row in rows],
        [row.device for row in rows],
    )


def _row_extras(rows: Sequence[Row]) -> tuple[str, ...]:
    """The VARYING_KEYS in which the rows differ (worth naming in a legend)."""
    return tuple(k for k in VARYING_KEYS if len({getattr(row, k) for row in rows}) > 1)


def _series_label(row: Row, extra: Sequence[str]) -> str:
    return " ".join([row.parallelism, row.precision, *(getattr(row, k) for k in extra)])


# --- against workers: throughput and efficiency --------------------------------------------------
def _series(rows: Sequence[Row], metric: str) -> dict[str, list[tuple[int, float]]]:
    """label -> [(workers, median of metric)] per (parallelism, precision[, what else varies:
    VARYING_KEYS]), in the rows' order (the table's)."""
    extra = _row_extras(rows)
    groups: dict[str, dict[int, list[float]]] = {}
    for row in rows:
        value = getattr(row, metric)
        if value is None or row.world_size is None:
            continue
        groups.setdefault(_series_label(row, extra), {}).setdefault(row.world_size, []).append(
            value
        )
    return {
        label: [(w, statistics.median(v)) for w, v in sorted(points.items())]
        for label, points in groups.items()
    }


def _bar_axes(axes: Any, groups: Sequence[str], xlabel: str, ylabel: str, top: float) -> None:
    """A bar chart's axes: a tick named per group of bars, heights from 0 to `top` (room for the
    labels above the bars), horizontal grid lines behind the bars."""
    axes.set_xticks(range(len(groups)), groups)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_ylim(0, top)
    axes.grid(axis="y", alpha=0.3)
    axes.set_axisbelow(True)


def _workers(series: Mapping[str, list[tuple[int, float]]]) -> tuple[list[int], int]:
    """The worker counts plotted, and the smallest gap between two of them (1 for one count)."""
    workers = sorted({w for points in series.values() for w, _ in points})
    return workers, min((b - a for a, b in itertools.pairwise(workers)), default=1)


def _dodge(series: Mapping[str, list[tuple[int, float]]]) -> dict[str, float]:
    """label -> sideways offset in workers, spreading the series over DODGE of the smallest gap
    between worker counts, so points with equal values stay visible side by side."""
    _, gap = _workers(series)
    count = len(series)
    if count < 2:
        return dict.fromkeys(series, 0.0)
    return {label: DODGE * gap * (i / (count - 1) - 0.5) for i, label in enumerate(series)}


def _workers_axis(axes: Any, series: Mapping[str, list[tuple[int, float]]]) -> None:
    """Ticks at the worker counts, half a gap of room at each end (so a nudge stays small)."""
    workers, gap = _workers(series)
    axes.set_xticks(workers)
    axes.set_xlim(workers[0] - gap / 2, workers[-1] + gap / 2)
    axes.set_xlabel("workers (world size; series nudged apart so none hides another)")
    axes.grid(alpha=0.3)
    axes.set_axisbelow(True)


def _draw_series(
    axes: Any, series: Mapping[str, list[tuple[int, float]]], rows: Sequence[Row], metric: str
) -> dict[str, Any]:
    """Each series as a line in its own colour and marker (the same in every plot of `rows`),
    nudged sideways by `_dodge`, with each point's 95 % interval as an error bar where it is the
    one row of its series at that worker count; label -> its Line2D."""
    extra = _row_extras(rows)
    styles = series_styles(_series_label(row, extra) for row in rows)
    offsets = _dodge(series)
    drawn = {}
    for label, points in series.items():
        colour, marker = styles[label]
        x = [w + offsets[label] for w, _ in points]
        y = [value for _, value in points]
        (drawn[label],) = axes.plot(x, y, color=colour, marker=marker, markersize=7, label=label)
    at: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        if getattr(row, metric) is not None and row.world_size is not None:
            at.setdefault((_series_label(row, extra), row.world_size), []).append(row)
    for (label, workers), (row, *others) in at.items():
        low, high = _bounds(row, metric)
        if others or low is None or high is None:
            continue
        value = getattr(row, metric)
        axes.errorbar(
            workers + offsets[label], value, yerr=_yerr([value], [(low, high)]),
            color=styles[label][0], capsize=4, linewidth=1.2,
        )  # fmt: skip
    return drawn


def _bounds(row: Any, metric: str) -> tuple[float | None, float | None]:
    """A figure's 95 % interval (`<metric>_low`, `<metric>_high`), or (None, None)."""
    return getattr(row, f"{metric}_low", None), getattr(row, f"{metric}_high", None)


def _yerr(
    heights: Sequence[float], bounds: Sequence[tuple[float | None, float | None]]
) -> list[list[float]]:
    """matplotlib's `yerr` (below, above) of points or bars of `heights`: 0 where one has no
    interval, never negative (a figure outside its interval, which `accelexp.stats` does not
    make but a run logged by an older version may hold, would stop matplotlib, and with it the
    whole report)."""
    below = [
        max(h - low, 0.0) if low is not None else 0.0
        for h, (low, _) in zip(heights, bounds, strict=True)
    ]
    above = [
        max(high - h, 0.0) if high is not None else 0.0
        for h, (_, high) in zip(heights, bounds, strict=True)
    ]
    return [below, above]


def throughput_figure(rows: Sequence[Row]) -> Any | None:
    """samples/s against workers, a line per (parallelism, precision[, what else varies]), from
    0; each series' ideal linear scaling from its fewest workers dashed in its colour. Runs all
    of one worker count scale nothing: a bar per configuration instead (`_throughput_bars`)."""
    series = _series(rows, "samples_per_s")
    if not series:
        return None
    if len(_workers(series)[0]) < 2:
        return _throughput_bars(rows)
    figure, axes = _figure()
    drawn = _draw_series(axes, series, rows, "samples_per_s")
    ideals = []
    for label, points in series.items():
        if len(points) < 2:
            continue  # one worker count: nothing to scale to
        line = drawn[label]
        first_w, first_v = points[0]
        ideal = [first_v * w / first_w for w, _ in points]
        (dashed,) = axes.plot(
            line.get_xdata(), ideal, linestyle="--", color=line.get_color(), alpha=0.6
        )
        ideals.append(dashed)
    _workers_axis(axes, series)
    if unmeasured := _unmeasured_label(rows):
        axes.set_xlabel(f"{axes.get_xlabel()}\n{unmeasured}")
    axes.set_ylabel("samples/s (steady state; bars: 95 % interval)")
    axes.set_ylim(bottom=0)
    axes.set_title(f"Throughput vs workers\n{_rows_subject(rows)}")
    entries = [(line, label) for label, line in drawn.items()]
    if ideals:  # one entry, a dash in each series' colour
        entries.append((tuple(ideals), IDEAL_LABEL))
    _legend_outside(figure, entries, handlelength=3)
    return figure


def _unmeasured_label(rows: Sequence[Row]) -> str:
    """`not plotted: 2 runs without a throughput (see the table's notes)`, or ""."""
    unmeasured = sum(row.samples_per_s is None for row in rows)
    if not unmeasured:
        return ""
    runs = "run" if unmeasured == 1 else "runs"
    return f"not plotted: {unmeasured} {runs} without a throughput (see the table's notes)"


def _throughput_bars(rows: Sequence[Row]) -> Any:
    """samples/s of runs that all had one worker count: a bar per configuration from 0, in its
    series' colour (as in the other plots), with its 95 % interval; a contended row hatched."""
    measured = [r for r in rows if r.samples_per_s is not None and r.world_size is not None]
    extra = _row_extras(rows)
    styles = series_styles(_series_label(row, extra) for row in rows)
    figure, axes = _figure()
    heights = [row.samples_per_s for row in measured]
    errors = _yerr(heights, [_bounds(row, "samples_per_s") for row in measured])
    labelled: set[str] = set()
    for i, row in enumerate(measured):
        label = _series_label(row, extra)
        axes.bar(
            i, row.samples_per_s, width=0.6, color=styles[label][0],
            hatch="//" if row.noise else "", edgecolor="white",
            yerr=[[errors[0][i]], [errors[1][i]]], capsize=4,
            label=label if label not in labelled else None,
        )  # fmt: skip
        labelled.add(label)
    names = [f"{row.label}\n({row.noise})" if row.noise else row.label for row in measured]
    top = max(h + e for h, e in zip(heights, errors[1], strict=True))
    workers = measured[0].world_size
    _bar_axes(axes, names, _unmeasured_label(rows) or "configuration",
              "samples/s (steady state; bars: 95 % interval)", top * 1.1)  # fmt: skip
    axes.tick_params(axis="x", labelsize="small")
    each = f"{workers} worker{'s' if workers != 1 else ''} each"
    axes.set_title(f"Throughput by configuration ({each})\n{_rows_subject(rows)}")
    _legend_outside(figure)
    return figure


def efficiency_figure(rows: Sequence[Row]) -> Any | None:
    """Scaling efficiency (speedup ÷ workers ratio) against workers, from 0; 1.0 is linear.
    None with fewer than two worker counts: nothing scaled, and an efficiency at one count is
    only the speedup again."""
    series = _series(rows, "scaling_efficiency")
    if len(_workers(series)[0]) < 2:
        return None
    figure, axes = _figure()
    _draw_series(axes, series, rows, "scaling_efficiency")
    axes.axhline(1.0, label="ideal: 1.0 (linear scaling)", **REFERENCE)
    _workers_axis(axes, series)
    axes.set_ylabel("scaling efficiency (speedup ÷ workers ratio)")
    top = max(value for points in series.values() for _, value in points)
    axes.set_ylim(0, max(1.0, top) * 1.1)
    axes.set_title(f"Scaling efficiency vs workers\n{_rows_subject(rows)}")
    _legend_outside(figure)
    return figure


# --- AMP gain -----------------------------------------------------------------------------------
def amp_gain_figure(rows: Sequence[Row]) -> Any | None:
    """Grouped bars from 0: per parallelism × workers (× what else varies), one bar per mixed
    precision with its AMP gain (throughput ÷ the like-for-like fp32 run's), its value on top;
    a line at 1.0× is fp32."""
    gained = [row for row in rows if row.amp_gain is not None and row.world_size is not None]
    if not gained:
        return None
    extra = _row_extras(gained)
    gains: dict[tuple[str, ...], dict[str, list[Row]]] = {}
    for row in gained:
        group = (row.parallelism, f"×{row.world_size}", *(getattr(row, k) for k in extra))
        gains.setdefault(group, {}).setdefault(row.precision, []).append(row)
    known = [p for p in PRECISION_ORDER if any(p in g for g in gains.values())]
    precisions = known + sorted({p for g in gains.values() for p in g} - set(known))

    figure, axes = _figure()
    width = 0.8 / len(precisions)
    top = 1.0
    for j, precision in enumerate(precisions):
        places = [i for i, group in enumerate(gains.values()) if precision in group]
        bar_rows = [group[precision] for group in gains.values() if precision in group]
        heights = [statistics.median(row.amp_gain for row in same) for same in bar_rows]
        # a bar of one row carries its 95 % interval
        bounds = [_bounds(same[0], "amp_gain") if len(same) == 1 else (None, None)
                  for same in bar_rows]  # fmt: skip
        errors = _yerr(heights, bounds)
        offset = (j - (len(precisions) - 1) / 2) * width
        bars = axes.bar(
            [i + offset for i in places],
            heights,
            width=width * 0.95,
            color=PALETTE[j % len(PALETTE)],
            hatch=HATCHES[j % len(HATCHES)],
            edgecolor="white",
            label=precision,
            yerr=errors,
            capsize=4,
        )
        for bar, height, above in zip(bars, heights, errors[1], strict=True):  # over its bar
            middle = bar.get_x() + bar.get_width() / 2
            axes.annotate(f"{height:.2f}×", (middle, height + above), xytext=(0, 2),
                          textcoords="offset points", ha="center", va="bottom",
                          fontsize="small")  # fmt: skip
        top = max(top, *(h + e for h, e in zip(heights, errors[1], strict=True)))
    axes.axhline(1.0, label="fp32 (1.0×)", **REFERENCE)
    _bar_axes(
        axes, ["\n".join(group) for group in gains], "parallelism, workers",
        "AMP gain (× fp32 samples/s, like for like)", top * 1.18,
    )  # fmt: skip
    axes.set_title(f"AMP gain over fp32\n{_rows_subject(gained)}")
    _legend_outside(figure, title="precision")
    return figure


# --- accuracy against time ----------------------------------------------------------------------
Curve = Sequence[tuple[float, float, float, float]]  # (elapsed s, accuracy, its low, its high)


def _accuracy_curve(runs: Sequence[RunRecord]) -> Curve:
    """(elapsed s, validation accuracy, its 95 % low, high) per epoch: one run's own points
    (low = high = the point), or over several runs (a configuration's repeats) the mean of the
    epochs every run logged, the accuracy with its t interval over the runs."""
    histories = []
    for run in runs:
        elapsed = dict(run.history(ELAPSED_S))
        points = {s: (elapsed[s], acc) for s, acc in run.history(VAL_ACC) if s in elapsed}
        if points:
            histories.append(points)
    if len(histories) <= 1:
        return [(t, acc, acc, acc) for h in histories for t, acc in h.values()]
    curve = []
    for epoch in sorted(set.intersection(*(set(h) for h in histories))):
        accuracy = stats.across_repeats([h[epoch][1] for h in histories])
        elapsed = statistics.fmean(h[epoch][0] for h in histories)
        curve.append((elapsed, accuracy.value, accuracy.low, accuracy.high))
    return curve


def accuracy_limits(curves: Iterable[Curve]) -> tuple[float, float]:
    """The accuracy axis: the points and their intervals, widened about their middle to at
    least MIN_ACCURACY_SPAN and kept within 0–1, so that runs apart by less than their
    noise are not drawn apart."""
    points = [point for curve in curves for point in curve]
    if not points:
        return 0.0, 1.0
    low, high = min(p[2] for p in points), max(p[3] for p in points)
    if high - low < MIN_ACCURACY_SPAN:
        middle = (low + high) / 2
        low, high = middle - MIN_ACCURACY_SPAN / 2, middle + MIN_ACCURACY_SPAN / 2
        low, high = (0.0, MIN_ACCURACY_SPAN) if low < 0 else (low, high)
        low, high = (1.0 - MIN_ACCURACY_SPAN, 1.0) if high > 1 else (low, high)
    margin = 0.05 * (high - low)
    return max(0.0, low - margin), min(1.0, high + margin)


def accuracy_vs_time_figure(rows: Sequence[Row], records: Sequence[RunRecord]) -> Any | None:
    """Validation accuracy against elapsed training time (from 0), one line per configuration
    in the table's order, each in its own colour and marker; a configuration's repeats drawn as
    their mean per epoch with its 95 % interval as error bars. The accuracy axis spans at least
    MIN_ACCURACY_SPAN (`accuracy_limits`)."""
    runs_of = {grouped.first.run_id: grouped for grouped in group(records)}
    curves = []
    for row in rows:
        grouped = runs_of.get(row.run_id)
        if grouped is None:
            continue
        runs = grouped.shown or grouped.finished or grouped.records
        if curve := _accuracy_curve(runs):
            curves.append((row, curve, len(runs)))
    if not curves:
        return None
    plotted = [row for row, *_ in curves]
    extra = _row_extras(plotted)
    labels = []
    for row, _, runs in curves:
        parts = [row.parallelism, f"×{row.world_size}", row.precision]
        parts += [getattr(row, k) for k in extra]
        if row.status != FINISHED:
            parts.append(f"({row.status})")
        if runs > 1:
            parts.append(f"(mean of {runs})")
        labels.append(" ".join(map(str, parts)))
    styles = series_styles(range(len(curves)))  # one per run, even when two runs look alike
    figure, axes = _figure()
    for i, ((_, curve, runs), label) in enumerate(zip(curves, labels, strict=True)):
        colour, marker = styles[i]
        x, y, low, high = zip(*curve, strict=True)
        axes.plot(x, y, color=colour, marker=marker, label=label)
        if runs > 1:
            errors = _yerr(y, list(zip(low, high, strict=True)))
            axes.errorbar(x, y, yerr=errors, color=colour, capsize=3, linestyle="none")
    axes.set_xlim(left=0)
    axes.set_ylim(*accuracy_limits(curve for _, curve, _ in curves))
    axes.set_xlabel("elapsed training time (s)")
    repeated = any(runs > 1 for *_, runs in curves)
    bars = " (bars: 95 % interval over repeats)" if repeated else ""
    axes.set_ylabel(f"validation accuracy{bars}")
    axes.set_title(f"Validation accuracy vs training time\n{_rows_subject(plotted)}")
    axes.grid(alpha=0.3)
    _legend_outside(figure)
    return figure


# --- the speed-up ladder and the time breakdown -------------------------------------------------
def ladder_figure(rows: Sequence[LadderRow]) -> Any | None:
    """A bar of samples/s per rung from 0, each labelled with its gain over fp32 (and its compile
    time); a rung not measured has no bar, its status written in its place."""
    measured = [row.samples_per_s for row in rows if row.samples_per_s is not None]
    if not measured:
        return None
    figure, axes = _figure((8, 4.5))
    heights = [row.samples_per_s or 0 for row in rows]
    bounds = [_bounds(row, "samples_per_s") for row in rows]
    errors = _yerr(heights, bounds)  # each rung's 95 % interval, where it has one
    top = max(h + e for h, e in zip(heights, errors[1], strict=True))
    positions = range(len(rows))
    bars = axes.bar(
        positions,
        heights,
        color=["0.6" if row.rung_index == 0 else "C0" for row in rows],  # gray: the reference
        width=0.6,
        yerr=errors,
        capsize=4,
    )
    for bar, row, above in zip(bars, rows, errors[1], strict=True):
        middle = bar.get_x() + bar.get_width() / 2
        if row.samples_per_s is None:
            axes.text(middle, 0.02 * top, row.status, ha="center", va="bottom", color="C3")
            continue
        label = f"{row.gain_vs_fp32:.2f}×" if row.gain_vs_fp32 is not None else ""
        if row.compile_s is not None:
            label += f"\n+{row.compile_s:.0f} s compile"
        axes.text(middle, bar.get_height() + above + 0.01 * top, label, ha="center", va="bottom")
    _bar_axes(
        axes, [row.rung for row in rows], "rung (each adds one switch to the one before)",
        "images/s (steady state; bars: 95 % interval)", top * 1.2,
    )  # fmt: skip
    axes.set_title(f"Speed-up ladder (labels: gain over fp32)\n{ladder_subject(rows)}")
    return figure


def plot_ladder(rows: Sequence[LadderRow], path: Path) -> Path | None:
    """`ladder_figure` saved to `path`; None (and no file) when no rung was measured."""
    return _save(ladder_figure(rows), path)


def time_breakdown_figure(rows: Sequence[DiagnosisRow], subject: str) -> Any | None:
    """One horizontal bar per run (first on top), stacked from the SEGMENTS' shares of its last
    epoch's step time, labelled with the run and its bound; a run without time accounting has no
    bar, a note in its place. The legend sits under the axes."""
    if not any(row.accounted for row in rows):
        return None
    figure, axes = _figure((9, 1.6 + 0.55 * len(rows)))
    positions = list(range(len(rows)))
    left = [0.0] * len(rows)
    for segment in SEGMENTS:
        shares = [getattr(row, f"{segment}_pct") or 0.0 for row in rows]
        colour, text_colour = SEGMENT_COLOURS[segment]
        bars = axes.barh(positions, shares, left=left, height=0.6, color=colour, label=segment)
        labels = [f"{share:.0f}%" if share >= 7 else "" for share in shares]  # when it fits
        axes.bar_label(bars, labels, label_type="center", color=text_colour, fontsize="small")
        left = [start + share for start, share in zip(left, shares, strict=True)]
    for position, row in zip(positions, rows, strict=True):
        if not row.accounted:
            missing = "still running" if row.status == RUNNING else "no time accounting"
            axes.text(1, position, missing, va="center", color="0.4")
    axes.set_yticks(positions, [_bar_label(row) for row in rows])
    axes.invert_yaxis()  # the table's first run on top
    axes.set_xlim(0, 100)
    axes.set_xlabel("share of the last epoch's timed step time (%)")
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)
    axes.set_title(f"Where the step time went — {subject}")
    figure.legend(loc="outside lower center", ncols=len(SEGMENTS), frameon=False)
    return figure


def plot_time_breakdown(rows: Sequence[DiagnosisRow], subject: str, path: Path) -> Path | None:
    """`time_breakdown_figure` saved to `path`; None (and no file) without time accounting."""
    return _save(time_breakdown_figure(rows, subject), path)


def _bar_label(row: DiagnosisRow) -> str:
    """`run name` over `bound: input`, and the status of a run that did not finish."""
    status = f" ({row.status})" if row.status != FINISHED else ""
    return f"{row.run_name}\nbound: {row.bound or '—'}{status}"


# --- writing ------------------------------------------------------------------------------------
def write_time_plot(rows: Sequence[DiagnosisRow], subject: str, out_dir: Path) -> list[Path]:
    """TIME_PLOT in `out_dir` when a run has time accounting; else no file (nor an older one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return save_or_remove(time_breakdown_figure(rows, subject), out_dir / TIME_PLOT)


def write_plots(
    rows: Sequence[Row],
    records: Sequence[RunRecord],
    out_dir: Path,
    ladder_rows: Sequence[LadderRow] = (),
) -> list[Path]:
    """The plots that have data, as PNGs in `out_dir`: PLOT_NAMES (AMP_GAIN_PLOT when a run has
    an AMP gain), and LADDER_PLOT for a ladder. A plot without data leaves no file, nor an older
    report's."""
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {
        THROUGHPUT_PLOT: throughput_figure(rows),
        EFFICIENCY_PLOT: efficiency_figure(rows),
        AMP_GAIN_PLOT: amp_gain_figure(rows),
        ACCURACY_PLOT: accuracy_vs_time_figure(rows, records),
        LADDER_PLOT: ladder_figure(ladder_rows),
    }
    return [
        path for name, figure in figures.items() for path in save_or_remove(figure, out_dir / name)
    ]
