"""A sweep run repeat by repeat: lockstep incarnations or whole-run rounds, until a precision.

`Repeats.run` is what the sweeper (`hydra_plugins.accelexp_sweeper.RepeatSweeper`) does when a
sweep says `compare=lockstep` or `precision_target=...`: each repeat is one incarnation of every
configuration — in lockstep, all of them at once as fresh processes taking turns
(`accelexp.lockstep.jobs`); with `compare=repeats`, one after another through Hydra's launcher,
as the round-robin of `accelexp.sweeper` — and with a `precision_target` the sweep reads its
ratios back from MLflow after each repeat (`accelexp.report.compare`, as the report computes
them) and stops once every ratio's 95 % half-width is within the target, or at `max_repeats`
(the budget), saying which.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, open_dict

from accelexp.errors import ConfigError
from accelexp.lockstep import jobs as lockstep_jobs
from accelexp.lockstep import together
from accelexp.sweeper import repeated

log = logging.getLogger(__name__)
# a target is checked from this many repeats on: an interval over repeats (processes) taken the
# first time it is narrow enough covers less than 95 % when it rests on 2-3 of them (an A/A
# stopped at 3 processes whose means agreed by chance, excluding 1.00: docs/statistics.md)
MIN_REPEATS_FOR_TARGET = 5
NO_RATIO = "no ratio to measure"
SET_ASIDE = "runs set aside: other work shared the machine while they were timed"


@dataclass
class Sampled:
    """The sweep's ratios after some repeats: the widest 95 % half-width, relative, and which."""

    repeats: int
    halfwidth: float | None  # None: some ratio has no interval yet
    worst: str  # the row it belongs to

    def within(self, target: float | None) -> bool:
        """Every ratio within `target` (whether or not enough repeats back it)."""
        return target is not None and self.halfwidth is not None and self.halfwidth <= target

    def met(self, target: float | None) -> bool:
        """Every ratio within `target`, over at least `MIN_REPEATS_FOR_TARGET` repeats."""
        return self.within(target) and self.repeats >= MIN_REPEATS_FOR_TARGET

    def line(self, target: float | None, spent: bool) -> str:
        width = "no interval yet" if self.halfwidth is None else f"±{100 * self.halfwidth:.1f} %"
        if self.met(target):
            return f"precision target ±{100 * target:g} % reached: {width}, {self.repeats} repeats"
        if self.within(target):
            return (f"after {self.repeats} repeats: widest ratio {width}, within the target; "
                    f"checked from repeat {MIN_REPEATS_FOR_TARGET} on")  # fmt: skip
        if spent:
            return f"budget spent at {width} after {self.repeats} repeats (widest: {self.worst})"
        return f"after {self.repeats} repeats: widest ratio {width} ({self.worst})"


def check(config: DictConfig, launcher_target: str) -> None:
    """Refuse, before any job, what a repeat-by-repeat sweep cannot do."""
    if config.compare == "lockstep" and not launcher_target.endswith("BasicLauncher"):
        raise ConfigError(
            f"compare=lockstep runs the sweep's jobs side by side on this machine, taking turns; "
            f"it cannot hand turns to jobs of another launcher ({launcher_target}). Leave "
            f"hydra/launcher at its default, or use compare=repeats."
        )
    least = max(config.repeats, MIN_REPEATS_FOR_TARGET)
    if config.precision_target is not None and config.max_repeats < least:
        raise ConfigError(
            f"precision_target={config.precision_target} checks its target from repeat {least} "
            f"on (repeats={config.repeats}, and at least {MIN_REPEATS_FOR_TARGET}: an interval "
            f"over fewer processes is not trusted to stop on), up to max_repeats="
            f"{config.max_repeats}: raise max_repeats to {least} or more."
        )


def shared_process(choice: str, configs: Sequence[DictConfig]) -> bool:
    """Whether the jobs of each incarnation share one process (`lockstep.process`: shared,
    own, or auto: shared where they can, `together.why_not`); refuses `shared` where they
    cannot, with why."""
    why = together.why_not(list(configs))
    if choice == "shared" and why:
        raise ConfigError(
            f"lockstep.process=shared runs every job as a thread of one process, but {why}: "
            f"use lockstep.process=own (or auto)."
        )
    shared = choice == "shared" or (choice == "auto" and not why)
    log.info(
        "lockstep: %s",
        "the jobs of each repeat share one process (their ratio cancels its own bias)"
        if shared
        else f"a process per job ({why or 'lockstep.process=own'}); its own bias is sampled "
        f"over fresh processes",
    )
    return shared


CONTEXT_MB = 512.0  # a CUDA context's own memory, per process (the forecast leaves it out)


def memory_problem(peaks_mb: dict[str, float], device_mb: float) -> str:
    """Jobs in lockstep share one GPU: "" when their forecast peaks (per job: the fullest
    device's, times its workers, plus a CUDA context each) fit `device_mb` together, else the
    message that refuses the sweep."""
    total = sum(peaks_mb.values())
    if total <= device_mb:
        return ""
    each = ", ".join(f"{name} {mb / 1024:.1f} GiB" for name, mb in peaks_mb.items())
    return (
        f"compare=lockstep keeps every configuration's job alive on the GPU at once, and their "
        f"forecast memory adds up to {total / 1024:.1f} GiB ({each}, CUDA contexts included) "
        f"of the GPU's {device_mb / 1024:.1f} GiB. Use compare=repeats, fewer configurations "
        f"per sweep, or a smaller data.batch_size."
    )


def check_memory(configs: Sequence[DictConfig], names: Sequence[str]) -> None:
    """Refuse a lockstep sweep whose jobs would not fit on the GPU together (CUDA only: on a
    CPU the jobs share host memory, which `config.resources` checks per job)."""
    import torch

    if not torch.cuda.is_available() or any(c.device == "cpu" for c in configs):
        return
    from accelexp.forecast import forecast

    peaks = {}
    for name, cfg in zip(names, configs, strict=True):
        ahead = forecast(cfg)
        peaks[name] = (ahead.peak_mb + CONTEXT_MB) * ahead.world_size
    # less the sweep's own context: its forecast set the device up (on the H200, NVML listed
    # the sweep beside its jobs)
    device_mb = torch.cuda.get_device_properties(0).total_memory / 2**20 - CONTEXT_MB
    if problem := memory_problem(peaks, device_mb):
        raise ConfigError(problem)


class Repeats:
    """Runs `configurations` repeat by repeat (see the module doc)."""

    def __init__(
        self,
        config: DictConfig,
        configurations: list[list[str]],
        launch: Callable[[list[list[str]], int], object],
        compose: Callable[[list[str]], DictConfig],
        sweep: object,
    ) -> None:
        """`launch(batch, first_job_number)`: Hydra's launcher, for `compare=repeats`;
        `compose(overrides)`: a job's config; `sweep`: the sweep callback whose parent run is
        open (`accelexp.callbacks.MlflowSweep`: its `run_id`, and the `environment` that makes
        a job's run its child), None without one."""
        self.config = config
        self.compose = compose
        self.sweep = sweep
        self.configurations = configurations
        self.launch = launch
        self.lockstep = config.compare == "lockstep"
        self.shared = False  # the jobs of an incarnation as threads of one process
        target = config.precision_target
        # with a target, its precision is read from the second repeat on (a sweep with no ratio
        # stops there), and may stop the sweep from MIN_REPEATS_FOR_TARGET on (`Sampled.met`)
        self.least = max(config.repeats, 2) if target else config.repeats
        self.most = config.max_repeats if target else config.repeats

    def run(self) -> list[object]:
        config, seed = self.config, self.config.seed
        vary = config.repeat_seed == "vary"
        count = len(self.configurations)
        design = "lockstep (live jobs taking turns)" if self.lockstep else "whole-run repeats"
        log.info(
            "%d configuration(s), %s repeat(s)%s, compared by %s",
            count,
            self.least if self.least == self.most else f"{self.least} to {self.most}",
            f" until every ratio is within ±{100 * config.precision_target:g} %"
            if config.precision_target
            else "",
            design,
        )
        if self.lockstep:
            names = self.names(self.configurations)
            configs = [self.compose(job) for job in self.configurations]
            check_memory(configs, names)
            self.shared = shared_process(config.lockstep.process, configs)
        returns: list[object] = []
        number = 0
        jobs = [self._without_index(job) for job in self.configurations]
        for index in range(self.most):
            batch = repeated(jobs, 1, seed if vary else None, first=index)
            started = time.perf_counter()
            returns.append(self._one_repeat(batch, number))
            number += len(batch)
            log.info(
                "repeat %d of the sweep done in %.0f s", index + 1, time.perf_counter() - started
            )
            if index + 1 < self.least:
                continue
            if config.precision_target is None:
                if index + 1 >= self.most:
                    break
                continue
            precision = self.precision(index + 1)
            spent = index + 1 >= self.most
            log.info("%s", precision.line(config.precision_target, spent))
            if precision.met(config.precision_target):
                break
            if precision.worst == NO_RATIO:  # more repeats cannot give it one
                log.warning(
                    "precision_target: no ratio of this sweep can be measured (its "
                    "configurations differ in more than world size, precision, parallelism, "
                    "model, data or speed switches, or its first configuration measured "
                    "nothing): stopping after %d repeat(s); accelexp-report says why per row.",
                    index + 1,
                )
                break
        return returns

    @staticmethod
    def _without_index(job: list[str]) -> list[str]:
        return [o for o in job if o.split("=", 1)[0].lstrip("+~") != "repeat_index"]

    def _one_repeat(self, batch: list[list[str]], number: int) -> object:
        if not self.lockstep:
            return self.launch(batch, number)
        return incarnation(
            self.config, batch, number, self.compose, self.sweep, self.shared,
            self.names(batch),
        )  # fmt: skip

    def names(self, jobs: Sequence[Sequence[str]]) -> list[str]:
        """Each job by the overrides that tell it apart from the sweep's other jobs."""
        return names(jobs, self.configurations)

    def precision(self, repeats: int) -> Sampled:
        """The widest relative half-width of the sweep's ratios, as the report computes them
        against the sweep's first configuration (`compare.sweep_baseline`)."""
        from accelexp.report.compare import compare, contention, sweep_baseline
        from accelexp.tracking.query import child_runs

        run_id = getattr(self.sweep, "run_id", None)
        if run_id is None:
            return Sampled(repeats, None, "the sweep has no parent run")
        records = child_runs(self.config.mlflow.tracking_uri, run_id)
        rows = compare(records, sweep_baseline(records), strict=False)
        widest, worst = -1.0, ""
        for row in rows:
            if row.baseline_run is None or row.baseline_run == row.run_name:
                continue  # no baseline, or the baseline itself
            if row.speedup is None or row.speedup_low is None or row.speedup_high is None:
                return Sampled(repeats, None, row.run_name)
            half = (math.log(row.speedup_high) - math.log(row.speedup_low)) / 2
            relative = math.expm1(half)
            if relative > widest:
                widest, worst = relative, row.run_name
        if widest < 0:
            if any(contention(r) for r in records):  # more repeats may time them on a quiet machine
                return Sampled(repeats, None, SET_ASIDE)
            return Sampled(repeats, None, NO_RATIO)
        return Sampled(repeats, widest, worst)


def names(jobs: Sequence[Sequence[str]], among: Sequence[Sequence[str]]) -> list[str]:
    """Each job by the overrides that tell it apart from the other jobs `among`."""
    common = set.intersection(*(set(j) for j in among))
    return [
        " ".join(o for o in job if o not in common and not o.startswith("repeat_index="))
        or f"job {i}"
        for i, job in enumerate(jobs)
    ]


def incarnation(
    config: DictConfig,
    batch: list[list[str]],
    number: int,
    compose: Callable[[list[str]], DictConfig],
    sweep: object,
    shared: bool,
    names: list[str],
) -> list[lockstep_jobs.JobEnd]:
    """One repeat of `batch` in lockstep (jobs numbered from `number`): as threads of one
    process when `shared`, else a process each; a job's run it left open closed."""
    environment = dict(getattr(sweep, "environment", {}) or {})
    configs = [job_config(compose, job) for job in batch] if shared else None

    def close_unclosed(end: lockstep_jobs.JobEnd, status: str) -> None:
        """A job that died without closing its run (SIGKILL, the OOM killer, a signal while
        its next process started): its run closed as `status`, never left RUNNING."""
        from accelexp.record import FAILED, FINISHED, KILLED
        from accelexp.tracking.life import close_run

        close_run(config.mlflow, end.output_dir, status, keep=(FINISHED, FAILED, KILLED))

    sweep_dir = Path(config.hydra.sweep.dir)
    ends, _said = lockstep_jobs.run_incarnation(
        batch, number, sweep_dir, environment, names, close_unclosed, configs,
        config.lockstep.turn_timeout_s,
    )  # fmt: skip
    return ends


def job_config(compose: Callable[[list[str]], DictConfig], job: list[str]) -> DictConfig:
    """A job's config as its own process would have it (without Hydra's node)."""
    cfg = compose(job).copy()
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg
