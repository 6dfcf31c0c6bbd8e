"""What a run gives a sweeper: `objective=`, its names, their metrics and directions.

`python run.py -m hydra/sweeper=optuna objective=...` optimizes what run.py's `main` returns:
`sweeper_value` turns a run's final metrics (`accelexp.record`'s names, as `launch` returns them)
into one float for one objective, or a list of floats for several (`objective=[test_acc,
samples_per_s]`), in the order given. Each objective has its own direction, which the sweeper's
(`hydra.sweeper.direction`) must repeat: `check_directions` says what to type when it does not.

- `test_acc` — the best checkpoint's test accuracy (`record.TEST_ACC`), maximized;
- `samples_per_s` — the run's steady-state throughput (`record.THROUGHPUT`), maximized;
- `time_to_target` — seconds until val_acc first reached `target_accuracy`
  (`record.TIME_TO_TARGET_S`), minimized. A run that never reached it gives +inf, the worst value
  (Optuna takes infinities, refuses NaN), with a warning: the trial counts, at the bottom.

A metric a run did not measure otherwise is the worst value of its direction too (-inf when
maximized), with a warning. A job that failed returns None instead (`run.py`): Optuna's sweeper
then marks its trial FAIL and the study goes on.

The objectives and their directions are tagged on every run (`tags`: `record.OBJECTIVE`,
`record.OBJECTIVE_DIRECTIONS`), so the report finds them (`accelexp.report.pareto`).

Imports nothing of accelexp but the record's names, nor anything heavy: the schema reads it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from accelexp import record

log = logging.getLogger(__name__)

MAXIMIZE = "maximize"
MINIMIZE = "minimize"


@dataclass(frozen=True)
class Objective:
    """One thing a sweep can optimize: its name in `objective=`, the run's metric, the direction."""

    name: str
    metric: str
    direction: str

    @property
    def worst(self) -> float:
        """The value of a run that did not measure the metric: the end of the wrong side."""
        return math.inf if self.direction == MINIMIZE else -math.inf


OBJECTIVES = {
    objective.name: objective
    for objective in (
        Objective("test_acc", record.TEST_ACC, MAXIMIZE),
        Objective("samples_per_s", record.THROUGHPUT, MAXIMIZE),
        Objective("time_to_target", record.TIME_TO_TARGET_S, MINIMIZE),
    )
}
NAMES = tuple(OBJECTIVES)
DEFAULT = "test_acc"
EXAMPLE = "[test_acc,samples_per_s]"
ALLOWED = f"one of {', '.join(NAMES)}, or a list of them without repeats, e.g. {EXAMPLE}"


def names_of(setting: Any) -> list[str]:
    """`objective=`'s value as a list of names: "test_acc" -> [test_acc]; a list as it is."""
    if isinstance(setting, str):
        return [setting]
    return [str(name) for name in setting]


def valid(setting: Any) -> bool:
    """A name of `OBJECTIVES`, or a non-empty list of them, none twice."""
    if not isinstance(setting, str) and not isinstance(setting, Sequence):
        return False
    names = names_of(setting)
    return bool(names) and len(set(names)) == len(names) and all(n in OBJECTIVES for n in names)


def objectives(setting: Any) -> list[Objective]:
    """The objectives `setting` (`objective=`'s value, checked by `accelexp.config.validate`)
    names, in order."""
    return [OBJECTIVES[name] for name in names_of(setting)]


def directions(setting: Any) -> list[str]:
    """Each objective's direction, in order: ["maximize", "maximize"]."""
    return [objective.direction for objective in objectives(setting)]


def needs_target(setting: Any) -> bool:
    """Whether an objective is the time to `target_accuracy` (which must then be set)."""
    return any(o.metric == record.TIME_TO_TARGET_S for o in objectives(setting))


def tags(setting: Any) -> dict[str, str]:
    """The run's objectives and their directions, as tags: comma-separated, in order; none for
    a setting that names no objective (a run failing validation records its failure)."""
    if not valid(setting):
        return {}
    return {
        record.OBJECTIVE: ",".join(names_of(setting)),
        record.OBJECTIVE_DIRECTIONS: ",".join(directions(setting)),
    }


def sweeper_value(setting: Any, metrics: Mapping[str, float]) -> float | list[float]:
    """What run.py returns to a sweeper: the objective's metric from a run's final `metrics` (a
    float, also for a list of one), or a list of them for several objectives. A metric the run
    did not measure is the objective's worst value, with a warning that says why."""
    values = []
    for objective in objectives(setting):
        value = metrics.get(objective.metric)
        if value is None:
            value = objective.worst
            why = (
                "val_acc never reached target_accuracy"
                if objective.metric == record.TIME_TO_TARGET_S
                else f"the run measured no {objective.metric}"
            )
            log.warning(
                "objective %s: %s; the sweeper gets %s, the worst value when %s",
                objective.name,
                why,
                value,
                objective.direction[:-1] + "ed",
            )
        values.append(float(value))
    return values[0] if len(values) == 1 else values


def written(names: Sequence[str]) -> str:
    """`objective=`'s value as typed: test_acc, or [test_acc,samples_per_s]."""
    return names[0] if len(names) == 1 else f"[{','.join(names)}]"


def check_directions(setting: Any, direction: Any) -> str | None:
    """The problem with a sweeper's `direction` (a name, an Optuna `Direction` or a list of them)
    for these objectives, with the override to type; None when they agree."""
    wanted = directions(setting)
    listed = isinstance(direction, Sequence) and not isinstance(direction, str)  # ListConfig too
    given = [str(getattr(d, "name", d)) for d in (direction if listed else [direction])]
    if given == wanted:
        return None
    names = names_of(setting)
    each = ", ".join(f"{o.name} is {o.direction}d" for o in objectives(setting))
    override = f"hydra.sweeper.direction={written(wanted)}"
    typed = override if len(wanted) == 1 else f"'{override}'"  # [a,b]: quoted for a shell
    return (
        f"objective={written(names)} ({each}), but hydra.sweeper.direction={written(given)}: "
        f"add {typed} or pick another objective."
    )
