"""The report's plots as PNGs (matplotlib, Agg): throughput and scaling efficiency against workers,
accuracy against time, the speed-up ladder's bars, and (with --diagnose) where each run's step time
went."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from accelexp.report.compare import Row, setting
from accelexp.report.diagnose import SEGMENTS, DiagnosisRow
from accelexp.report.ladder import LadderRow, ladder_subject
from accelexp.tracking.query import RunRecord

PLOT_NAMES = ("throughput.png", "efficiency.png", "accuracy_vs_time.png")
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
VARYING_KEYS = ("speed", "model", "data")  # named in a legend when they differ between runs


def _figure(size: tuple[float, float] = (7, 4.5)) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    return figure, figure.add_subplot()


def _varying(configs: Sequence[Mapping[str, str]]) -> tuple[str, ...]:
    """The VARYING_KEYS in which the configurations differ (worth naming in a legend)."""
    return tuple(k for k in VARYING_KEYS if len({c[k] for c in configs}) > 1)


def _series(rows: Sequence[Row], metric: str) -> dict[str, list[tuple[int, float]]]:
    """label -> [(workers, median of metric)] per (parallelism, precision[, speed, model, data])."""
    extra = _varying([{k: getattr(r, k) for k in VARYING_KEYS} for r in rows])
    groups: dict[str, dict[int, list[float]]] = {}
    for row in rows:
        value = getattr(row, metric)
        if value is None or row.world_size is None:
            continue
        label = " ".join([row.parallelism, row.precision, *(getattr(row, k) for k in extra)])
        groups.setdefault(label, {}).setdefault(row.world_size, []).append(value)
    return {
        label: [(w, statistics.median(v)) for w, v in sorted(points.items())]
        for label, points in sorted(groups.items())
    }


def _workers_axis(axes: Any, series: dict[str, list[tuple[int, float]]]) -> None:
    axes.set_xticks(sorted({w for points in series.values() for w, _ in points}))
    axes.set_xlabel("workers (world size)")
    axes.grid(alpha=0.3)


def plot_throughput(rows: Sequence[Row], path: Path) -> Path | None:
    """samples/s vs workers per (parallelism, precision), dashed: ideal linear scaling."""
    series = _series(rows, "samples_per_s")
    if not series:
        return None
    figure, axes = _figure()
    for label, points in series.items():
        workers, values = zip(*points, strict=True)
        (line,) = axes.plot(workers, values, marker="o", label=label)
        first_w, first_v = points[0]
        ideal = [first_v * w / first_w for w in workers]
        axes.plot(workers, ideal, linestyle="--", color=line.get_color(), alpha=0.5)
    axes.plot([], [], linestyle="--", color="gray", label="ideal linear scaling")
    _workers_axis(axes, series)
    axes.set_ylabel("samples/s")
    axes.set_title("Throughput")
    axes.legend()
    figure.savefig(path, dpi=120)
    return path


def plot_efficiency(rows: Sequence[Row], path: Path) -> Path | None:
    """Scaling efficiency vs workers per (parallelism, precision); 1.0 is perfect."""
    series = _series(rows, "scaling_efficiency")
    if not series:
        return None
    figure, axes = _figure()
    for label, points in series.items():
        axes.plot(*zip(*points, strict=True), marker="o", label=label)
    axes.axhline(1.0, linestyle="--", color="gray", label="ideal")
    _workers_axis(axes, series)
    axes.set_ylabel("scaling efficiency")
    axes.set_ylim(bottom=0)
    axes.set_title("Scaling efficiency (speedup ÷ workers ratio)")
    axes.legend()
    figure.savefig(path, dpi=120)
    return path


def plot_accuracy_vs_time(records: Sequence[RunRecord], path: Path) -> Path | None:
    """Validation accuracy against training time, one line per run."""
    curves = []
    for record in records:
        elapsed = dict(record.history("elapsed_s"))
        points = [(elapsed[s], acc) for s, acc in record.history("val_acc") if s in elapsed]
        if points:
            curves.append((record, points))
    if not curves:
        return None
    extra = _varying([{k: setting(r, k) or "" for k in VARYING_KEYS} for r, _ in curves])
    figure, axes = _figure()
    for record, points in sorted(curves, key=lambda c: c[0].name):
        parts = [record.setting("parallelism"), f"×{record.setting('world_size')}"]
        parts += [record.setting("precision"), *(setting(record, k) for k in extra)]
        if record.status != "FINISHED":
            parts.append(f"({record.status})")
        axes.plot(*zip(*points, strict=True), marker=".", label=" ".join(map(str, parts)))
    axes.set_xlabel("elapsed training time (s)")
    axes.set_ylabel("validation accuracy")
    axes.set_title("Accuracy vs time")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.savefig(path, dpi=120)
    return path


def plot_ladder(rows: Sequence[LadderRow], path: Path) -> Path | None:
    """A bar of samples/s per rung from 0, each labelled with its gain over fp32 (and its compile
    time); a rung not measured has no bar, its status written in its place."""
    measured = [row.samples_per_s for row in rows if row.samples_per_s is not None]
    if not measured:
        return None
    figure, axes = _figure((8, 4.5))
    top = max(measured)
    positions = range(len(rows))
    bars = axes.bar(
        positions,
        [row.samples_per_s or 0 for row in rows],
        color=["0.6" if row.rung_index == 0 else "C0" for row in rows],  # gray: the reference
        width=0.6,
    )
    for bar, row in zip(bars, rows, strict=True):
        middle = bar.get_x() + bar.get_width() / 2
        if row.samples_per_s is None:
            axes.text(middle, 0.02 * top, row.status, ha="center", va="bottom", color="C3")
            continue
        label = f"{row.gain_vs_fp32:.2f}×" if row.gain_vs_fp32 is not None else ""
        if row.compile_s is not None:
            label += f"\n+{row.compile_s:.0f} s compile"
        axes.text(middle, bar.get_height() + 0.01 * top, label, ha="center", va="bottom")
    axes.set_xticks(list(positions), [row.rung for row in rows])
    axes.set_xlabel("rung (each adds one switch to the one before)")
    axes.set_ylabel("images/s (median of epochs after the first)")
    axes.set_ylim(0, top * 1.2)  # room for the labels above the bars
    axes.grid(axis="y", alpha=0.3)
    axes.set_axisbelow(True)
    axes.set_title(f"Speed-up ladder: {ladder_subject(rows)} (labels: gain over fp32)")
    figure.savefig(path, dpi=120)
    return path


def plot_time_breakdown(rows: Sequence[DiagnosisRow], subject: str, path: Path) -> Path | None:
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
            axes.text(1, position, "no time accounting", va="center", color="0.4")
    axes.set_yticks(positions, [_bar_label(row) for row in rows])
    axes.invert_yaxis()  # the table's first run on top
    axes.set_xlim(0, 100)
    axes.set_xlabel("share of the last epoch's timed step time (%)")
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)
    axes.set_title(f"Where the step time went — {subject}")
    figure.legend(loc="outside lower center", ncols=len(SEGMENTS), frameon=False)
    figure.savefig(path, dpi=120)
    return path


def _bar_label(row: DiagnosisRow) -> str:
    """`run name` over `bound: input`, and the status of a run that did not finish."""
    status = f" ({row.status})" if row.status != "FINISHED" else ""
    return f"{row.run_name}\nbound: {row.bound or '—'}{status}"


def write_time_plot(rows: Sequence[DiagnosisRow], subject: str, out_dir: Path) -> list[Path]:
    """TIME_PLOT in `out_dir` when a run has time accounting; else no file (nor an older one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = plot_time_breakdown(rows, subject, out_dir / TIME_PLOT)
    if path is None:
        (out_dir / TIME_PLOT).unlink(missing_ok=True)
    return [path] if path is not None else []


def write_plots(
    rows: Sequence[Row],
    records: Sequence[RunRecord],
    out_dir: Path,
    ladder_rows: Sequence[LadderRow] = (),
) -> list[Path]:
    """The plots that have data, as PNGs in `out_dir`: PLOT_NAMES, and LADDER_PLOT for a ladder."""
    out_dir.mkdir(parents=True, exist_ok=True)
    throughput_png, efficiency_png, accuracy_png = (out_dir / name for name in PLOT_NAMES)
    made = [
        plot_throughput(rows, throughput_png),
        plot_efficiency(rows, efficiency_png),
        plot_accuracy_vs_time(records, accuracy_png),
        plot_ladder(ladder_rows, out_dir / LADDER_PLOT),
    ]
    for name in (*PLOT_NAMES, LADDER_PLOT):  # a plot skipped now: no older report's file left
        if out_dir / name not in made:
            (out_dir / name).unlink(missing_ok=True)
    return [path for path in made if path is not None]
