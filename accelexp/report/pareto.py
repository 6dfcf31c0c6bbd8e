"""The Pareto front of a sweep with two objectives: the trials no other trial beats on both.

A run records what it returned to the sweeper (`accelexp.objective.tags`: `record.OBJECTIVE`,
`record.OBJECTIVE_DIRECTIONS`); when the selected runs carry two objectives —
`python run.py -m +experiment=optuna_pareto`, or any sweep with `objective=[a,b]` — `pareto`
gives each trial's two values (the run's metrics that `accelexp.objective` names, what the
sweeper was told) and marks the trials on the front. A trial is off the front when another is at
least as good on both objectives and better on one, each in its own direction; equal trials are
all on it, as in Optuna's `best_trials`. A run that failed, or lacks a value (time_to_target
of a run that never reached target_accuracy: +inf to Optuna), is left out, and the notes say so.

The front is a table (`FRONT_NAMES`: the front's trials, what the sweep varied in them and both
values, best first by the first objective; the CSV's columns are named after the objectives) and
`PARETO_PLOT`: every trial, objective 1 against objective 2, the front joined and ringed. Pure:
records in, a `Front` out; `write_front` writes the files; the sweep's report (`cli`, `html`)
adds them.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from accelexp.objective import MAXIMIZE, OBJECTIVES, Objective
from accelexp.record import (
    DATA,
    DEVICE,
    FINISHED,
    MODEL,
    OBJECTIVE,
    OBJECTIVE_DIRECTIONS,
    OVERRIDES,
)
from accelexp.report.formats import Layout, to_csv, to_markdown
from accelexp.report.plots import _figure, _legend_outside, save_or_remove, title_subject
from accelexp.tracking.query import RunRecord

PARETO_PLOT = "pareto.png"
FRONT_NAMES = ("pareto.csv", "pareto.md")
FRONT_COLOUR = "#d62728"  # the front's points and line (tab10 red); the other trials grey
OTHERS_COLOUR = "#7f7f7f"
LONG_NUMBER = re.compile(r"(?<==)-?\d+\.\d{5,}(e-?\d+)?\b")  # a value of 5 decimals or more


@dataclass
class Trial:
    """One run of the sweep: what it varied, its two objectives' values, whether it is on the
    front."""

    run_name: str
    run_id: str
    status: str
    overrides: str  # the overrides the trials differ in (all of them when they differ in none)
    value_1: float
    value_2: float
    on_front: bool = False


@dataclass
class Front:
    """The trials of a two-objective sweep (those with both values), and the runs left out."""

    objectives: tuple[Objective, Objective]  # each with the direction the runs were tagged with
    trials: list[Trial]
    left_out: list[str] = field(default_factory=list)  # "<run>: why"
    subject: str = ""  # what was trained where, for the plot's title

    @property
    def rows(self) -> list[Trial]:
        """The front, best first by the first objective."""
        first = self.objectives[0]
        front = [trial for trial in self.trials if trial.on_front]
        return sorted(front, key=lambda t: t.value_1, reverse=first.direction == MAXIMIZE)

    @property
    def title(self) -> str:
        return f"Pareto front: {self.objectives[0].name} vs {self.objectives[1].name}"

    @property
    def layout(self) -> Layout:
        """How the front reads as a table: the objectives' names and directions as headers."""
        first, second = self.objectives
        return FrontLayout(
            row_type=Trial,
            headers={
                "run_name": "run",
                "value_1": f"{first.name} ({first.direction[:3]})",
                "value_2": f"{second.name} ({second.direction[:3]})",
                "overrides": "overrides",
            },
            display={"value_1": _shape(first), "value_2": _shape(second)},
            fold=frozenset({"run_name", "overrides"}),
            names={"value_1": first.name, "value_2": second.name},
        )


@dataclass(frozen=True)
class FrontLayout(Layout):
    """A layout whose CSV header names the objectives (`test_acc`) instead of `value_1`, and
    whose readable tables show a drawn number of the overrides to 4 significant digits
    (optimizer.lr=0.03756; the CSV keeps 0.03756196144499839)."""

    names: dict[str, str] = field(default_factory=dict)

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(self.names.get(f.name, f.name) for f in fields(self.row_type))

    def text(self, row: Any, key: str) -> str:
        text = super().text(row, key)
        if key != "overrides":
            return text
        return LONG_NUMBER.sub(lambda number: f"{float(number.group()):.4g}", text)


def _shape(objective: Objective) -> str:
    """A value as the tables read it: an accuracy to 4 places, a rate or a time to 1."""
    return "{:.4f}" if objective.metric.endswith("acc") else "{:.1f}"


def dominates(a: Sequence[float], b: Sequence[float], directions: Sequence[str]) -> bool:
    """Whether `a` is at least as good as `b` on every objective and better on one."""
    better = [x - y if d == MAXIMIZE else y - x for x, y, d in zip(a, b, directions, strict=True)]
    return all(gain >= 0 for gain in better) and any(gain > 0 for gain in better)


def non_dominated(points: Sequence[Sequence[float]], directions: Sequence[str]) -> list[bool]:
    """For each point, whether no other point dominates it."""
    return [not any(dominates(other, p, directions) for other in points) for p in points]


def _objectives_of(records: Sequence[RunRecord]) -> tuple[Objective, Objective] | None:
    """The two objectives of the newest run tagged with two (the others' runs are left out),
    each with its tagged direction; None when no run has two that `accelexp.objective` knows."""
    for record in sorted(records, key=lambda r: r.start_time, reverse=True):
        names = record.tags.get(OBJECTIVE, "").split(",")
        directions = record.tags.get(OBJECTIVE_DIRECTIONS, "").split(",")
        if len(names) == 2 == len(directions) and all(name in OBJECTIVES for name in names):
            first, second = (
                Objective(name, OBJECTIVES[name].metric, direction)
                for name, direction in zip(names, directions, strict=True)
            )
            return first, second
    return None


def _varied(records: Sequence[RunRecord]) -> dict[str, str]:
    """run id -> the overrides in which the runs differ (every override when none differs)."""
    parsed = {}
    for record in records:
        words = shlex.split(record.tags.get(OVERRIDES, ""))
        parsed[record.run_id] = dict(w.partition("=")[::2] for w in words)
    keys = {key for overrides in parsed.values() for key in overrides}
    varied = {k for k in keys if len({o.get(k) for o in parsed.values()}) > 1} or keys
    return {
        run_id: " ".join(f"{k}={v}" for k, v in overrides.items() if k in varied)
        for run_id, overrides in parsed.items()
    }


def pareto(records: Sequence[RunRecord]) -> Front | None:
    """The front of the runs' two objectives; None when they carry no two objectives."""
    objectives = _objectives_of(records)
    if objectives is None:
        return None
    tag = ",".join(o.name for o in objectives)
    mine = [r for r in records if r.tags.get(OBJECTIVE) == tag]
    left_out = []
    if len(mine) < len(records):
        left_out.append(f"{len(records) - len(mine)} run(s) with other objectives")
    varied = _varied(mine)
    trials = []
    for record in sorted(mine, key=lambda r: r.start_time):
        values = [record.metrics.get(o.metric) for o in objectives]
        missing = [o.metric for o, v in zip(objectives, values, strict=True) if v is None]
        if record.status != FINISHED or missing:
            why = record.status if record.status != FINISHED else f"no {', '.join(missing)}"
            left_out.append(f"{record.name}: {why}")
            continue
        trials.append(Trial(record.name, record.run_id, record.status, varied[record.run_id],
                            *values))  # fmt: skip
    directions = [o.direction for o in objectives]
    points = [(t.value_1, t.value_2) for t in trials]
    for trial, on_front in zip(trials, non_dominated(points, directions), strict=True):
        trial.on_front = on_front
    subject = title_subject(
        [r.tags.get(MODEL) for r in mine],
        [r.tags.get(DATA) for r in mine],
        [r.tags.get(DEVICE) for r in mine],
    )
    return Front(objectives, trials, left_out, subject)


def notes(front: Front) -> list[str]:
    """What the table does not show: the runs left out, and why."""
    return [f"left out: {why}" for why in front.left_out]


def front_markdown(front: Front) -> str:
    """The front as a GitHub table under its title, the runs left out listed under it."""
    lines = [f"### {front.title}", "", to_markdown(front.rows, front.layout).rstrip()]
    if front.left_out:
        lines += ["", *(f"- {note}" for note in notes(front))]
    return "\n".join(lines) + "\n"


def pareto_figure(front: Front) -> Any | None:
    """Every trial, objective 1 against objective 2: the others grey, the front red, joined in
    the first objective's order and ringed; None without a trial."""
    if not front.trials:
        return None
    first, second = front.objectives
    figure, axes = _figure((8, 5))
    others = [t for t in front.trials if not t.on_front]
    if others:
        axes.plot([t.value_1 for t in others], [t.value_2 for t in others], linestyle="none",
                  marker="o", color=OTHERS_COLOUR, alpha=0.7, label="other trials")  # fmt: skip
    rows = sorted(front.rows, key=lambda t: t.value_1)
    axes.plot([t.value_1 for t in rows], [t.value_2 for t in rows], color=FRONT_COLOUR,
              marker="o", markersize=9, markerfacecolor="none", markeredgewidth=2,
              label=f"Pareto front ({len(rows)})")  # fmt: skip
    axes.set_xlabel(f"{first.name} ({first.direction}d)")
    axes.set_ylabel(f"{second.name} ({second.direction}d)")
    axes.set_title(f"{front.title}, {len(front.trials)} trials\n{front.subject}")
    axes.grid(alpha=0.3)
    axes.set_axisbelow(True)
    _legend_outside(figure)
    return figure


def write_front(front: Front | None, out_dir: Path, plots: bool = True) -> list[Path]:
    """pareto.csv, pareto.md and PARETO_PLOT for a front; with none, no file (nor an older
    report's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if front is None:
        for name in (*FRONT_NAMES, PARETO_PLOT):
            (out_dir / name).unlink(missing_ok=True)
        return []
    csv_path, markdown_path = (out_dir / name for name in FRONT_NAMES)
    csv_path.write_text(to_csv(front.rows, front.layout))
    markdown_path.write_text(front_markdown(front))
    written = [csv_path, markdown_path]
    if plots:
        written += save_or_remove(pareto_figure(front), out_dir / PARETO_PLOT)
    return written
