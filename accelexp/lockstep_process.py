"""The process of a lockstep repeat whose jobs share one process (`accelexp.lockstep.together`).

    python -m accelexp.lockstep_process SPEC_DIR      (started by `accelexp.lockstep.jobs`)

Each job of SPEC_DIR/jobs.json is a greenlet of the main thread that trains (`accelexp.train.run`)
through its `SharedProcessGate`; `main`, the hub, waits on the sockets of the jobs waiting for
their turn and resumes the one whose turn came. An exception ends its own job (its run FAILED,
recorded as run.py records it); SIGINT/SIGTERM stops every job where it waits (each run
KILLED) and the process exits 128 + the signal. Each job's exit code goes to SPEC_DIR/ends.json.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import greenlet
from omegaconf import DictConfig, OmegaConf

from accelexp import outcome, signals
from accelexp.errors import AccelexpError, ConfigError
from accelexp.lockstep.together import ENDS, SPEC, SharedProcessGate

log = logging.getLogger(__name__)


@dataclass
class Job:
    number: int
    config: Path  # its resolved config (YAML)
    output_dir: str
    overrides: list[str]
    lockstep: str  # its `LOCKSTEP_ENV` value: the sweep's address, its index, the key
    returncode: int | None = None
    stopped_by: BaseException | None = None  # SIGINT/SIGTERM, as it reached this job

    def run(self, hub: greenlet.greenlet) -> None:
        """Train this job (in its greenlet): its exit code in `returncode`, as its process's."""
        cfg: DictConfig | None = None
        gate = None
        try:
            cfg = OmegaConf.load(self.config)
            assert isinstance(cfg, DictConfig)
            from accelexp.train import run

            gate = SharedProcessGate(self.lockstep, cfg.lockstep.slice_steps, hub)
            run(cfg, self.output_dir, self.overrides, gate=gate)
            self.returncode = outcome.EXIT_OK
        except BaseException as error:
            self.returncode = self._failed(cfg, error)
        finally:
            if gate is not None:
                gate.close()

    def _failed(self, cfg: DictConfig | None, error: BaseException) -> int:
        """As run.py ends a job: a stop KILLED (train closed the run), else FAILED, recorded on
        the job's run (or a new one, when it failed before its run started)."""
        if isinstance(error, KeyboardInterrupt):
            self.stopped_by = error
            stop = signals.interruption(error)
            log.warning("Job %d stopped by %s; its run is KILLED.", self.number, stop.name)
            return outcome.exit_code(stop)
        ours = isinstance(error, AccelexpError)
        log.error("Job %d: %s", self.number, error if ours else traceback.format_exc())
        if cfg is not None:
            from accelexp.parallel import run_label
            from accelexp.tracking.life import record_failure
            from accelexp.tracking.names import run_tags
            from accelexp.tracking.store import StoreFullError

            if not isinstance(error, StoreFullError):
                tags = run_tags(cfg, cfg.parallelism.nprocs, self.overrides)
                label = None if isinstance(error, ConfigError) else run_label(cfg.parallelism)
                tb = "".join(traceback.format_exception(error))
                record_failure(cfg, self.output_dir, tb, tags, self.overrides, label)
        return outcome.EXIT_BAD_INPUT if ours else 1


def main(folder: Path) -> int:
    """Run the jobs of SPEC_DIR `folder` taking turns; the exit code (a job's that failed, or
    128 + the signal that stopped them)."""
    listed = json.loads((folder / SPEC).read_text())
    jobs = [Job(**{**job, "config": Path(job["config"])}) for job in listed]
    hub = greenlet.getcurrent()
    running = {greenlet.greenlet(job.run): job for job in jobs}
    _say_which_job({g: job.number for g, job in running.items()})
    logging.basicConfig(
        level=logging.INFO,
        format="[%(asctime)s][job %(job)s][%(name)s][%(levelname)s] - %(message)s",
    )
    signals.install()
    waiting: dict[Connection, greenlet.greenlet] = {}

    def resume(job: greenlet.greenlet, stop: BaseException | None = None) -> None:
        """Run `job` (or stop it where it waits) until it waits for its next turn, on its
        socket, or ends; a stop that reached it while it ran is raised here, for the others."""
        waits_on = job.throw(type(stop), stop) if stop else job.switch(hub)
        if not job.dead:
            waiting[waits_on] = job
        elif stop is None and running[job].stopped_by is not None:
            raise running[job].stopped_by

    stop: BaseException | None = None
    try:
        for job in running:  # set-up, one job at a time, each up to its first gate
            resume(job)
        while waiting:
            for conn in wait(list(waiting)):
                resume(waiting.pop(conn))  # type: ignore[arg-type]
    except KeyboardInterrupt as error:  # each job closes its run KILLED where it waits
        stop = error
        while waiting:
            resume(waiting.popitem()[1], stop)
    ends = {job.number: 1 if job.returncode is None else job.returncode for job in jobs}
    (folder / ENDS).write_text(json.dumps(ends))
    if stop is not None:
        return outcome.exit_code(signals.interruption(stop))
    return next((code for code in ends.values() if code != 0), outcome.EXIT_OK)


def _say_which_job(numbers: dict[greenlet.greenlet, int]) -> None:
    """Each log record says which job wrote it: the one whose greenlet runs ("-": none)."""
    factory = logging.getLogRecordFactory()

    def record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        made = factory(*args, **kwargs)
        made.job = numbers.get(greenlet.getcurrent(), "-")
        return made

    logging.setLogRecordFactory(record)


if __name__ == "__main__":
    outcome.exit_now(main(Path(sys.argv[1])))
