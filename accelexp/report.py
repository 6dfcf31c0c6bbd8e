"""Put the runs of a sweep or an experiment side by side: speedup, scaling efficiency, AMP gain.

    accelexp-report --experiment scaling
    accelexp-report --sweep latest --format markdown
    accelexp-report --sweep <parent run id> --baseline "world_size=1,precision=fp32,parallelism=ddp"

One row per run. Throughput is the median `samples_per_s` of the epochs after the first (the first
pays for warm-up: allocator, cuDNN autotuning, process start); a one-epoch run uses its only epoch.
Speedup divides it by the baseline run's, preferring a baseline of the same model, data and
parallelism; scaling efficiency is speedup per added worker; AMP gain divides a mixed-precision
row's throughput by the fp32 run of the same parallelism, world size, model and data.

`compare` is pure (records in, rows out); the formats, plots and `main` are thin layers on it.
MLflow is read and written only through `accelexp.tracking.query`.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from accelexp.errors import AccelexpError
from accelexp.tracking import query
from accelexp.tracking.query import RunRecord

DEFAULT_BASELINE = "world_size=1,precision=fp32"
DEFAULT_TRACKING_URI = "sqlite:///outputs/mlflow.db"
BASELINE_KEYS = ("world_size", "precision", "parallelism", "model", "data")
CONFIG_KEYS = ("parallelism", "world_size", "precision", "model", "data")  # how a run is named
FORMATS = ("table", "csv", "markdown", "json")
PARALLELISM_ORDER = ("single", "dp", "ddp", "horovod", "model", "hybrid")
PRECISION_ORDER = ("fp32", "amp", "bf16")
PLOT_NAMES = ("throughput.png", "efficiency.png", "accuracy_vs_time.png")


class BaselineError(AccelexpError):
    """The --baseline selector is malformed or matches no finished run."""


@dataclass
class Row:
    """One run compared with its baseline; None where a figure does not apply or is missing."""

    run_name: str
    run_id: str
    status: str
    parallelism: str
    world_size: int | None
    precision: str
    model: str
    data: str
    samples_per_s: float | None = None
    speedup: float | None = None
    scaling_efficiency: float | None = None
    amp_gain: float | None = None
    best_val_acc: float | None = None
    test_acc: float | None = None
    time_to_target_s: float | None = None
    peak_mem_mb: float | None = None
    baseline_run: str | None = None


COLUMNS = tuple(f.name for f in fields(Row))


# --- the comparison -----------------------------------------------------------------------------
def parse_baseline(text: str | Mapping[str, str]) -> dict[str, str]:
    """Parse a selector: 'world_size=1,precision=fp32' -> {'world_size': '1', ...}."""
    if isinstance(text, Mapping):
        pairs = {str(k): str(v) for k, v in text.items()}
    else:
        pairs = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or not key.strip() or not value.strip():
                raise BaselineError(
                    f"--baseline {text!r}: {part!r} is not key=value; use key=value pairs over "
                    f'{", ".join(BASELINE_KEYS)}, e.g. --baseline "{DEFAULT_BASELINE}"'
                )
            pairs[key.strip()] = value.strip()
    unknown = sorted(set(pairs) - set(BASELINE_KEYS))
    if unknown or not pairs:
        raise BaselineError(
            f"--baseline {text!r}: use key=value pairs over {', '.join(BASELINE_KEYS)}"
            + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        )
    return pairs


def throughput(record: RunRecord) -> float | None:
    """Median samples/s over the epochs after the first; the only epoch if there is one."""
    values = [value for _, value in record.history("samples_per_s")]
    if not values:
        return None
    return statistics.median(values[1:] or values)


def _world_size(record: RunRecord) -> int | None:
    try:
        return int(record.setting("world_size") or "")
    except ValueError:
        return None


def _describe(record: RunRecord) -> str:
    config = " ".join(f"{key}={record.setting(key) or '?'}" for key in CONFIG_KEYS)
    return f"{config} ({record.status})" if record.status != "FINISHED" else config


def _order(value: str | None, known: Sequence[str]) -> tuple[int, str]:
    value = value or ""
    return (known.index(value) if value in known else len(known), value)


def _sort_key(row: Row) -> tuple:
    return (
        _order(row.parallelism, PARALLELISM_ORDER),
        row.world_size if row.world_size is not None else sys.maxsize,
        _order(row.precision, PRECISION_ORDER),
        row.model,
        row.data,
        row.run_name,
    )


def compare(
    records: Sequence[RunRecord],
    baseline: str | Mapping[str, str] = DEFAULT_BASELINE,
    *,
    strict: bool = True,
) -> list[Row]:
    """One row per run, sorted by parallelism, world size and precision.

    The baseline is a finished run matching every key of `baseline`; of several, the one sharing
    the row's model, data and parallelism (in that order of importance), then the newest. With
    `strict`, no matching run is a `BaselineError` listing the configurations that exist;
    otherwise speedup and efficiency stay blank.
    """
    wanted = parse_baseline(baseline)
    speed = {r.run_id: throughput(r) for r in records if r.status == "FINISHED"}
    measured = [r for r in records if speed.get(r.run_id) is not None]
    candidates = [r for r in measured if all(r.setting(k) == v for k, v in wanted.items())]
    if strict and not candidates:
        raise BaselineError(_no_baseline_message(records, wanted))

    rows = []
    for record in records:
        row = Row(
            run_name=record.name,
            run_id=record.run_id,
            status=record.status,
            parallelism=record.setting("parallelism") or "",
            world_size=_world_size(record),
            precision=record.setting("precision") or "",
            model=record.setting("model") or "",
            data=record.setting("data") or "",
        )
        samples = speed.get(record.run_id)
        if samples is not None:
            _fill(row, record, samples, candidates, measured, speed)
        rows.append(row)
    return sorted(rows, key=_sort_key)


def _fill(
    row: Row,
    record: RunRecord,
    samples: float,
    candidates: list[RunRecord],
    measured: list[RunRecord],
    speed: dict[str, float | None],
) -> None:
    row.samples_per_s = samples
    row.best_val_acc = record.metrics.get("best_val_acc")
    row.test_acc = record.metrics.get("test_acc")
    row.time_to_target_s = record.metrics.get("time_to_target_s")
    peaks = [value for _, value in record.history("peak_mem_mb")]
    row.peak_mem_mb = max(peaks) if peaks else record.metrics.get("peak_mem_mb")

    if candidates:
        base = max(
            candidates,
            key=lambda c: (
                c.setting("model") == row.model,
                c.setting("data") == row.data,
                c.setting("parallelism") == row.parallelism,
                c.start_time,
            ),
        )
        row.baseline_run = base.name
        row.speedup = samples / speed[base.run_id]
        base_world = _world_size(base)
        if row.world_size and base_world:
            row.scaling_efficiency = row.speedup / (row.world_size / base_world)

    if row.precision != "fp32":
        same = [
            r
            for r in measured
            if r.setting("precision") == "fp32"
            and all(r.setting(k) == getattr(row, k) for k in ("parallelism", "model", "data"))
            and _world_size(r) == row.world_size
        ]
        if same:
            fp32 = max(same, key=lambda r: r.start_time)
            row.amp_gain = samples / speed[fp32.run_id]


def _no_baseline_message(records: Sequence[RunRecord], wanted: dict[str, str]) -> str:
    selector = ",".join(f"{k}={v}" for k, v in wanted.items())
    configs = sorted({_describe(r) for r in records})
    unusable = [r.name for r in records if all(r.setting(k) == v for k, v in wanted.items())]
    why = f" (matching, but not finished with a throughput: {', '.join(unusable)})"
    why = why if unusable else ""
    finished = [r for r in records if r.status == "FINISHED"]
    example = min(  # the likeliest baseline: fp32 with the fewest workers
        finished,
        key=lambda r: (r.setting("precision") != "fp32", _world_size(r) or 0),
        default=None,
    )
    hint = (
        f'; e.g. --baseline "world_size={example.setting("world_size")},'
        f'precision={example.setting("precision")}"'
        if example is not None
        else ""
    )
    return (
        f"No finished run matches the baseline {selector}{why}. "
        f"Configurations in this selection: {'; '.join(configs)}. Pass --baseline with one of "
        f"them{hint}."
    )


# --- formats ------------------------------------------------------------------------------------
HEADERS = {
    "run_name": "run",
    "status": "status",
    "parallelism": "parallelism",
    "world_size": "workers",
    "precision": "precision",
    "model": "model",
    "data": "data",
    "samples_per_s": "samples/s",
    "speedup": "speedup",
    "scaling_efficiency": "efficiency",
    "amp_gain": "AMP gain",
    "best_val_acc": "best val acc",
    "test_acc": "test acc",
    "time_to_target_s": "time to target (s)",
    "peak_mem_mb": "peak mem (MB)",
    "baseline_run": "baseline",
}
DISPLAY = {
    "samples_per_s": "{:.1f}",
    "speedup": "{:.2f}×",
    "scaling_efficiency": "{:.2f}",
    "amp_gain": "{:.2f}×",
    "best_val_acc": "{:.4f}",
    "test_acc": "{:.4f}",
    "time_to_target_s": "{:.1f}",
    "peak_mem_mb": "{:.1f}",
}
NUMERIC = set(DISPLAY) | {"world_size"}


def _display(name: str, value: Any) -> str:
    if value is None:
        return ""
    return DISPLAY.get(name, "{}").format(value)


def to_csv(rows: Sequence[Row]) -> str:
    """Every column, numbers unrounded, blanks for missing figures."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow("" if v is None else v for v in asdict(row).values())
    return out.getvalue()


def to_json(rows: Sequence[Row]) -> str:
    """A list of row objects, numbers unrounded, null for missing figures."""
    return json.dumps([asdict(row) for row in rows], indent=2) + "\n"


def to_markdown(rows: Sequence[Row]) -> str:
    """A GitHub table, rounded for reading; failed runs in bold."""
    lines = [
        "| " + " | ".join(HEADERS.values()) + " |",
        "|" + "|".join("---:" if k in NUMERIC else "---" for k in HEADERS) + "|",
    ]
    for row in rows:
        cells = []
        for key in HEADERS:
            text = _display(key, getattr(row, key)).replace("|", "\\|")
            if key == "status" and row.status != "FINISHED":
                text = f"**{text}**"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_table(rows: Sequence[Row], title: str | None = None) -> Any:
    """A rich Table of the rows (print it with a rich Console)."""
    from rich.table import Table

    table = Table(title=title, header_style="bold")
    for key, header in HEADERS.items():
        table.add_column(header, justify="right" if key in NUMERIC else "left")
    for row in rows:
        style = "red" if row.status == "FAILED" else ("yellow" if row.status != "FINISHED" else "")
        table.add_row(*(_display(k, getattr(row, k)) for k in HEADERS), style=style or None)
    return table


# --- plots --------------------------------------------------------------------------------------
def _figure() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), layout="constrained")
    return figure, figure.add_subplot()


def _varying(configs: Sequence[Mapping[str, str]]) -> tuple[str, ...]:
    """model and/or data when the configurations differ in them (worth naming in a legend)."""
    return tuple(k for k in ("model", "data") if len({c[k] for c in configs}) > 1)


def _series(rows: Sequence[Row], metric: str) -> dict[str, list[tuple[int, float]]]:
    """label -> [(workers, median of metric)] for each (parallelism, precision[, model, data])."""
    extra = _varying([{"model": r.model, "data": r.data} for r in rows])
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
    extra = _varying([{k: r.setting(k) or "" for k in ("model", "data")} for r, _ in curves])
    figure, axes = _figure()
    for record, points in sorted(curves, key=lambda c: c[0].name):
        parts = [record.setting("parallelism"), f"×{record.setting('world_size')}"]
        parts += [record.setting("precision"), *(record.setting(k) for k in extra)]
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


def write_plots(rows: Sequence[Row], records: Sequence[RunRecord], out_dir: Path) -> list[Path]:
    """The three plots that have data, as PNGs in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    throughput_png, efficiency_png, accuracy_png = (out_dir / name for name in PLOT_NAMES)
    made = [
        plot_throughput(rows, throughput_png),
        plot_efficiency(rows, efficiency_png),
        plot_accuracy_vs_time(records, accuracy_png),
    ]
    for name in PLOT_NAMES:  # a plot skipped now must not leave an older report's file behind
        if out_dir / name not in made:
            (out_dir / name).unlink(missing_ok=True)
    return [path for path in made if path is not None]


def write_tables(rows: Sequence[Row], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / "summary.csv", out_dir / "summary.md"
    csv_path.write_text(to_csv(rows))
    md_path.write_text(to_markdown(rows))
    return [csv_path, md_path]


# --- entry points -------------------------------------------------------------------------------
def write_sweep_report(
    tracking_uri: str, sweep_run_id: str, out_dir: Path, baseline: str = DEFAULT_BASELINE
) -> list[Path]:
    """summary.csv, summary.md and the plots of a sweep, logged under `report/` of its parent run.

    Called at the end of every sweep, so a sweep without a baseline run still gets its table
    (speedup and efficiency left blank) instead of an error.
    """
    out_dir = Path(out_dir)
    records = query.child_runs(tracking_uri, sweep_run_id)
    rows = compare(records, baseline, strict=False)
    paths = write_tables(rows, out_dir) + write_plots(rows, records, out_dir)
    query.log_artifacts(tracking_uri, sweep_run_id, paths, "report")
    return paths


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,+-]+", "_", name).strip("._") or "report"


def _select(args: argparse.Namespace) -> tuple[str, str, list[RunRecord]]:
    """(report name, title, runs) for --experiment and/or --sweep."""
    uri = args.tracking_uri
    if args.sweep is None:
        records = query.experiment_runs(uri, query.experiment_id(uri, args.experiment))
        name, title = args.experiment, f"Experiment {args.experiment}"
        if not records:
            raise query.NoRunsError(f"Experiment {args.experiment!r} has no runs in {uri}.")
        return name, title, records
    if args.sweep == "latest":
        parent = query.latest_sweep(uri, args.experiment)
    else:
        parent = query.run_record(uri, args.sweep)
        if args.experiment is not None:
            wanted = query.experiment_id(uri, args.experiment)
            if parent.experiment_id != wanted:
                raise query.UnknownRunError(
                    f"Run {args.sweep} is not in experiment {args.experiment!r}."
                )
    records = query.child_runs(uri, parent.run_id)
    if not records:
        raise query.NoRunsError(
            f"Run {parent.name!r} ({parent.run_id}) has no child runs: it is not a sweep's "
            f"parent run, or its sweep started no job."
        )
    return parent.name, f"Sweep {parent.name} ({parent.run_id})", records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accelexp-report",
        description="Compare the runs of an experiment or a sweep: throughput, speedup, scaling "
        "efficiency, AMP gain, accuracy and memory; writes summary.csv/.md and plots.",
        epilog="examples:\n  accelexp-report --experiment scaling\n"
        "  accelexp-report --sweep latest --format markdown\n"
        '  accelexp-report --sweep latest --baseline "world_size=1,precision=fp32,'
        'parallelism=ddp"',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--experiment", metavar="NAME", help="all runs of this MLflow experiment")
    parser.add_argument(
        "--sweep",
        metavar="RUN_ID|latest",
        help="the runs of one sweep: its parent run id, or `latest` (within --experiment if given)",
    )
    parser.add_argument(
        "--tracking-uri",
        default=DEFAULT_TRACKING_URI,
        help="the MLflow store (default: %(default)s)",
    )
    parser.add_argument(
        "--baseline",
        default=DEFAULT_BASELINE,
        help=f"key=value,... over {', '.join(BASELINE_KEYS)} (default: %(default)s)",
    )
    parser.add_argument("--format", choices=FORMATS, default="table", help="stdout format")
    parser.add_argument(
        "--output-dir", type=Path, help="default: outputs/reports/<sweep or experiment name>"
    )
    parser.add_argument("--no-plots", action="store_true", help="write the tables only")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `accelexp-report` command. Exit 0, or 2 with one line on stderr."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.experiment is None and args.sweep is None:
        parser.error("give --experiment NAME and/or --sweep RUN_ID|latest")
    try:
        parse_baseline(args.baseline)
        name, title, records = _select(args)
        rows = compare(records, args.baseline)
        out_dir = args.output_dir or Path("outputs") / "reports" / _safe_name(name)
        written = write_tables(rows, out_dir)
        if not args.no_plots:
            written += write_plots(rows, records, out_dir)
    except (AccelexpError, OSError) as error:
        print(f"accelexp-report: error: {error}", file=sys.stderr)
        return 2

    if args.format == "table":
        from rich.console import Console

        table = render_table(rows, f"{title} — baseline {args.baseline}")
        console = Console()
        if not console.is_terminal:  # a pipe or a file: the whole table, however wide
            console = Console(width=Console(width=10_000).measure(table).maximum)
        console.print(table)
    else:
        render = {"csv": to_csv, "markdown": to_markdown, "json": to_json}[args.format]
        sys.stdout.write(render(rows))

    print(f"Wrote {', '.join(p.name for p in written)} to {out_dir}", file=sys.stderr)
    skipped = [] if args.no_plots else [n for n in PLOT_NAMES if out_dir / n not in written]
    if skipped:
        print(f"Skipped {', '.join(skipped)}: no data to plot", file=sys.stderr)
    for row in rows:
        if row.status == "FAILED":
            print(
                f"Run {row.run_name} ({row.run_id}) FAILED: its error is in the run's "
                f"artifact error.txt",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
