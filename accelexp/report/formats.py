"""The report's tables as text: CSV, JSON, GitHub markdown and a rich Table, and their files.

One `Layout` per kind of row says which fields become columns and how a cell reads: `RUNS` for
the main table (`compare.Row`) with every column, `RUNS_BRIEF` for the same rows at a glance in
at most `BRIEF_WIDTH` columns (the default rich table, a contended row marked in a `noise`
column of its own; `accelexp-report --wide` prints `RUNS`), `LADDER` and `LADDER_BRIEF` for the
speed-up ladder (`ladder.LadderRow`), `DIAGNOSIS` for where each run's time went
(`diagnose.DiagnosisRow`). CSV and JSON carry every field unrounded with
blanks/null for missing figures, the rows' notes included; markdown and the rich table are
rounded for reading, failed runs stand out, and each row's note (why a figure is blank: too short
to measure, a comparison refused as not like for like) is listed under the table.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from accelexp import stats
from accelexp.record import FAILED, FINISHED
from accelexp.report.compare import Row
from accelexp.report.diagnose import DiagnosisRow, footnote
from accelexp.report.ladder import LadderRow
from accelexp.stats import Estimate

BRIEF_WIDTH = 100  # the default rich table's width at most
RATIOS = frozenset({"speedup", "amp_gain"})  # "no measurable difference" when 1.0 is inside
# a figure derived from a ratio reads "no measurable difference" where that ratio does: an
# efficiency is the speedup per added worker, no more measurable than the speedup itself
FOLLOWS = {"scaling_efficiency": "speedup"}
LADDER_NAMES = ("ladder.csv", "ladder.md")
DIAGNOSIS_NAMES = ("diagnosis.csv", "diagnosis.md")


@dataclass(frozen=True)
class Layout:
    """How rows of one dataclass read as a table."""

    row_type: type
    headers: Mapping[str, str]  # attribute -> header, in the order the readable tables show them
    display: Mapping[str, str] = field(default_factory=dict)  # attribute -> format of a number
    plain_numbers: frozenset[str] = frozenset()  # right-aligned like `display`'s, shown as they are
    optional: frozenset[str] = frozenset()  # left out of readable tables when blank in every row
    missing: str = ""  # what a readable table shows for a missing figure
    # the rich table only:
    fold: frozenset[str] = frozenset()  # cells broken anywhere when too narrow, never cut
    widths: Mapping[str, int] = field(default_factory=dict)  # at most; a longer header wraps
    relative: frozenset[str] = frozenset()  # intervals as `5,105 ±3%` (short), not `(lo–hi)`
    compact: bool = False  # no frame or column rules, columns two spaces apart
    padding: int = 1  # spaces each side of a cell (compact: between two cells, plus one)
    # the rows' notes, listed under the readable tables, each after its row's `label` attribute
    note: str | None = None
    label: str = "run_name"

    @property
    def columns(self) -> tuple[str, ...]:
        """Every field, in declaration order: the CSV header."""
        return tuple(f.name for f in fields(self.row_type))

    @property
    def numeric(self) -> frozenset[str]:
        """The right-aligned columns: the numbers with a format, and the plain ones."""
        return frozenset(self.display) | self.plain_numbers

    def brief(self, keys: Sequence[str], **changes: Any) -> Layout:
        """These columns at a glance, for the default rich table in at most BRIEF_WIDTH columns:
        `label` (the row's name with its status) headed as the layout's `label` column is,
        samples/s a whole number with its interval as `±%`, columns one space apart; `changes`
        as `dataclasses.replace` takes them (which cells fold, their widths)."""
        return replace(
            self,
            headers={key: self.headers[self.label if key == "label" else key] for key in keys},
            display=self.display | {"samples_per_s": "{:.0f}"},
            relative=frozenset({"samples_per_s"}),
            compact=True,
            padding=0,
            **changes,
        )

    def shown(self, rows: Sequence[Any]) -> dict[str, str]:
        """The headers of the readable tables for these rows."""
        return {
            key: header
            for key, header in self.headers.items()
            if key not in self.optional or any(getattr(row, key) not in (None, "") for row in rows)
        }

    def notes(self, rows: Sequence[Any]) -> list[str]:
        """`<label>: <note>` of each row with a note."""
        if self.note is None:
            return []
        return [
            f"{getattr(row, self.label)}: {note}"
            for row in rows
            if (note := getattr(row, self.note))
        ]

    def cell(self, key: str, value: Any) -> str:
        if value is None:
            return self.missing
        return self.display.get(key, "{}").format(value)

    def text(self, row: Any, key: str) -> str:
        """A row's cell: a figure with its 95 % interval, `1.82× (1.75–1.90)`, where the row
        has one (`<key>_low`, `<key>_high`); a ratio whose interval includes 1.0, and the
        efficiency beside such a speedup (`no_difference`), read "no measurable difference"
        with their own interval, never as a gain or a loss."""
        value = getattr(row, key)
        low, high = getattr(row, f"{key}_low", None), getattr(row, f"{key}_high", None)
        if value is None or low is None or high is None:
            return self.cell(key, value)
        shape = self.display.get(key, "{}")
        number, suffix = (shape[:-1], shape[-1]) if shape.endswith("×") else (shape, "")
        estimate = Estimate(value, low, high)
        if key in self.relative and (half := estimate.relative_halfwidth()) is not None:
            return f"{shape.format(value)} ±{100 * half:.0f}%"
        if self.no_difference(row, key):
            interval = stats.format_estimate(estimate, number).partition(" ")[2]
            return f"{stats.NO_DIFFERENCE} {interval}"
        return stats.format_estimate(estimate, number, suffix)

    @staticmethod
    def no_difference(row: Any, key: str) -> bool:
        """Whether a row's figure reads "no measurable difference": a ratio (RATIOS) whose
        interval holds 1.0, or a figure derived from one (FOLLOWS) where that ratio does."""
        ratio = key if key in RATIOS else FOLLOWS.get(key)
        if ratio is None or getattr(row, ratio, None) is None:
            return False
        low, high = getattr(row, f"{ratio}_low", None), getattr(row, f"{ratio}_high", None)
        if low is None or high is None:
            return False
        return stats.verdict(Estimate(getattr(row, ratio), low, high)) == stats.NO_DIFFERENCE


RATIO = "{:.2f}×"  # a speedup, a gain
RUNS_DISPLAY = {
    "samples_per_s": "{:.1f}",
    "speedup": RATIO,
    "scaling_efficiency": "{:.2f}",
    "amp_gain": RATIO,
    "best_val_acc": "{:.4f}",
    "test_acc": "{:.4f}",
    "test_acc_sd": "±{:.4f}",
    "time_to_target_s": "{:.1f}",
    "compile_s": "{:.1f}",
    "peak_mem_mb": "{:.1f}",
}
RUNS = Layout(
    row_type=Row,
    headers={
        "run_name": "run",
        "status": "status",
        "parallelism": "parallelism",
        "world_size": "workers",
        "precision": "precision",
        "speed": "speed",
        "model": "model",
        "data": "data",
        "device": "device",
        "samples_per_s": "samples/s",
        "speedup": "speedup",
        "scaling_efficiency": "efficiency",
        "amp_gain": "AMP gain",
        "best_val_acc": "best val acc",
        "test_acc": "test acc",
        "test_acc_sd": "sd over repeats",
        "repeats": "repeats",
        "noise": "noise",
        "paired": "paired",
        "time_to_target_s": "time to target (s)",
        "compile_s": "compile (s)",
        "peak_mem_mb": "peak mem (MB)",
        "baseline_run": "baseline",
    },
    display=RUNS_DISPLAY,
    plain_numbers=frozenset({"world_size", "repeats"}),
    optional=frozenset({"compile_s", "device", "test_acc_sd", "noise", "paired"}),
    note="note",
)
RUNS_BRIEF = RUNS.brief(  # what a user needs at a glance: what the run was, how fast, how good
    # the run's label says its precision; `noise` (shown when a row is contended) marks a
    # samples/s timed on a shared machine, in a column of its own that no width cuts
    [
        "label",
        "world_size",
        "samples_per_s",
        "noise",
        "speedup",
        "scaling_efficiency",
        "amp_gain",
        "best_val_acc",
        "peak_mem_mb",
    ],
    # a long name, and a ratio with its interval (`1.82×` over `(1.75–1.90)`), break onto more
    # lines, never cut
    fold=frozenset({"label", "speedup", "scaling_efficiency", "amp_gain"}),
    # "simple_cnn-horovod-np2-amp", "12345 ±10%" and "(1.75–1.90)" fit; two-word headers wrap
    widths={
        "label": 26,
        "samples_per_s": 10,
        "noise": len("contended"),
        "scaling_efficiency": 11,
        "speedup": 11,
        "amp_gain": 11,
        "best_val_acc": 8,
        "peak_mem_mb": 8,
    },
)
LADDER_FIGURES = ("samples_per_s", "compile_s", "best_val_acc", "test_acc", "peak_mem_mb")
# a rung's figures read as a run's do
LADDER_DISPLAY = {key: RUNS_DISPLAY[key] for key in LADDER_FIGURES} | {"gain_vs_fp32": RATIO}
LADDER = Layout(
    row_type=LadderRow,
    headers={
        "rung_index": "#",
        "rung": "rung",
        "precision": "precision",
        "speed": "speed",
        "samples_per_s": "samples/s",
        "vs_previous": "vs previous rung",
        "gain_vs_fp32": "vs fp32",
        "compile_s": "compile (s)",
        "best_val_acc": "best val acc",
        "test_acc": "test acc",
        "peak_mem_mb": "peak mem (MB)",
        "status": "status",
    },
    display=LADDER_DISPLAY,
    plain_numbers=frozenset({"rung_index", "vs_previous"}),
    note="note",
    label="rung",
)
LADDER_BRIEF = LADDER.brief(  # the ladder at a glance
    [
        "rung_index",
        "label",
        "precision",
        "speed",
        "samples_per_s",
        "vs_previous",
        "gain_vs_fp32",
        "compile_s",
        "best_val_acc",
        "peak_mem_mb",
    ],
    optional=frozenset({"compile_s"}),
    # broken onto more lines, never cut: a gain over its interval, `1.27×` over `(1.10–1.45)`
    fold=frozenset({"label", "speed", "vs_previous", "gain_vs_fp32"}),
    # "channels_last", "12345 ±10%" and "(1.10–1.45)" fit on a line; headers wrap
    widths={"label": 13, "speed": 11, "samples_per_s": 10, "vs_previous": 11, "gain_vs_fp32": 11}
    | dict.fromkeys(["compile_s", "best_val_acc", "peak_mem_mb"], 8),
)
DIAGNOSIS_SHARES = {
    "input_pct": "input %",
    "compute_pct": "fwd+bwd %",
    "optimizer_pct": "optim %",
    "comm_pct": "comm %",
    "other_pct": "other %",
    "gpu_busy_pct": "GPU busy %",
}
DIAGNOSIS = Layout(
    row_type=DiagnosisRow,
    headers={"run_name": "run", "bound": "bound", **DIAGNOSIS_SHARES, "next_override": "next"},
    display=dict.fromkeys(DIAGNOSIS_SHARES, "{:.1f}"),
    optional=frozenset({"gpu_busy_pct"}),
    missing="—",
    fold=frozenset({"run_name", "bound", "next_override"}),
    # "100.0" fits; "input %" reads "input" over "%": 100 columns hold the table
    widths={key: max(5, len(header.split()[0])) for key, header in DIAGNOSIS_SHARES.items()}
    | {"gpu_busy_pct": len("busy %")},
    compact=True,
)


# --- text ---------------------------------------------------------------------------------------
def to_csv(rows: Sequence[Any], layout: Layout = RUNS) -> str:
    """Every column, numbers unrounded, blanks for missing figures."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(layout.columns)
    for row in rows:
        writer.writerow("" if v is None else v for v in asdict(row).values())
    return out.getvalue()


def to_json(rows: Sequence[Any]) -> str:
    """A list of row objects, numbers unrounded, null for missing figures."""
    return json.dumps(to_records(rows), indent=2) + "\n"


def to_records(rows: Sequence[Any]) -> list[dict[str, Any]]:
    """The rows as plain dicts (what `to_json` writes), to nest in a larger JSON document."""
    return [asdict(row) for row in rows]


NOTES_HEADING = "Figures left blank, and why:"


def to_markdown(rows: Sequence[Any], layout: Layout = RUNS, summary: str = "") -> str:
    """A GitHub table, rounded for reading; failed runs in bold; under it `summary` (a line
    about every row, e.g. `compare.everything_set_aside`) and the rows' notes."""
    headers = layout.shown(rows)
    lines = [
        "| " + " | ".join(headers.values()) + " |",
        "|" + "|".join("---:" if k in layout.numeric else "---" for k in headers) + "|",
    ]
    for row in rows:
        cells = []
        for key in headers:
            text = layout.text(row, key).replace("|", "\\|")
            if key == "status" and row.status != FINISHED:
                text = f"**{text}**"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    if summary:
        lines += ["", summary]
    notes = layout.notes(rows)
    if notes:
        lines += ["", NOTES_HEADING, "", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def render_table(
    rows: Sequence[Any], title: str | None = None, layout: Layout = RUNS, caption: str | None = None
) -> Any:
    """A rich Table of the rows (print it with a rich Console); under it `caption` and the
    rows' notes."""
    from rich import box
    from rich.table import Table

    headers = layout.shown(rows)
    notes = layout.notes(rows)
    if notes:
        caption = "\n".join(filter(None, [caption, NOTES_HEADING, *notes]))
    compact = {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False}
    table = Table(
        title=title,
        caption=caption,
        caption_justify="left",
        header_style="bold",
        collapse_padding=layout.compact,
        padding=(0, layout.padding),
        **(compact if layout.compact else {}),
    )
    for key, header in headers.items():
        table.add_column(
            header,
            justify="right" if key in layout.numeric else "left",
            overflow="fold" if key in layout.fold else "ellipsis",
            max_width=layout.widths.get(key),
        )
    for row in rows:
        style = "red" if row.status == FAILED else ("yellow" if row.status != FINISHED else "")
        cells = (layout.text(row, key) for key in headers)
        table.add_row(*cells, style=style or None)
    return table


# --- files --------------------------------------------------------------------------------------
def write_tables(
    rows: Sequence[Row], out_dir: Path, ladder_rows: Sequence[LadderRow] = (), summary: str = ""
) -> list[Path]:
    """summary.csv and summary.md (`summary` under its table); ladder.csv and ladder.md when
    there are ladder rows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = {"summary.csv": to_csv(rows), "summary.md": to_markdown(rows, summary=summary)}
    if ladder_rows:
        tables |= {
            "ladder.csv": to_csv(ladder_rows, LADDER),
            "ladder.md": to_markdown(ladder_rows, LADDER),
        }
    for name in LADDER_NAMES:  # no ladder now: no older report's ladder left behind
        if name not in tables:
            (out_dir / name).unlink(missing_ok=True)
    paths = []
    for name, text in tables.items():
        (out_dir / name).write_text(text)
        paths.append(out_dir / name)
    return paths


def diagnosis_markdown(rows: Sequence[DiagnosisRow]) -> str:
    """The diagnosis as a GitHub table, the runs without time accounting named under it."""
    note = footnote(rows)
    return to_markdown(rows, DIAGNOSIS) + (f"\n{note}\n" if note else "")


def write_diagnosis_tables(rows: Sequence[DiagnosisRow], out_dir: Path) -> list[Path]:
    """diagnosis.csv and diagnosis.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, markdown_path = (out_dir / name for name in DIAGNOSIS_NAMES)
    csv_path.write_text(to_csv(rows, DIAGNOSIS))
    markdown_path.write_text(diagnosis_markdown(rows))
    return [csv_path, markdown_path]
