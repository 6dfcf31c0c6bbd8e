"""Hydra's basic sweeper, with repeats run round-robin: `python run.py -m ... repeats=3`.

A sweep's jobs are the cartesian product of its overrides, as Hydra's `BasicSweeper` makes it;
with `repeats=N` each job is run N times, and the N rounds follow one another — A B C, C B A,
A B C, never A A A B B B — so a drift of the machine's speed (another job starting, a GPU
warming up, a neighbour on the host) falls on every configuration alike, and repeat i of every
configuration ran close in time to repeat i of the others: the report pairs them by that index
(`accelexp.report.compare`). Every other round runs backwards (as autotune's rounds and
lockstep's turns do): what being first or second in a round does to a run cancels over two
rounds. (An A/A whose side b read 1.6-5 % slower in 2 of 5 trials was not the order, though, but
the collector reclaiming the job before's garbage in the next job's steps: each job now starts
with a collection, `accelexp.train.run`; `docs/statistics.md`.) Each job gets
`repeat_index=i`; with `repeat_seed=vary` also `seed=<seed + i>` (varied seeds give accuracy's
spread; the same seed isolates speed noise).

The sweeper itself is `hydra_plugins.accelexp_sweeper.RepeatSweeper` (Hydra takes plugins from
its `hydra_plugins` package only), selected in conf/default_sweeper.yaml (`override
/hydra/sweeper: repeat`); it asks `plan` for its jobs, and `check_configurations` whether each of
its configurations would pass the single run's validation (`accelexp.config.validate`), so a
sweep of a bad value is refused with one message before its first job instead of starting jobs
that fail one after the other. Another sweeper chosen on the command line
or by an experiment file (`hydra/sweeper=optuna`, `+experiment=optuna`, `+experiment=autotune`)
replaces it, repeats and all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from hydra.core.override_parser.types import Override
from omegaconf import DictConfig

from accelexp.errors import ConfigError

log = logging.getLogger(__name__)
# what a sweep may not vary: the sweeper's own keys, how it repeats (not an Affects kind:
# repeat_index affects results, repeats and repeat_seed nothing, and so do keys a sweep may vary)
OWN_KEYS = ("repeats", "repeat_seed", "repeat_index")


def plan(
    overrides: Sequence[Override], jobs: list[list[str]], config: DictConfig
) -> list[list[str]]:
    """The sweep's jobs (`jobs`: Hydra's product of `overrides`), each `config.repeats` times,
    round-robin; a `ConfigError` for a sweep of the repeat keys themselves, or fewer than one
    repeat. Logs how many jobs that makes, before the first one runs."""
    keys = {o.get_key_element().lstrip("+~") for o in overrides}
    swept = {o.get_key_element().lstrip("+~") for o in overrides if o.is_sweep_override()}
    if own := [key for key in OWN_KEYS if key in swept]:
        raise ConfigError(
            f"{own[0]} cannot be swept: repeats=N runs every configuration of the sweep N "
            f"times (repeat_index is set for each). Give one value, e.g. repeats=3."
        )
    if "repeat_index" in keys:
        raise ConfigError("repeat_index is set by the sweeper for each repeat: leave it out.")
    if not jobs:  # Hydra's sweeper would fail on an assertion
        empty = [
            o.input_line
            for o in overrides
            if o.is_sweep_override() and not list(o.sweep_string_iterator())
        ]
        raise ConfigError(
            f"{' '.join(empty) or 'This sweep'} sweeps no value: give it at least one, e.g. "
            f"epochs=range(1,4) or epochs=1,2."
        )
    if config.repeats < 1:  # Hydra's sweeper would fail on an assertion, naming nothing
        raise ConfigError(
            f"repeats={config.repeats}: each configuration runs at least once; give repeats=1 "
            f"or more."
        )
    vary = config.repeat_seed == "vary"
    if vary and "seed" in swept:
        raise ConfigError(
            "repeat_seed=vary gives each repeat its own seed, and this sweep varies seed "
            "itself: use repeat_seed=same, or drop the seed sweep."
        )
    log.info("%s", job_count(len(jobs), config.repeats))
    return repeated(jobs, config.repeats, config.seed if vary else None)


def job_count(configurations: int, repeats: int) -> str:
    """What a sweep says before its first job: "This sweep runs 8 jobs (4 configurations x 2
    repeats)."."""
    jobs = configurations * repeats
    noun = "job" if jobs == 1 else "jobs"
    if repeats == 1:
        return f"This sweep runs {jobs:,} {noun}."
    return (
        f"This sweep runs {jobs:,} {noun} ({configurations:,} "
        f"configuration{'' if configurations == 1 else 's'} x {repeats:,} repeats)."
    )


def check_configurations(
    overrides: Sequence[Override],
    jobs: Sequence[Sequence[str]],
    compose: Callable[[list[str]], DictConfig],
) -> None:
    """Each of the sweep's configurations (`jobs`: Hydra's product of `overrides`, before
    repeats), composed by `compose` and checked as a single run checks it
    (`accelexp.config.validate.validate`): a `ConfigError` naming the first that would fail (by
    its swept values), before any job runs."""
    from omegaconf import open_dict, read_write

    from accelexp.config.validate import validate

    swept = {o.get_key_element() for o in overrides if o.is_sweep_override()}
    for job in jobs:
        cfg = compose(list(job))
        with read_write(cfg), open_dict(cfg):  # the job's config, as Hydra hands it to run.py
            cfg.pop("hydra", None)
        try:
            validate(cfg)
        except ConfigError as error:
            values = [o for o in job if o.split("=", 1)[0] in swept]
            which = f"The job `{' '.join(values)}`" if len(jobs) > 1 and values else "This sweep"
            raise ConfigError(f"{which} cannot run, so no job of the sweep ran. {error}") from None


def repeated(
    jobs: list[list[str]], repeats: int, seed: int | None, first: int = 0
) -> list[list[str]]:
    """Each job `repeats` times, round after round from round `first`, every odd round
    backwards; `seed`: round 0's (vary)."""
    rounds = []
    for index in range(first, first + repeats):
        for job in jobs if index % 2 == 0 else jobs[::-1]:
            if seed is None:
                rounds.append([*job, f"repeat_index={index}"])
            else:  # the command line's seed=S is the first repeat's
                kept = [o for o in job if o.split("=", 1)[0].lstrip("+~") != "seed"]
                rounds.append([*kept, f"repeat_index={index}", f"seed={seed + index}"])
    return rounds
