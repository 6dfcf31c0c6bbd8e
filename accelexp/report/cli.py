"""The entry points: the `accelexp-report` command and the report a sweep writes when it ends.

Both select runs (an experiment, a sweep's children), compare them, and write the tables and
plots; the command also prints the tables in the `--format` asked for: the rich table shows the
columns a user needs at a glance in at most 100 characters (`RUNS_BRIEF`), `--wide` every column;
csv, markdown and json always carry every column. Under every table, the figures left blank and
why (a run too short to measure, a comparison refused as not like for like). With runs of the
speed-up ladder in the selection, the ladder follows the main table everywhere: a second rich
table, a second markdown table under a heading, a second CSV block after a blank line, and in JSON
`{"runs": [...], "ladder": [...]}` (a selection without a ladder keeps the plain list of runs).
Runs of a sweep with two objectives (`objective=[a,b]`, `accelexp.report.pareto`) get their
Pareto front the same way, after the ladder: a table, a markdown section, a CSV block, `"pareto"`
in JSON; and pareto.csv/.md/.png.

With `--diagnose` the command reports where each run's step time went instead: the diagnosis
table (stdout, diagnosis.csv/.md) and the stacked bars of time_breakdown.png; the comparison's
files are left as they are, and no baseline is needed. With `--memory`, likewise, each run's
speed against its memory per device (`accelexp.report.memory`): the memory table (stdout,
memory.csv/.md) and memory_vs_speed.png; when a run pulled a memory lever (fsdp, activation
checkpointing, cpu_offload), the lever table follows it as the ladder does (memory_levers.csv,
`{"runs": [...], "levers": [...]}` in JSON).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from accelexp.errors import AccelexpError
from accelexp.record import ENDED, FAILED
from accelexp.report.compare import (
    BASELINE_KEYS,
    DEFAULT_BASELINE,
    MIN_STEADY_STEPS,
    Row,
    compare,
    everything_set_aside,
    parse_baseline,
)
from accelexp.report.diagnose import DiagnosisRow, diagnose, footnote
from accelexp.report.formats import (
    BRIEF_WIDTH,
    DIAGNOSIS,
    LADDER,
    LADDER_BRIEF,
    RUNS,
    RUNS_BRIEF,
    diagnosis_markdown,
    render_table,
    to_csv,
    to_json,
    to_markdown,
    to_records,
    write_diagnosis_tables,
    write_tables,
)
from accelexp.report.html import write_html
from accelexp.report.ladder import LadderRow, ladder, ladder_subject
from accelexp.report.memory import (
    LEVERS_HEADING,
    LEVERS_TABLE,
    MEMORY,
    MEMORY_PLOT,
    LeverRow,
    MemoryRow,
    levers,
    memory_markdown,
    memory_rows,
    write_memory_report,
)
from accelexp.report.pareto import PARETO_PLOT, Front, front_markdown, notes, pareto, write_front
from accelexp.report.plots import LADDER_PLOT, PLOT_NAMES, TIME_PLOT, write_plots, write_time_plot
from accelexp.tracking import credentials, query
from accelexp.tracking.query import RunRecord

DEFAULT_TRACKING_URI = "sqlite:///outputs/mlflow.db"
FORMATS = ("table", "csv", "markdown", "json")
DIAGNOSIS_WIDTH = 100  # the diagnosis table's rich width at most (it folds long names to fit)


def write_sweep_report(
    tracking_uri: str, sweep_run_id: str, out_dir: Path, baseline: str = DEFAULT_BASELINE
) -> list[Path]:
    """summary.csv, summary.md, the plots and report.html of a sweep (and ladder.csv, ladder.md,
    ladder.png when its runs are rungs of the speed-up ladder; pareto.csv, pareto.md, pareto.png
    when they carry two objectives), logged under `report/` of its parent run: MLflow's artifact
    viewer shows report/report.html, tables and plots, on the parent run's page.

    Called at the end of every sweep, so a sweep without a baseline run still gets its table
    (speedup and efficiency left blank) instead of an error.
    """
    out_dir = Path(out_dir)
    parent = query.run_record(tracking_uri, sweep_run_id)
    records = query.child_runs(tracking_uri, sweep_run_id)
    rows = compare(records, baseline, strict=False)
    rungs = ladder(records)
    front = pareto(records)
    summary = everything_set_aside(records)
    paths = write_tables(rows, out_dir, rungs, summary) + write_plots(rows, records, out_dir, rungs)
    paths += write_front(front, out_dir)
    title = sweep_title(parent)
    subtitle = f"Baseline: {baseline}"
    paths.append(write_html(title, rows, out_dir, rungs, paths, subtitle, front, summary))
    query.log_artifacts(tracking_uri, sweep_run_id, paths, "report")
    return paths


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,+-]+", "_", name).strip("._") or "report"


def _select(args: argparse.Namespace) -> tuple[str, str, list[RunRecord]]:
    """(report name, title, runs) for --experiment and/or --sweep; a store that cannot be read
    (a file that is not SQLite, a server that answers something else) is one `QueryError`
    line, worded as run.py words it, instead of MLflow's and SQLAlchemy's tracebacks."""
    try:
        return _selected(args)
    except AccelexpError:
        raise
    except Exception as error:
        uri = credentials.redact(args.tracking_uri)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise query.QueryError(
            f"Cannot use the MLflow store {uri}: {credentials.redact(first)}. Give "
            f"--tracking-uri the store run.py wrote (e.g. sqlite:///outputs/mlflow.db)."
        ) from error


def _selected(args: argparse.Namespace) -> tuple[str, str, list[RunRecord]]:
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
    return parent.name, sweep_title(parent), records


def sweep_title(parent: RunRecord) -> str:
    """ "sweep 2026-12-01 ... (<id>)": a sweep's parent run is named "sweep ..." unless the user
    named it, and then the title says what it is."""
    prefix = "" if parent.name.lower().startswith("sweep") else "Sweep "
    return f"{prefix}{parent.name} ({parent.run_id})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accelexp-report",
        description="Compare the runs of an experiment or a sweep: steady-state throughput,\n"
        "speedup, scaling efficiency, AMP gain, accuracy and memory; writes summary.csv/.md\n"
        "and plots. Runs of the speed-up ladder (+experiment=speedups) also get the ladder:\n"
        "ladder.csv/.md/.png.\n\n"
        "Throughput leaves out warm-up; a run with fewer than "
        f"{MIN_STEADY_STEPS} steady (timed) steps is too\n"
        "short to measure. Speedup compares runs that differ only in parallelism, world size,\n"
        "precision and the keys --baseline names; AMP gain, runs that differ only in precision.\n"
        "Every figure left blank is listed under the table with the reason.",
        epilog="examples:\n  accelexp-report --experiment scaling\n"
        "  accelexp-report --sweep latest --format markdown\n"
        "  accelexp-report --experiment scaling --wide\n"
        '  accelexp-report --sweep latest --baseline "world_size=1,precision=fp32,'
        'parallelism=ddp"\n'
        "  accelexp-report --experiment speedups --sweep latest\n"
        "  accelexp-report --sweep latest --diagnose\n"
        "  accelexp-report --experiment memory_vs_speed --memory",
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
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="table",
        help="stdout format (default: %(default)s, the main columns in 100 characters; csv, "
        "markdown and json carry every column)",
    )
    parser.add_argument(
        "--wide", action="store_true", help="the table with every column, however wide"
    )
    parser.add_argument(
        "--output-dir", type=Path, help="default: outputs/reports/<sweep or experiment name>"
    )
    parser.add_argument("--no-plots", action="store_true", help="write the tables only")
    instead = parser.add_mutually_exclusive_group()
    instead.add_argument(
        "--diagnose",
        action="store_true",
        help="instead of the comparison: where each run's step time went (input, forward+"
        "backward, optimizer, communication, other) and what bounds it, with the override to "
        "try next; writes diagnosis.csv/.md and time_breakdown.png",
    )
    instead.add_argument(
        "--memory",
        action="store_true",
        help="instead of the comparison: each run's samples/s against its memory per device "
        "(peak, training state) and the largest batch that fit (max_batch.search=true, on a "
        "GPU); writes memory.csv/.md and memory_vs_speed.png",
    )
    return parser


def _print_tables(
    rows: Sequence[Row],
    rungs: Sequence[LadderRow],
    title: str,
    fmt: str,
    wide: bool = False,
    front: Front | None = None,
    summary: str = "",
) -> None:
    """The main table (`summary` under it), then the ladder's and the Pareto front's when there
    are, in the format asked for; rich tables at a glance (`RUNS_BRIEF`, `LADDER_BRIEF`: at most
    `BRIEF_WIDTH` wide) unless `wide`. CSV and JSON, for machines, say `summary` on stderr."""
    ladder_title = f"Speed-up ladder: {ladder_subject(rungs)}"
    if summary and fmt in ("csv", "json"):
        print(summary, file=sys.stderr)
    if fmt == "table":
        from rich.console import Console

        tables = [render_table(rows, title, RUNS if wide else RUNS_BRIEF, summary or None)]
        if rungs:
            tables.append(render_table(rungs, ladder_title, LADDER if wide else LADDER_BRIEF))
        if front:
            caption = "\n".join(notes(front)) or None
            tables.append(render_table(front.rows, front.title, front.layout, caption))
        console = Console()
        if not console.is_terminal:  # a pipe or a file: no terminal's width to fit
            width = BRIEF_WIDTH
            if wide:  # the whole table, however wide
                width = max(Console(width=10_000).measure(t).maximum for t in tables)
            console = Console(width=width)
        for table in tables:
            console.print(table, width=console.width if wide else min(console.width, BRIEF_WIDTH))
    elif fmt == "json" and (rungs or front):
        document = {"runs": to_records(rows)}
        if rungs:
            document["ladder"] = to_records(rungs)
        if front:
            document["pareto"] = to_records(front.rows)
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    elif fmt == "json":
        sys.stdout.write(to_json(rows))
    elif fmt == "csv":
        sys.stdout.write(to_csv(rows) + (f"\n{to_csv(rungs, LADDER)}" if rungs else ""))
        sys.stdout.write(f"\n{to_csv(front.rows, front.layout)}" if front else "")
    else:
        ladder_section = f"\n### {ladder_title}\n\n{to_markdown(rungs, LADDER)}"
        sys.stdout.write(to_markdown(rows, summary=summary) + (ladder_section if rungs else ""))
        sys.stdout.write(f"\n{front_markdown(front)}" if front else "")


def _print_diagnosis(rows: Sequence[DiagnosisRow], title: str, fmt: str) -> None:
    """The diagnosis table in the format asked for; a rich table folds to DIAGNOSIS_WIDTH."""
    if fmt == "table":
        from rich.console import Console

        console = Console()
        if not console.is_terminal:
            console = Console(width=DIAGNOSIS_WIDTH)
        table = render_table(rows, title, DIAGNOSIS, caption=footnote(rows))
        console.print(table, width=min(console.width, DIAGNOSIS_WIDTH))
    elif fmt == "json":
        sys.stdout.write(to_json(rows))
    elif fmt == "csv":
        sys.stdout.write(to_csv(rows, DIAGNOSIS))
    else:
        sys.stdout.write(diagnosis_markdown(rows))


def _print_memory(
    rows: Sequence[MemoryRow], title: str, fmt: str, lever_rows: Sequence[LeverRow] = ()
) -> None:
    """The memory table, then the levers' when a run pulled one, in the format asked for; rich
    tables fold to BRIEF_WIDTH."""
    if fmt == "table":
        from rich.console import Console

        console = Console()
        if not console.is_terminal:
            console = Console(width=BRIEF_WIDTH)
        tables = [render_table(rows, title, MEMORY)]
        if lever_rows:
            tables.append(render_table(lever_rows, LEVERS_HEADING.lstrip("# "), LEVERS_TABLE))
        for table in tables:
            console.print(table, width=min(console.width, BRIEF_WIDTH))
    elif fmt == "json" and lever_rows:
        document = {"runs": to_records(rows), "levers": to_records(lever_rows)}
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    elif fmt == "json":
        sys.stdout.write(to_json(rows))
    elif fmt == "csv":
        sys.stdout.write(to_csv(rows, MEMORY))
        sys.stdout.write(f"\n{to_csv(lever_rows, LEVERS_TABLE)}" if lever_rows else "")
    else:
        sys.stdout.write(memory_markdown(rows, lever_rows))


def _tell_written(written: Sequence[Path], out_dir: Path, plots: Sequence[str]) -> None:
    """On stderr: the files written, and the plots skipped for want of data."""
    print(f"Wrote {', '.join(p.name for p in written)} to {out_dir}", file=sys.stderr)
    skipped = [name for name in plots if out_dir / name not in written]
    if skipped:
        print(f"Skipped {', '.join(skipped)}: no data to plot", file=sys.stderr)


def _comparison(
    args: argparse.Namespace, title: str, records: list[RunRecord], out_dir: Path
) -> None:
    """The comparison (and the ladder): computed and written, then printed."""
    rows = compare(records, args.baseline)
    rungs = ladder(records)
    front = pareto(records)
    summary = everything_set_aside(records)
    written = write_tables(rows, out_dir, rungs, summary)
    if not args.no_plots:
        written += write_plots(rows, records, out_dir, rungs)
    written += write_front(front, out_dir, plots=not args.no_plots)
    subtitle = f"Baseline: {args.baseline}"
    written.append(write_html(title, rows, out_dir, rungs, written, subtitle, front, summary))

    heading = f"{title} — baseline {args.baseline}"
    _print_tables(rows, rungs, heading, args.format, args.wide, front, summary)
    plots = [*PLOT_NAMES, LADDER_PLOT] if rungs else list(PLOT_NAMES)
    plots += [PARETO_PLOT] if front else []
    _tell_written(written, out_dir, [] if args.no_plots else plots)
    gone = {record.run_id: record.tags.get(ENDED) for record in records}
    for row in rows:
        if row.status == FAILED:
            why = gone.get(row.run_id) or "its error is in the run's artifact error.txt"
            print(f"Run {row.run_name} ({row.run_id}) FAILED: {why}", file=sys.stderr)


def _diagnosis(
    args: argparse.Namespace, title: str, records: list[RunRecord], out_dir: Path
) -> None:
    """Where each run's time went: computed and written, then printed."""
    rows = diagnose(records)
    written = write_diagnosis_tables(rows, out_dir)
    if not args.no_plots:
        written += write_time_plot(rows, title, out_dir)

    _print_diagnosis(rows, f"Where the time went: {title}", args.format)
    _tell_written(written, out_dir, [] if args.no_plots else [TIME_PLOT])


def _memory(args: argparse.Namespace, title: str, records: list[RunRecord], out_dir: Path) -> None:
    """Speed against memory per device: computed and written, then printed."""
    rows, lever_rows = memory_rows(records), levers(records)
    written = write_memory_report(rows, out_dir, plots=not args.no_plots, lever_rows=lever_rows)

    _print_memory(rows, f"Memory vs speed: {title}", args.format, lever_rows)
    _tell_written(written, out_dir, [] if args.no_plots else [MEMORY_PLOT])


def main(argv: list[str] | None = None) -> int:
    """The `accelexp-report` command. Exit 0, or 2 with one line on stderr."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.experiment is None and args.sweep is None:
        parser.error("give --experiment NAME and/or --sweep RUN_ID|latest")
    try:
        parse_baseline(args.baseline)
        name, title, records = _select(args)
        out_dir = args.output_dir or Path("outputs") / "reports" / _safe_name(name)
        report = _diagnosis if args.diagnose else _memory if args.memory else _comparison
        report(args, title, records, out_dir)
    except (AccelexpError, OSError) as error:
        print(f"accelexp-report: error: {credentials.redact(str(error))}", file=sys.stderr)
        return 2
    return 0
