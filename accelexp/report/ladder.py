"""The speed-up ladder: one row per rung of `+experiment=speedups`, each rung's gain over the last.

The study's rungs are cumulative — 0 fp32 → 1 tf32 → 2 channels_last → 3 amp → 4 bf16 → 5 compile —
and its runs carry the tags `rung` and `rung_index`. Per rung the newest FINISHED run counts (the
newest run of any status when none finished). A rung that failed, did not finish or has no run at
all is a row with blank figures and its status; the next rung's gain over the previous one is then
taken over the last rung that was measured (`previous_rung` names it).

Throughput is `compare.measure` — the same steady-state figure as the main table, blank with a
note when a rung's run is too short to measure — so the ladder and the main table agree. Gains are
like for like: two rungs are compared only when their runs differ in nothing but the precision
and the speed switches (`LADDER_VARIES`; everything else as `compare` reads it: model, data,
batch, steps, ...); otherwise the gain stays blank and the rung's note says what differs. Pure:
records in, rows out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, fields

from accelexp.report.compare import (
    comparable_settings,
    differ_text,
    differences,
    measure,
    peak_memory,
    setting,
)
from accelexp.tracking.query import RunRecord

RUNG_NAMES = ("fp32", "tf32", "channels_last", "amp", "bf16", "compile")  # conf/rung, in order
MISSING = "MISSING"  # the status of a rung with no run
LADDER_VARIES = re.compile(r"(precision|speed)(\..+)?")  # what the rungs change


@dataclass
class LadderRow:
    """One rung; None where the rung was not measured (or, for rung 0, has nothing to gain over)."""

    rung_index: int
    rung: str
    status: str
    run_name: str | None = None
    run_id: str | None = None
    precision: str | None = None
    speed: str | None = None
    model: str | None = None
    data: str | None = None
    samples_per_s: float | None = None
    gain_vs_previous: float | None = None
    previous_rung: str | None = None
    gain_vs_fp32: float | None = None
    compile_s: float | None = None
    best_val_acc: float | None = None
    test_acc: float | None = None
    peak_mem_mb: float | None = None
    note: str = ""  # why a figure is blank: too short to measure, a rung not like for like

    @property
    def label(self) -> str:
        """The rung's name, with its status when its run did not finish."""
        return self.rung if self.status == "FINISHED" else f"{self.rung} ({self.status})"

    @property
    def vs_previous(self) -> str | None:
        """The gain over the previous rung, naming that rung when it is not the one just before."""
        if self.gain_vs_previous is None:
            return None
        text = f"{self.gain_vs_previous:.2f}×"
        just_before = (
            RUNG_NAMES[self.rung_index - 1] if 0 < self.rung_index <= len(RUNG_NAMES) else None
        )
        return text if self.previous_rung == just_before else f"{text} (vs {self.previous_rung})"


LADDER_COLUMNS = tuple(f.name for f in fields(LadderRow))


def rung_index(record: RunRecord) -> int | None:
    """The run's `rung_index` tag, else its `rung`'s place in RUNG_NAMES; None off the ladder."""
    try:
        return int(record.setting("rung_index") or "")
    except ValueError:
        rung = record.setting("rung")
        return RUNG_NAMES.index(rung) if rung in RUNG_NAMES else None


def _rung_name(index: int, runs_by_index: dict[int, list[RunRecord]]) -> str:
    for record in runs_by_index.get(index, []):
        if name := record.setting("rung"):
            return name
    return RUNG_NAMES[index] if 0 <= index < len(RUNG_NAMES) else f"rung {index}"


def _chosen(runs: list[RunRecord]) -> RunRecord:
    """The newest FINISHED run of a rung, else its newest run."""
    return max(runs, key=lambda r: (r.status == "FINISHED", r.start_time))


def ladder(records: Sequence[RunRecord]) -> list[LadderRow]:
    """The rungs from 0 to the highest one run, in order; [] when no run is on the ladder."""
    runs_by_index: dict[int, list[RunRecord]] = {}
    for record in records:
        index = rung_index(record)
        if index is not None and index >= 0:
            runs_by_index.setdefault(index, []).append(record)
    if not runs_by_index:
        return []

    rows: list[LadderRow] = []
    previous: tuple[LadderRow, dict[str, str]] | None = None  # the last rung with a throughput
    fp32: tuple[LadderRow, dict[str, str]] | None = None  # rung 0, when measured
    for index in range(max(runs_by_index) + 1):
        name = _rung_name(index, runs_by_index)
        runs = runs_by_index.get(index)
        if not runs:
            rows.append(LadderRow(rung_index=index, rung=name, status=MISSING))
            continue
        record = _chosen(runs)
        row = LadderRow(
            rung_index=index,
            rung=name,
            status=record.status,
            run_name=record.name,
            run_id=record.run_id,
            precision=setting(record, "precision"),
            speed=setting(record, "speed"),
            model=setting(record, "model"),
            data=setting(record, "data"),
        )
        rows.append(row)
        if record.status != "FINISHED":
            continue
        samples, row.note = measure(record)
        row.compile_s = record.metrics.get("compile_s")
        row.best_val_acc = record.metrics.get("best_val_acc")
        row.test_acc = record.metrics.get("test_acc")
        row.peak_mem_mb = peak_memory(record)
        if samples is None:
            continue
        row.samples_per_s = samples
        mine = comparable_settings(record)
        notes = []
        if previous is not None:
            gain, note = _gain(samples, mine, *previous)
            row.gain_vs_previous, row.previous_rung = gain, previous[0].rung
            notes.append(note)
        if index == 0:
            fp32 = (row, mine)
        if fp32 is not None:
            row.gain_vs_fp32, note = _gain(samples, mine, *fp32)
            notes.append(note if note not in notes else "")
        row.note = "; ".join(filter(None, notes))
        previous = (row, mine)
    return rows


def _gain(
    samples: float, mine: dict[str, str], other: LadderRow, theirs: dict[str, str]
) -> tuple[float | None, str]:
    """(samples / other's throughput, "") when the two runs are like for like, else (None, why)."""
    diffs = differences(mine, theirs, LADDER_VARIES)
    if diffs:
        return None, f"not like for like with rung {other.rung}: differs in {differ_text(diffs)}"
    return samples / other.samples_per_s, ""


def ladder_subject(rows: Sequence[LadderRow]) -> str:
    """What was trained, e.g. `simple_cnn on synthetic` (several models or data sets joined)."""

    def distinct(values: list[str | None]) -> str:
        return ", ".join(dict.fromkeys(v for v in values if v)) or "?"

    models = distinct([row.model for row in rows])
    data = distinct([row.data for row in rows])
    return f"{models} on {data}"
