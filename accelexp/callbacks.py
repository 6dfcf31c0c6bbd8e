"""Hydra callbacks (registered under `hydra.callbacks` in conf/config.yaml).

`MlflowSweep` gives every multirun one MLflow parent run: opened before the first job (named from
the sweep's overrides, tagged with the sweep dir, the override grid as params), handed to the jobs
through the environment so each job's run — in this process, in worker processes or in a
submitit/Slurm job — is its child; closed after the last job with a summary table and plots as
artifacts (`report/report.html` among them), FAILED if any child failed, and one line gives the
link that opens the report in the MLflow UI; KILLED on SIGINT/SIGTERM (`abort`). A single run
has no parent. Each job gets the parent in its environment when it starts, in whichever process
runs it (`on_job_start`: joblib's worker processes, a submitit job), so its run is a child. A
sweeper that optimizes (Optuna's: `hydra.sweeper.direction`) has its objective checked before the
first job (`accelexp.config.validate.check_sweep_objective`: a direction not the objective's is
refused, exit 2) and tagged on the parent (`accelexp.objective.tags`); the study's best trials
(Optuna's `optimization_results.yaml`) are logged on the parent when it ends. A sweep whose
parent cannot be opened (an unreachable tracking server, say) stops before its first job, exit 2;
one whose parent cannot be closed exits 1. While its jobs run the callback is registered with the
`accelexp.outcome.SweepState` of the `run_main` running it, which closes the parent on a signal or
error between jobs and exits 1 after failed jobs.

`NoPasswords` hides the passwords of URIs in a job's overrides as Hydra prints them when the job's
error ends `run.py` ("Error executing job with overrides: [...]").
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict, read_write

from accelexp import outcome
from accelexp.errors import AccelexpError

log = logging.getLogger(__name__)
OPTIMIZATION_RESULTS = "optimization_results.yaml"  # Optuna's sweeper writes it in the sweep dir
# Optuna's sweeper plugin (hydra-optuna-sweeper 1.3.0, written for optuna 2) builds its sampler
# and distributions with what optuna 3 to 5 deprecate (UniformDistribution, TPESampler's
# consider_prior...): ten FutureWarnings a sweep that nobody running it can act on
PLUGIN_DEPRECATIONS = r".*has been deprecated in v\d.*removed in v6\."
# what a sweep's name leaves out: Hydra's own keys and where its runs are recorded; not
# Affects.NOTHING's keys, which may name a sweep (`sweep repeats=3`, `... compare=lockstep`)
UNNAMED_IN_SWEEP = ("hydra.", "mlflow.")


def sweep_grid(config: DictConfig) -> dict[str, str]:
    """The sweep's settings: `hydra.sweeper.params` of an experiment file, then the command
    line's overrides (which win), e.g. {"parallelism.nprocs": "1,2", "precision": "fp32,amp"}."""
    params = config.hydra.sweeper.get("params") or {}
    grid = {str(k).lstrip("+"): str(v) for k, v in params.items()}  # `+rung`: a group added
    for override in config.hydra.overrides.task:
        key, _, value = override.partition("=")
        if value and not key.startswith("~"):
            grid[key.lstrip("+")] = value
    return grid


def sweep_name(grid: dict[str, str]) -> str:
    """Named by what it sweeps: `sweep parallelism.nprocs=1,2 precision=fp32,amp`."""
    named = {k: v for k, v in grid.items() if not k.startswith(UNNAMED_IN_SWEEP)}
    swept = {k: v for k, v in named.items() if "," in v} or named
    return " ".join(["sweep", *(f"{k}={v}" for k, v in swept.items())])


class MlflowSweep(Callback):
    def __init__(self) -> None:
        self.run_id: str | None = None
        self.mlflow_cfg: DictConfig | None = None
        self.environment: dict[str, str] = {}  # what each job's process needs (sweep_environment)
        self.state = outcome.SweepState()  # run_main's, once the sweep starts

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from accelexp import objective
        from accelexp.config.validate import check_sweep_objective
        from accelexp.tracking.life import start_sweep, sweep_environment

        try:
            # user:password@ in the tracking URI: into the environment (the jobs inherit it), out
            # of the overrides the jobs are composed from and of multirun.yaml, written after this
            with read_write(config), open_dict(config):
                overrides = [*config.hydra.overrides.task, config.hydra.job.override_dirname]
                *overrides, dirname = outcome.keep_credentials_out(config.mlflow, overrides)
                config.hydra.overrides.task = overrides
                config.hydra.job.override_dirname = dirname
            optimizes = check_sweep_objective(config)
            if optimizes:
                warnings.filterwarnings("ignore", PLUGIN_DEPRECATIONS, FutureWarning)
            tags = objective.tags(config.objective) if optimizes else {}
            grid = sweep_grid(config)
            name = sweep_name(grid)
            self.run_id = start_sweep(config.mlflow, name, grid, config.hydra.sweep.dir, tags)
            self.environment = sweep_environment(self.run_id, name, grid)
        except Exception as error:
            # Hydra turns a callback's exception into a warning and runs the jobs anyway: without
            # a parent, into a store that may not work, exiting 0. Stop the sweep here instead.
            ours = isinstance(error, AccelexpError)
            log.error("The sweep cannot start: %s", error if ours else traceback.format_exc())
            sys.exit(outcome.EXIT_BAD_INPUT)
        log.info("MLflow parent run %s for this sweep", self.run_id)
        self.mlflow_cfg = config.mlflow
        self.state = outcome.current_sweep_state()
        self.state.started(self)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """The sweep's parent into the job's environment, in the process that runs the job: a
        launcher's worker process (joblib's are started once and reused) has the environment it
        was started with, not the one `start_sweep` set here."""
        os.environ.update(self.environment)

    def abort(self, status: str) -> None:
        """Close the parent run as `status` (on SIGINT/SIGTERM, or an error between jobs, Hydra
        stops without calling `on_multirun_end`)."""
        from accelexp.tracking.life import end_sweep

        try:
            children, failed, link = end_sweep(self.mlflow_cfg, self.run_id, status)
        except Exception as error:
            log.warning("Could not close the sweep's parent run %s: %s", self.run_id, error)
            return
        log.warning("Sweep %s after %d runs (%d failed): %s", status, children, failed, link)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.run_id is None:
            return
        from accelexp.tracking.life import SWEEP_REPORT, end_sweep

        report_dir = Path(config.hydra.sweep.dir) / "report"
        report = None  # the parent run's page when there is no report to open
        try:
            from accelexp.report import write_sweep_report

            write_sweep_report(config.mlflow.tracking_uri, self.run_id, report_dir)
            report = SWEEP_REPORT
        except Exception as error:  # a report problem must not lose the sweep's runs
            log.warning("Could not write the sweep's summary: %s", error)
        results = Path(config.hydra.sweep.dir) / OPTIMIZATION_RESULTS
        if results.is_file():  # the study's best trial(s), as Optuna's sweeper found them
            try:
                from accelexp.tracking.query import log_artifacts

                log_artifacts(config.mlflow.tracking_uri, self.run_id, [results])
            except Exception as error:
                log.warning("Could not log %s on the parent run: %s", results, error)
        self.state.running = None  # closing it here: a signal from now on closes nothing
        try:
            children, failed, link = end_sweep(config.mlflow, self.run_id, artifact=report)
        except Exception as error:  # Hydra would make it a warning and exit 0
            log.error("Could not close the sweep's parent run %s: %s", self.run_id, error)
            self.state.ended(failed=1)  # run.py exits non-zero
            return
        self.state.ended(failed)
        what = "Report" if report else "Parent run"
        log.info("Sweep done: %d runs, %d failed. %s: %s", children, failed, what, link)


class NoPasswords(Callback):
    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        from accelexp.tracking.credentials import redact

        job_return.overrides = [redact(override) for override in job_return.overrides or []]
