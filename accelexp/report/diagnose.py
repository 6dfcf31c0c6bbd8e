"""Where each run's step time went, and what bounds it: one `DiagnosisRow` per run.

Every run logs, per epoch, the seconds of its timed training steps spent in each `SEGMENTS` part —
`time/input_s`, `time/forward_s`, `time/backward_s`, `time/optimizer_s`, `time/comm_s` (the
communication the host waited for) and `time/other_s` — which sum to the epoch's timed wall time;
at its end, the tags `diagnosis` (the bounding resource), `diagnosis_next` (the first override to
try) and `diagnosis_detail` (the evidence). A row gives each part's share of the last epoch's
timed time in percent, with the GPU's busy share, the communication hidden behind compute and the
FLOP utilisation when the run logged them.

A run without the time metrics (it predates the accounting, or stopped before its first epoch)
keeps its row with blank figures and `NO_ACCOUNTING` as its note; a run still RUNNING keeps its
row with blank figures and says so (its epochs so far are no result). Rows come in the main table's
order (`compare`). Pure: records in, rows out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from accelexp.record import (
    DIAGNOSIS,
    DIAGNOSIS_DETAIL,
    DIAGNOSIS_NEXT,
    FLOP_UTILISATION,
    RUNNING,
    TIME_COMM_OVERLAP,
    TIME_GPU_BUSY,
    TIME_METRICS,
    TIME_PARTS,
    time_s,
)
from accelexp.report.compare import compare, group, status_note
from accelexp.tracking.query import RunRecord

SEGMENTS = TIME_PARTS  # time_s(segment): time/input_s...
OPTIONAL_SEGMENTS = frozenset({"comm"})  # 0 when not logged (a single process never waits on one)
NO_ACCOUNTING = (
    f"no {TIME_METRICS} metrics: predates the time accounting, or stopped before an epoch ended"
)


@dataclass
class DiagnosisRow:
    """One run's verdict and time shares (percent of the last epoch's timed step time)."""

    run_name: str
    run_id: str
    status: str
    bound: str | None = None  # input, overhead, compute, communication or memory
    next_override: str | None = None
    detail: str | None = None
    step_time_s: float | None = None  # the last epoch's timed seconds (one rank, rank-averaged)
    input_pct: float | None = None
    forward_pct: float | None = None
    backward_pct: float | None = None
    compute_pct: float | None = None  # forward + backward
    optimizer_pct: float | None = None
    comm_pct: float | None = None
    other_pct: float | None = None
    gpu_busy_pct: float | None = None
    comm_overlap_pct: float | None = None
    flop_utilisation_pct: float | None = None
    note: str | None = None

    @property
    def accounted(self) -> bool:
        return self.step_time_s is not None


DIAGNOSIS_COLUMNS = tuple(f.name for f in fields(DiagnosisRow))


def segment_seconds(record: RunRecord) -> dict[str, float] | None:
    """Seconds per segment in the run's last epoch (the metrics' values at their last step), or
    None when the run logged no time accounting."""
    last = record.metrics  # MLflow keeps each metric's value at its highest step: the last epoch
    if any(time_s(s) not in last for s in SEGMENTS if s not in OPTIONAL_SEGMENTS):
        return None
    seconds = {s: last.get(time_s(s), 0.0) for s in SEGMENTS}
    return seconds if sum(seconds.values()) > 0 else None


def _percent(record: RunRecord, key: str) -> float | None:
    """A fraction-valued metric (0..1) in percent, None when not logged."""
    value = record.metrics.get(key)
    return None if value is None else 100 * value


def diagnosis_row(record: RunRecord) -> DiagnosisRow:
    if record.status == RUNNING:
        return DiagnosisRow(record.name, record.run_id, RUNNING, note=status_note(record))
    row = DiagnosisRow(
        run_name=record.name,
        run_id=record.run_id,
        status=record.status,
        bound=record.tags.get(DIAGNOSIS) or None,
        next_override=record.tags.get(DIAGNOSIS_NEXT) or None,
        detail=record.tags.get(DIAGNOSIS_DETAIL) or None,
    )
    seconds = segment_seconds(record)
    if seconds is None:
        row.note = NO_ACCOUNTING
        return row
    total = sum(seconds.values())
    for segment, value in seconds.items():
        setattr(row, f"{segment}_pct", 100 * value / total)
    row.step_time_s = total
    row.compute_pct = 100 * (seconds["forward"] + seconds["backward"]) / total
    row.gpu_busy_pct = _percent(record, TIME_GPU_BUSY)
    row.comm_overlap_pct = _percent(record, TIME_COMM_OVERLAP)
    row.flop_utilisation_pct = _percent(record, FLOP_UTILISATION)
    return row


def diagnose(records: Sequence[RunRecord]) -> list[DiagnosisRow]:
    """One row per run — each repeat its own — in the order of the main table (parallelism,
    workers, precision, ...), a configuration's repeats together."""
    order = {row.run_id: i for i, row in enumerate(compare(records, strict=False))}
    first = {r.run_id: g.first.run_id for g in group(records) for r in g.records}
    return sorted(map(diagnosis_row, records), key=lambda row: order[first[row.run_id]])


def footnote(rows: Sequence[DiagnosisRow]) -> str | None:
    """The lines under a readable table naming the runs still running and those without time
    accounting, if any."""
    running = [row.run_name for row in rows if row.status == RUNNING]
    missing = [row.run_name for row in rows if not row.accounted and row.status != RUNNING]
    lines = []
    if running:
        ends = "it ends" if len(running) == 1 else "they end"
        lines.append(f"— still running, no figures until {ends}: {', '.join(running)}.")
    if missing:
        lines.append(
            f"— no {TIME_METRICS} metrics for {', '.join(missing)}: "
            f"{'it predates' if len(missing) == 1 else 'they predate'} the time accounting "
            f"(or stopped before an epoch ended)."
        )
    return "\n".join(lines) or None
