"""A run's and a sweep's life in MLflow: started, RUNNING again, and closed; the one place a
run's status is set.

A job's run is started here (`start_run`, with where its process lives), taken up again by a
resumed job (`resume_run`) and closed as FINISHED, FAILED or KILLED (`end_run`, which the
`Tracker`'s `end` calls); a job that failed keeps its error on its run, created FAILED if it
never began (`record_failure`); a rank that outlived the one that tracks its run closes it
(`close_run`). A sweep has a parent run, opened before its jobs and handed to them through the
environment (`start_sweep`, `sweep_environment`), closed after them (`end_sweep`).

A process killed without a word (SIGKILL, a reboot, a store that could not take the run's end)
leaves its run RUNNING; the next command on that host that opens the store (`Tracker.connect`,
the report's queries) marks it FAILED with the tag `accelexp.ended` saying why
(`heal_stale_runs`). Runs of other hosts (or containers), and runs from before the tags, are
left.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from accelexp import processes, record
from accelexp.record import FAILED, FINISHED, RUNNING
from accelexp.tracking.names import (
    PARENT_RUN_ENV,
    SWEEP_NAME_ENV,
    SWEPT_KEYS_ENV,
    git_tags,
    run_name,
    sweep_tags,
    tag_list,
    where_it_runs,
    where_to_look,
)
from accelexp.tracking.outage import outage_for
from accelexp.tracking.store import (
    MAX_PARAM_VALUE,
    MAX_PARAMS_PER_BATCH,
    RetryingClient,
    TrackingUnavailableError,
    first_line,
    open_experiment,
    writing,
)

log = logging.getLogger(__name__)

RUN_ID_FILE = "mlflow_run_id"  # in a job's output dir once its run exists
SWEEP_REPORT = "report/report.html"  # the sweep report's artifact on the sweep's parent run
MAX_RUNNING = 1000  # a store's RUNNING runs of one host that one healing looks at


# --- one job's run -----------------------------------------------------------------------


def start_run(
    client: Any, mlflow_cfg: DictConfig, experiment_id: str, name: str, tags: Mapping[str, str]
) -> str:
    """Create run `name` in `experiment_id`, RUNNING, with `tags` and those of the commit, the
    sweep it belongs to and where its process lives; returns its id."""
    tags = {**tags, **git_tags(), **sweep_tags(), **where_it_runs()}
    with writing(mlflow_cfg.tracking_uri, "the new run"):
        run = client.create_run(experiment_id, run_name=name, tags=dict(tags))
    log.info("MLflow run %s (%s) in experiment %r", name, run.info.run_id, mlflow_cfg.experiment)
    return run.info.run_id


def resume_run(client: Any, run_id: str) -> None:
    """Run `run_id` RUNNING again, in this process: its place is recorded (and how it ended
    before is dropped) before it is RUNNING again, so no healing takes it for its old
    process's."""
    client.log_batch(run_id, tags=tag_list(where_it_runs()))
    if record.ENDED in client.get_run(run_id).data.tags:
        client.delete_tag(run_id, record.ENDED)
    client.update_run(run_id, status=RUNNING)


def end_run(client: Any, run_id: str, status: str, link: str, monitor: Any = None) -> None:
    """Close run `run_id` as FINISHED, FAILED or KILLED, after its system-metrics `monitor` (if
    any); what was logged before stays, and `link` (where to look) is said. A store that fails
    here is said in a line: the error that ended the run stays the one raised."""
    try:
        if monitor is not None:
            monitor.finish()
        client.set_terminated(run_id, status=status)
    except Exception as error:
        log.warning("Could not mark MLflow run %s as %s: %s", run_id, status, first_line(error))
        return
    log.info("Run %s: %s", status, link)


def record_failure(
    cfg: DictConfig,
    output_dir: str | Path,
    error: str,
    tags: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
    parallelism: Mapping[str, str] | None = None,
) -> str | None:
    """Keep a job's failure in MLflow: `error.txt` on its run, created FAILED if it never began.

    Returns the run id, or None when the store itself is what failed (nothing can be kept).
    """
    try:  # no healing: the job's own run, whose failure says why it ended
        client, experiment_id = open_experiment(cfg.mlflow, outage_for(cfg.mlflow))
    except TrackingUnavailableError:
        return None
    id_file = Path(output_dir) / RUN_ID_FILE
    try:
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            name = run_name(cfg, overrides=overrides, parallelism=parallelism)
            run_id = start_run(client, cfg.mlflow, experiment_id, name, tags or {})
        client.log_text(run_id, error, "error.txt")
        client.set_terminated(run_id, status=FAILED)
    except Exception as failure:  # the store took the run's data but takes no more
        log.warning("Could not record the failure in MLflow: %s", first_line(failure))
        return None
    return run_id


def close_run(
    mlflow_cfg: DictConfig, output_dir: str | Path, status: str, keep: Sequence[str] = (FINISHED,)
) -> None:
    """Close the job's run as `status` unless its status is one of `keep` (FINISHED): the rank
    that tracks it may have been killed before it could close it, or have seen its peers vanish
    first and closed it FAILED. Quietly nothing when the job has no run or no store."""
    id_file = Path(output_dir) / RUN_ID_FILE
    if not id_file.is_file():
        return
    try:
        client, _ = open_experiment(
            mlflow_cfg, outage_for(mlflow_cfg)
        )  # no healing: `status` says how the job ended
        run_id = id_file.read_text().strip()
        if client.get_run(run_id).info.status not in keep:
            client.set_terminated(run_id, status=status)
    except Exception as error:  # the store is gone: nothing more can be kept
        run_id = id_file.read_text().strip()
        log.warning("Could not mark run %s as %s: %s", run_id, status, first_line(error))


# --- sweeps: one parent run per multirun -------------------------------------------------


def start_sweep(
    mlflow_cfg: DictConfig,
    name: str,
    grid: Mapping[str, str],
    sweep_dir: str,
    tags: Mapping[str, str] | None = None,
) -> str:
    """Open the parent run of a sweep (`tags` added to its own) and hand it to the sweep's jobs
    in this process (`sweep_environment`); returns its run id."""
    from mlflow.entities import Param

    client, experiment_id = open_experiment(mlflow_cfg, outage_for(mlflow_cfg))
    heal_stale_runs(client, [experiment_id], "run.py")
    tags = {
        record.SWEEP_PARENT: "true",
        record.SWEEP_DIR: sweep_dir,
        **(tags or {}),
        **git_tags(),
        **where_it_runs(),
    }
    run_id = client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
    items = [Param(k, str(v)[:MAX_PARAM_VALUE]) for k, v in grid.items()]
    for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[i : i + MAX_PARAMS_PER_BATCH])
    os.environ.update(sweep_environment(run_id, name, grid))
    return run_id


def sweep_environment(run_id: str, name: str, grid: Mapping[str, str]) -> dict[str, str]:
    """What a job's process needs in its environment to make its run a child of the sweep's
    parent `run_id` (and its worker processes, which inherit it)."""
    return {
        PARENT_RUN_ENV: run_id,
        SWEEP_NAME_ENV: name,
        SWEPT_KEYS_ENV: ",".join(k for k, v in grid.items() if "," in v),
    }


def end_sweep(
    mlflow_cfg: DictConfig, run_id: str, status: str | None = None, artifact: str | None = None
) -> tuple[int, int, str]:
    """Close the parent as `status`, or FAILED if any child failed, else FINISHED.
    Returns (children, failed, the link to the parent run in the MLflow UI, or to its
    `artifact`, e.g. `SWEEP_REPORT`; without the UI's command, which each job's end gave)."""
    client = RetryingClient(mlflow_cfg.tracking_uri, outage_for(mlflow_cfg))
    experiment_id = client.get_run(run_id).info.experiment_id
    children = client.search_runs(
        [experiment_id], filter_string=f"tags.{record.PARENT_RUN} = '{run_id}'", max_results=10000
    )
    failed = sum(child.info.status == FAILED for child in children)
    client.set_terminated(run_id, status=status or (FAILED if failed else FINISHED))
    for name in (PARENT_RUN_ENV, SWEEP_NAME_ENV, SWEPT_KEYS_ENV):
        os.environ.pop(name, None)
    link = where_to_look(mlflow_cfg.tracking_uri, experiment_id, run_id, artifact, command=False)
    return len(children), failed, link


# --- stale runs: a run whose process is gone ---------------------------------------------


def heal_stale_runs(client: Any, experiment_ids: Sequence[str], found_by: str) -> int:
    """Mark FAILED the runs of `experiment_ids` this host left RUNNING whose process is gone (no
    such pid, or a pid that started at another time), each with the tag ENDED saying so; one
    search for RUNNING runs, and one line when some were found. Returns how many. A run of
    another host (or of another pid namespace: a container of the same host name), or one
    without the tags (logged before them), is left as it is; a store that fails meanwhile is a
    warning, never the command's failure."""
    host, healed = platform.node(), 0
    try:
        running = client.search_runs(
            list(experiment_ids),
            filter_string=f"attributes.status = '{RUNNING}' and tags.{record.HOST} = '{host}'",
            max_results=MAX_RUNNING,
        )
        for run in running:
            process = _local_process(run.data.tags)
            if process is None or not processes.is_gone(*process):
                continue
            latest = client.get_run(run.info.run_id)  # not resumed by a new process meanwhile
            if latest.info.status != RUNNING or _local_process(latest.data.tags) != process:
                continue
            pid = process[0]
            at = datetime.now(timezone.utc).isoformat(timespec="seconds")
            reason = f"process {pid} on host {host} is gone; found by {found_by} at {at}"
            client.set_tag(run.info.run_id, record.ENDED, reason)
            client.set_terminated(run.info.run_id, status=FAILED)
            healed += 1
    except Exception as error:
        cause = (str(error).strip() or type(error).__name__).splitlines()[0]
        log.warning("Could not look for runs left RUNNING by processes now gone: %s", cause)
    if healed:
        log.warning(
            "Marked %d run(s) FAILED that were left RUNNING by a process now gone (tag %s).",
            healed, record.ENDED,
        )  # fmt: skip
    return healed


def _local_process(tags: Mapping[str, str]) -> tuple[int, float] | None:
    """(pid, start time) of the process a run's tags record, when it counts among this one's
    pids; None when they record none (a run from before the tags) or another namespace's."""
    if tags.get(record.PID_NAMESPACE) != processes.pid_namespace():
        return None
    try:
        return int(tags[record.PID]), float(tags[record.PROCESS_START])
    except (KeyError, ValueError):
        return None
