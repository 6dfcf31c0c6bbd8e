"""The speed-up ladder: one row per rung of `+experiment=speedups`, each rung's gain over the last.

The study's rungs are cumulative — 0 fp32 → 1 tf32 → 2 channels_last → 3 amp → 4 bf16 → 5 compile
→ 6 bf16_true (bf16 weights and optimizer state, compiled) — and its runs carry the tags `rung`
and `rung_index`. Rung 7, activation_checkpointing (rung 6 with every block checkpointed), is off
the default ladder (it needs a model with blocks) and is a memory lever, not a speed-up: its gain
over rung 6 is below 1, what it buys is in its `peak_mem_mb`. Per rung the newest FINISHED run
counts (the newest run of any status when none finished). A rung that failed, did not finish or
has no run at all is a row with blank figures and its status; the next rung's gain over the
previous one is then taken over the last rung that was measured (`previous_rung` names it).

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

from accelexp import stats
from accelexp.record import (
    BEST_VAL_ACC,
    COMPILE_S,
    DATA,
    FINISHED,
    MODEL,
    PRECISION,
    RUNG,
    RUNG_INDEX,
    SPEED,
    TEST_ACC,
)
from accelexp.report.compare import (
    Group,
    comparable_settings,
    contention,
    differ_text,
    differences,
    group,
    peak_memory,
    ratio,
    setting,
)
from accelexp.stats import Estimate
from accelexp.tracking.query import RunRecord

# conf/rung, in order
RUNG_NAMES = (
    "fp32", "tf32", "channels_last", "amp", "bf16", "compile", "bf16_true",
    "activation_checkpointing",
)  # fmt: skip
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
    repeats: int = 1  # the runs behind the figures (the rung's repeats, accelexp.sweeper)
    samples_per_s: float | None = None
    samples_per_s_low: float | None = None  # 95 % interval (accelexp.stats)
    samples_per_s_high: float | None = None
    gain_vs_previous: float | None = None
    gain_vs_previous_low: float | None = None
    gain_vs_previous_high: float | None = None
    previous_rung: str | None = None
    gain_vs_fp32: float | None = None
    gain_vs_fp32_low: float | None = None
    gain_vs_fp32_high: float | None = None
    compile_s: float | None = None
    best_val_acc: float | None = None
    test_acc: float | None = None
    peak_mem_mb: float | None = None
    note: str = ""  # why a figure is blank: too short to measure, a rung not like for like

    @property
    def label(self) -> str:
        """The rung's name, with its status when its run did not finish."""
        return self.rung if self.status == FINISHED else f"{self.rung} ({self.status})"

    @property
    def vs_previous(self) -> str | None:
        """The gain over the previous rung, naming that rung when it is not the one just before."""
        if self.gain_vs_previous is None:
            return None
        gain = Estimate(
            self.gain_vs_previous, self.gain_vs_previous_low, self.gain_vs_previous_high
        )
        text = stats.format_estimate(gain, "{:.2f}", "×")
        if stats.verdict(gain) == stats.NO_DIFFERENCE:
            text = f"{stats.NO_DIFFERENCE} {text.partition(' ')[2]}"
        just_before = (
            RUNG_NAMES[self.rung_index - 1] if 0 < self.rung_index <= len(RUNG_NAMES) else None
        )
        return text if self.previous_rung == just_before else f"{text} (vs {self.previous_rung})"


LADDER_COLUMNS = tuple(f.name for f in fields(LadderRow))


def rung_index(record: RunRecord) -> int | None:
    """The run's `rung_index` tag, else its `rung`'s place in RUNG_NAMES; None off the ladder."""
    try:
        return int(record.setting(RUNG_INDEX) or "")
    except ValueError:
        rung = record.setting(RUNG)
        return RUNG_NAMES.index(rung) if rung in RUNG_NAMES else None


def _rung_name(index: int, runs_by_index: dict[int, list[RunRecord]]) -> str:
    for record in runs_by_index.get(index, []):
        if name := record.setting(RUNG):
            return name
    return RUNG_NAMES[index] if 0 <= index < len(RUNG_NAMES) else f"rung {index}"


def _chosen(runs: list[RunRecord]) -> tuple[RunRecord, Group]:
    """The newest FINISHED run of a rung, else its newest run, and its repeats."""
    newest = max(runs, key=lambda r: (r.status == FINISHED, r.start_time))
    return newest, next(g for g in group(runs) if newest in g.records)


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
    previous: tuple[LadderRow, Group] | None = None  # the last rung with a throughput
    fp32: tuple[LadderRow, Group] | None = None  # rung 0, when measured
    for index in range(max(runs_by_index) + 1):
        name = _rung_name(index, runs_by_index)
        runs = runs_by_index.get(index)
        if not runs:
            rows.append(LadderRow(rung_index=index, rung=name, status=MISSING))
            continue
        record, repeats = _chosen(runs)
        record = repeats.first if repeats.usable else record
        row = LadderRow(
            rung_index=index,
            rung=name,
            status=record.status,
            run_name=repeats.name(),
            run_id=record.run_id,
            precision=setting(record, PRECISION),
            speed=setting(record, SPEED),
            model=setting(record, MODEL),
            data=setting(record, DATA),
        )
        rows.append(row)
        if record.status != FINISHED:
            continue
        row.note = repeats.measured[record.run_id][1]
        row.compile_s = record.metrics.get(COMPILE_S)
        row.best_val_acc = record.metrics.get(BEST_VAL_ACC)
        row.test_acc = record.metrics.get(TEST_ACC)
        row.peak_mem_mb = peak_memory(record)
        samples = repeats.throughput() if repeats.usable else None
        if samples is None:
            aside = [contention(r) for r in repeats.finished if contention(r)]
            row.note = row.note or (f"contended ({aside[0]})" if aside else "")
            continue
        row.repeats = len(repeats.usable)
        row.samples_per_s, row.samples_per_s_low, row.samples_per_s_high = (
            samples.value, samples.low, samples.high
        )  # fmt: skip
        notes = []
        if previous is not None:
            gain, note = _gain(repeats, *previous)
            row.previous_rung = previous[0].rung
            if gain is not None:
                row.gain_vs_previous, row.gain_vs_previous_low, row.gain_vs_previous_high = (
                    gain.value, gain.low, gain.high
                )  # fmt: skip
            notes.append(note)
        if index == 0:
            fp32 = (row, repeats)
        if fp32 is not None:
            gain, note = _gain(repeats, *fp32)
            if gain is not None:
                row.gain_vs_fp32, row.gain_vs_fp32_low, row.gain_vs_fp32_high = (
                    gain.value, gain.low, gain.high
                )  # fmt: skip
            notes.append(note if note not in notes else "")
        row.note = "; ".join(filter(None, notes))
        previous = (row, repeats)
    return rows


def _gain(mine: Group, other: LadderRow, theirs: Group) -> tuple[Estimate | None, str]:
    """(mine's throughput over theirs, with its interval, "") when the two rungs are like for
    like (paired by repeat index where they ran interleaved), else (None, why)."""
    diffs = differences(comparable_settings(mine.first), comparable_settings(theirs.first),
                        LADDER_VARIES)  # fmt: skip
    if diffs:
        return None, f"not like for like with rung {other.rung}: differs in {differ_text(diffs)}"
    return ratio(mine, theirs), ""


def ladder_subject(rows: Sequence[LadderRow]) -> str:
    """What was trained, e.g. `simple_cnn on synthetic` (several models or data sets joined)."""

    def distinct(values: list[str | None]) -> str:
        return ", ".join(dict.fromkeys(v for v in values if v)) or "?"

    models = distinct([row.model for row in rows])
    data = distinct([row.data for row in rows])
    return f"{models} on {data}"
