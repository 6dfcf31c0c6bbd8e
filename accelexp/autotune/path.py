"""The autotune loop's path (`AutotunePath`) as a table, a plot and the line to paste.

`publish` writes into the sweep's folder `autotune/`: `path.md` (how it started, each step —
round, candidate, why the verdict suggested it, speedup with its 95 % interval, test accuracy
against the base's, the decision and why — and the overrides found), `path.json` (the same for
machines) and `path.png` (the cumulative gain of the kept steps, each with its interval, the
rejected candidates beside them); then logs them to the sweep's parent run under `autotune/`
and tags it with the overrides found (`record.AUTOTUNE_BEST`). `console` is what the sweep says
at its end.

The cumulative gain multiplies the kept steps' gains: each step was measured against the step
before it, not against the start, so the product is a point figure without an interval.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from accelexp import record, stats
from accelexp.autotune.loop import AutotunePath, Step, key_of
from accelexp.report.plots import _figure, _legend_outside, _save
from accelexp.sweeper import OWN_KEYS

PATH_TABLE = "path.md"
PATH_JSON = "path.json"
PATH_PLOT = "path.png"
ARTIFACTS = "autotune"  # the parent run's folder of them
# what the line to paste leaves out: the sweep's own keys, which a single run does not take (it
# refuses repeats=N without -m); not an Affects kind: mlflow.*, progress... stay as typed
SWEEP_ONLY = frozenset({"experiment", "autotune", *OWN_KEYS})


def _speedup(step: Step) -> str:
    return "" if step.speedup is None else stats.format_estimate(step.speedup, suffix="×")


def _acc(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def cumulative(path: AutotunePath) -> list[tuple[str, float]]:
    """(the path's rung, its gain over the start): the start at 1.0, then each kept step."""
    gains = [("start", 1.0)]
    for step in path.kept:
        gains.append((f"+{step.candidate.override}", gains[-1][1] * step.speedup.value))
    return gains


def command(overrides: list[str]) -> str:
    """`python run.py <overrides>` as one run: without the sweep's own keys (the autotune
    experiment, `autotune.*`, `repeats`...), which a single run does not take."""
    kept = [
        o
        for o in overrides
        if key_of(o).split(".")[0] not in SWEEP_ONLY and not key_of(o).startswith("hydra.sweep")
    ]
    return " ".join(["python run.py", *kept])


def undecided(path: AutotunePath) -> list[Step]:
    """The candidates whose speedup's interval held 1.0: neither faster nor slower, yet."""
    return [s for s in path.steps if s.speedup is not None and not s.kept
            and stats.verdict(s.speedup) == stats.NO_DIFFERENCE]  # fmt: skip


def paste(path: AutotunePath) -> str:
    """The line to paste at the end: the best found, or the start as it was."""
    return command(path.best if path.kept else path.start)


def table(path: AutotunePath) -> str:
    """The path as Markdown."""
    start = " ".join(path.start) or "(the defaults)"
    total = cumulative(path)[-1][1]
    lines = [
        "# Autotune",
        "",
        f"- started from: `{start}`",
        f"- found: `{path.paste() or '(nothing: the start is the best it could prove)'}`"
        + (f" — ≈ {total:.2f}× the start (the product of the kept steps)" if path.kept else ""),
        f"- run it: `{paste(path)}`",
        f"- stopped: {path.stopped}",
        f"- {path.trials} trial run(s) in {path.seconds:.0f} s",
        "",
        "| round | candidate | suggested because | speedup (95 % interval) | test acc "
        "(base → candidate) | decision | why |",
        "|---|---|---|---|---|---|---|",
    ]
    for step in path.steps:
        decision = "**kept**" if step.chosen else ("kept" if step.kept else "rejected")
        lines.append(
            f"| {step.round} | `{step.candidate.override}` | {step.candidate.why} | "
            f"{_speedup(step)} | {_acc(step.base_acc)} → {_acc(step.acc)} | {decision} | "
            f"{step.why} |"
        )
    lines += [
        "",
        "**kept**: of its round's kept candidates, the fastest, joined to the base for the next.",
        "",
    ]
    return "\n".join(lines)


def path_figure(path: AutotunePath) -> Any | None:
    """The cumulative gain of each kept step (its interval as a bar), and every other candidate
    of a round at the gain it measured over that round's base, its interval as a bar too (one
    without a measurement named at the foot, at no height); None before any step."""
    if not path.steps:
        return None
    figure, axes = _figure((9, 4.5))
    gains = cumulative(path)
    x = list(range(len(gains)))
    low, high = [0.0], [0.0]  # the start: no interval
    for (_, gain), step in zip(gains[1:], path.kept, strict=True):
        low.append(gain * (1 - step.speedup.low / step.speedup.value))
        high.append(gain * (step.speedup.high / step.speedup.value - 1))
    label = "kept: gain over the start (bar: the step's 95 % interval)"
    axes.errorbar(x, [g for _, g in gains], yerr=[low, high], marker="o", capsize=4, label=label)
    rounds = sorted({step.round for step in path.steps})
    for position, round_no in enumerate(rounds):
        base_gain = gains[min(position, len(gains) - 1)][1]
        others = [s for s in path.steps if s.round == round_no and not s.chosen]
        for i, step in enumerate(others):
            spread = 0.3 if len(others) > 1 else 0.0  # side by side, none hiding another
            x_at = position + 0.5 - spread / 2 + spread * i / max(1, len(others) - 1)
            if step.speedup is None:  # no figure to draw: named at the foot
                axes.annotate(
                    f"{step.candidate.override}: not measured", (x_at, 0), fontsize="x-small",
                    color="0.4", xytext=(0, 4), textcoords="offset points", rotation=90,
                )  # fmt: skip
                continue
            gain = step.speedup.scaled(base_gain)
            below, above = _error(gain)
            axes.errorbar(
                x_at, gain.value, yerr=[[below], [above]], fmt="x", color="0.5", capsize=3
            )
            axes.annotate(
                step.candidate.override, (x_at, gain.value), fontsize="x-small", color="0.4",
                xytext=(4, 2), textcoords="offset points",
            )  # fmt: skip
    if any(not step.chosen and step.speedup is not None for step in path.steps):
        axes.errorbar(
            [], [], yerr=[], fmt="x", color="0.5", capsize=3,
            label="not kept: measured over its round's base (bar: 95 % interval)",
        )  # fmt: skip
    axes.axhline(1.0, color="black", linestyle=":", linewidth=1.2)
    axes.set_xticks(x, [name for name, _ in gains], rotation=15, ha="right", fontsize="small")
    axes.set_ylabel("samples/s over the start")
    axes.set_ylim(bottom=0)
    axes.set_title(f"Autotune's path: {path.paste() or 'nothing kept'}")
    axes.grid(alpha=0.3)
    _legend_outside(figure)
    return figure


def _error(estimate: stats.Estimate) -> tuple[float, float]:
    """An estimate's interval as matplotlib's (below, above); (0, 0) without one."""
    if not estimate.has_interval:
        return 0.0, 0.0
    return estimate.value - estimate.low, estimate.high - estimate.value


def publish(path: AutotunePath, uri: str, out_dir: Path) -> list[Path]:
    """Write the path into `out_dir` and log it to the sweep's parent run; the files written."""
    from accelexp.tracking.names import PARENT_RUN_ENV
    from accelexp.tracking.query import log_artifacts, set_tags

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / PATH_TABLE).write_text(table(path))
    (out_dir / PATH_JSON).write_text(json.dumps(path.as_dict(), indent=2, default=_number))
    files = [out_dir / PATH_TABLE, out_dir / PATH_JSON]
    plot = _save(path_figure(path), out_dir / PATH_PLOT)
    files += [plot] if plot else []
    parent = os.environ.get(PARENT_RUN_ENV)
    if parent:
        log_artifacts(uri, parent, files, ARTIFACTS)
        set_tags(uri, parent, {record.AUTOTUNE_BEST: path.paste()})
    return files


def _number(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else str(value)


def console(path: AutotunePath, folder: Path) -> str:
    """What the sweep says at its end: every step in a line, what it found (and, when nothing,
    which candidates stayed undecided), the path's file, and last one line to paste: the best
    found, or the start as it was."""
    lines = [f"Autotune stopped: {path.stopped} ({path.trials} runs, {path.seconds:.0f} s)."]
    for step in path.steps:
        decision = "KEPT" if step.chosen else ("kept" if step.kept else "rejected")
        lines.append(f"  round {step.round}: {step.candidate.override}: {decision}: {step.why}")
    if path.kept:
        lines.append(f"Found: {path.paste()}")
    else:
        lines.append("Found nothing measurably faster than the start.")
        if open_ := undecided(path):
            names = ", ".join(step.candidate.override for step in open_)
            lines.append(
                f"Undecided (no measurable difference): {names}; more repeats, or a sweep of "
                f"your own with compare=lockstep, could still tell."
            )
    lines.append(f"The path: {folder / PATH_TABLE}")
    lines.append(f"Run it: {paste(path)}" if path.kept else f"Keep the start: {paste(path)}")
    return "\n".join(lines)
