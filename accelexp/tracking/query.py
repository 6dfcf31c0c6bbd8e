"""Reading runs back from MLflow (and logging a report's files): what `accelexp.report` needs.

Every function takes the tracking URI and opens its own `MlflowClient`; what comes back is plain
data (`RunRecord`, lists of `(step, value)`), so the report never sees an MLflow object. Problems
the user can fix (an unknown experiment or run, an empty selection, a missing store) are raised as
`QueryError`s whose message says what exists or what to type instead.

Selecting an experiment's or a sweep's runs first fails that experiment's runs this host left
RUNNING whose process is gone (`accelexp.tracking.life.heal_stale_runs`), so the report shows them
as they ended; a run still RUNNING is one whose process lives, or one of another host.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelexp.errors import AccelexpError
from accelexp.record import (
    COMPARE,
    COMPARE_LOCKSTEP,
    ELAPSED_S,
    LOCKSTEP_CONTENDED,
    LOCKSTEP_INCARNATION,
    LOCKSTEP_SAMPLES_PER_S,
    PARENT_RUN,
    PEAK_MEM_MB,
    SAMPLES_PER_S,
    SWEEP_PARENT,
    VAL_ACC,
)
from accelexp.tracking.life import heal_stale_runs
from accelexp.tracking.store import check_reachable, store_lock

HISTORY_KEYS = (SAMPLES_PER_S, VAL_ACC, ELAPSED_S, PEAK_MEM_MB)  # the report reads each epoch's
LOCKSTEP_HISTORY_KEYS = (LOCKSTEP_SAMPLES_PER_S, LOCKSTEP_CONTENDED, LOCKSTEP_INCARNATION)
PAGE_SIZE = 1000  # runs or experiments per search request
HEALER = "accelexp-report"  # what a stale run's tag says found its process gone


class QueryError(AccelexpError):
    """The runs asked for cannot be read back."""


class UnknownExperimentError(QueryError):
    """No experiment of that name in the store."""


class UnknownRunError(QueryError):
    """No run of that id in the store."""


class NoRunsError(QueryError):
    """The selection (an experiment, a sweep) holds no runs."""


@dataclass
class RunRecord:
    """One MLflow run as plain data: who it is, what it was, what it measured."""

    run_id: str
    name: str
    status: str
    experiment_id: str = ""
    start_time: int = 0  # ms since the epoch
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # the last value of each metric
    histories: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def setting(self, key: str) -> str | None:
        """A configuration value: the tag `key`, else the param `key` or `key.name`."""
        for value in (self.tags.get(key), self.params.get(key), self.params.get(f"{key}.name")):
            if value not in (None, ""):
                return value
        return None

    def history(self, key: str) -> list[tuple[int, float]]:
        return self.histories.get(key, [])


# --- the client -------------------------------------------------------------------------------
def _client(uri: str) -> Any:
    """A client on an existing store; a missing SQLite file is an error, not a new store."""
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///"))
        if not path.is_file():
            raise QueryError(
                f"No MLflow store at {path} (tracking URI {uri}). Run a job first "
                f"(`python run.py`) or pass --tracking-uri with the store the runs went to."
            )
    else:  # a server or a database: one that does not answer is said in seconds
        check_reachable(uri)
    from mlflow import MlflowClient

    with store_lock(uri):  # not while a run is creating the store's tables
        return MlflowClient(tracking_uri=uri)


@contextlib.contextmanager
def _mlflow_errors(uri: str) -> Iterator[None]:
    """Turn MLflow's exceptions into a one-line `QueryError` naming the store."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as error:
        raise QueryError(f"MLflow store {uri}: {error.message}") from error


def _search_runs(client: Any, experiment_ids: list[str], filter_string: str = "") -> list[Any]:
    """Every active run matching `filter_string`, newest first, over all result pages."""
    runs: list[Any] = []
    token = None
    while True:
        page = client.search_runs(
            experiment_ids,
            filter_string=filter_string,
            max_results=PAGE_SIZE,
            order_by=["attributes.start_time DESC"],
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _experiments(client: Any) -> list[Any]:
    experiments: list[Any] = []
    token = None
    while True:
        page = client.search_experiments(max_results=PAGE_SIZE, page_token=token)
        experiments.extend(page)
        token = page.token
        if not token:
            return experiments


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) sorted by step; of several values at one step, the last one logged."""
    by_step: dict[int, tuple[int, float]] = {}
    for metric in client.get_metric_history(run_id, key):
        seen = by_step.get(metric.step)
        if seen is None or metric.timestamp >= seen[0]:
            by_step[metric.step] = (metric.timestamp, metric.value)
    return [(step, value) for step, (_, value) in sorted(by_step.items())]


def _record(client: Any, run: Any, histories: bool = True) -> RunRecord:
    info, data = run.info, run.data
    return RunRecord(
        run_id=info.run_id,
        name=info.run_name or info.run_id,
        status=info.status,
        experiment_id=info.experiment_id,
        start_time=info.start_time or 0,
        tags=dict(data.tags),
        params=dict(data.params),
        metrics=dict(data.metrics),
        histories=(
            {key: _history(client, info.run_id, key) for key in _history_keys(data.tags)}
            if histories
            else {}
        ),
    )


def _history_keys(tags: dict[str, str]) -> tuple[str, ...]:
    """The histories the report reads: each epoch's figures, and a lockstep run's slices."""
    if tags.get(COMPARE) == COMPARE_LOCKSTEP:
        return (*HISTORY_KEYS, *LOCKSTEP_HISTORY_KEYS)
    return HISTORY_KEYS


def _is_sweep_parent(run: Any) -> bool:
    return run.data.tags.get(SWEEP_PARENT) == "true"


# --- what the report asks -----------------------------------------------------------------------
def experiment_names(uri: str) -> list[str]:
    """The names of the store's active experiments, sorted."""
    client = _client(uri)
    with _mlflow_errors(uri):
        return sorted(e.name for e in _experiments(client))


def experiment_id(uri: str, name: str) -> str:
    """The id of the experiment `name`; an unknown name lists the ones that exist."""
    client = _client(uri)
    with _mlflow_errors(uri):
        experiment = client.get_experiment_by_name(name)
        if experiment is not None and experiment.lifecycle_stage == "active":
            return experiment.experiment_id
        existing = sorted(e.name for e in _experiments(client))
    known = ", ".join(existing) if existing else "none yet"
    state = "is deleted" if experiment is not None else "does not exist"
    raise UnknownExperimentError(
        f"MLflow experiment {name!r} {state} in {uri}. Existing experiments: {known}."
    )


def run_record(uri: str, run_id: str, histories: bool = False) -> RunRecord:
    """One run by id (its metric histories only when asked)."""
    client = _client(uri)
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as error:
        raise UnknownRunError(
            f"No MLflow run with id {run_id!r} in {uri}. Use `--sweep latest` or copy a sweep's "
            f"run id from the MLflow UI."
        ) from error
    with _mlflow_errors(uri):
        return _record(client, run, histories)


def latest_sweep(uri: str, experiment: str | None = None) -> RunRecord:
    """The newest sweep parent run (tag accelexp.sweep=true), in `experiment` or in any."""
    client = _client(uri)
    ids = [experiment_id(uri, experiment)] if experiment is not None else None
    with _mlflow_errors(uri):
        if ids is None:
            ids = [e.experiment_id for e in _experiments(client)]
        parents = (
            client.search_runs(
                ids,
                filter_string=f"tags.`{SWEEP_PARENT}` = 'true'",
                max_results=1,
                order_by=["attributes.start_time DESC"],
            )
            if ids
            else []
        )
        if parents:
            return _record(client, parents[0], histories=False)
    where = f"experiment {experiment!r}" if experiment is not None else uri
    raise NoRunsError(
        f"No sweep in {where}. Run one with `python run.py -m ...`, or use --experiment NAME."
    )


def child_runs(uri: str, parent_run_id: str) -> list[RunRecord]:
    """The runs of a sweep (children of `parent_run_id`), newest first, with histories."""
    parent = run_record(uri, parent_run_id)
    client = _client(uri)
    heal_stale_runs(client, [parent.experiment_id], HEALER)
    with _mlflow_errors(uri):
        runs = _search_runs(
            client, [parent.experiment_id], f"tags.{PARENT_RUN} = '{parent_run_id}'"
        )
        return [_record(client, run) for run in runs]


def experiment_runs(uri: str, experiment_id: str) -> list[RunRecord]:
    """Every run of an experiment except sweep parents, newest first, with histories."""
    client = _client(uri)
    heal_stale_runs(client, [experiment_id], HEALER)
    with _mlflow_errors(uri):
        runs = _search_runs(client, [experiment_id])
        return [_record(client, run) for run in runs if not _is_sweep_parent(run)]


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """A metric's values as (step, value), sorted by step."""
    client = _client(uri)
    with _mlflow_errors(uri):
        return _history(client, run_id, key)


def log_artifacts(
    uri: str, run_id: str, paths: Iterable[str | os.PathLike], artifact_path: str | None = None
) -> None:
    """Log files (and folders, with their contents) as artifacts of `run_id`."""
    client = _client(uri)
    with _mlflow_errors(uri):
        for path in map(Path, paths):
            if path.is_dir():
                client.log_artifacts(run_id, str(path), artifact_path)
            elif path.is_file():
                client.log_artifact(run_id, str(path), artifact_path)


def set_tags(uri: str, run_id: str, tags: Mapping[str, str]) -> None:
    """Set `tags` on run `run_id` (after it ended: what a sweep decided of it)."""
    from mlflow.entities import RunTag

    client = _client(uri)
    with _mlflow_errors(uri):
        client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
