"""MLflow, and only MLflow: one run per job, its params, tags, metrics and artifacts.

The engine reports through a few calls (`start`, `log_dataset`, `log_metrics`, `log_artifact`,
`log_model`, `end`), in MLflow's own conventions so the UI's default columns fill: the training
set is a run input (Dataset column), the best model an MLflow model (Models column), metrics are
kept to `METRIC_DIGITS` significant digits, and a sweep's jobs are named by what they vary first.
Only the main process tracks; on other ranks a `Tracker(enabled=False)` does nothing. The store
is checked before any data is loaded, so an unreachable tracking server stops the job at once
instead of after an hour of training. Everything goes through `MlflowClient` (no global active
run; `mlflow.pytorch` is given the run id), so one process can hold several runs, e.g. in tests.

A run (and a sweep's parent) records where its process lives: host, pid namespace, pid and the
process's start time (`where_it_runs`). A process killed without a word (SIGKILL, a reboot, a
store that could not take the run's end) leaves its run RUNNING; the next command on that host
that opens the store (`Tracker.connect`, the report's queries) marks it FAILED with the tag
`accelexp.ended` saying why (`heal_stale_runs`). Runs of other hosts (or containers), and runs
from before the tags, are left.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import platform
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from accelexp import objective, processes, record
from accelexp.errors import AccelexpError
from accelexp.record import FAILED, FINISHED, RUNNING
from accelexp.tracking import credentials

log = logging.getLogger(__name__)

MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value
MAX_PARAMS_PER_BATCH = 100  # MLflow's limit on params in one log_batch call
MAX_METRICS_PER_BATCH = 1000  # MLflow's limit on metrics in one log_batch call
# A sweep's parent run, handed to its jobs (also in worker and launcher subprocesses) by env
PARENT_RUN_ENV = "ACCELEXP_PARENT_RUN_ID"
SWEEP_NAME_ENV = "ACCELEXP_SWEEP_NAME"
SWEPT_KEYS_ENV = "ACCELEXP_SWEPT_KEYS"  # the keys a sweep varies, comma-separated
# swept keys a run's name shows by their value alone: `amp`, not `precision=amp`
SHOWN_BY_VALUE = {"model", "parallelism", "parallelism.sync", "precision"}
RUN_ID_FILE = "mlflow_run_id"  # in a job's output dir once its run exists
# Metrics are stored with this many significant digits, so the UI shows 0.91234 rather than
# 0.9123400449752808: an accuracy on up to 100,000 samples keeps every digit, and the error
# (under 5e-5 of the value) is far below run-to-run noise in throughput and time (~1%).
METRIC_DIGITS = 5
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default
SWEEP_REPORT = "report/report.html"  # the sweep report's artifact on the sweep's parent run
LOCKED_RETRY_S = 120.0  # how long a write waits out a SQLite store locked by other writers
MAX_RUNNING = 1000  # a store's RUNNING runs of one host that one healing looks at


class TrackingUnavailableError(AccelexpError):
    """The MLflow tracking store cannot be reached or opened."""


class StoreFullError(TrackingUnavailableError):
    """The disk of the MLflow store (its database or its artifacts) is full."""


FULL_DISK_TEXTS = ("database or disk is full", "No space left on device")


def disk_full(error: BaseException) -> bool:
    """Whether a full disk is what `error` comes from: ENOSPC, or SQLite's "database or disk is
    full", anywhere in its chain (SQLAlchemy keeps the driver's error as `orig`)."""
    seen: set[int] = set()
    chain: list[BaseException | None] = [error]
    while chain:
        link = chain.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        if isinstance(link, OSError) and link.errno == errno.ENOSPC:
            return True
        if any(text in str(link) for text in FULL_DISK_TEXTS):
            return True
        chain += [link.__cause__, link.__context__, getattr(link, "orig", None)]
    return False


def full_store_message(uri: str, run_id: str | None = None) -> str:
    """What to do when the store's disk is full; a run that began cannot record its end there,
    and the next command on this host marks it FAILED (`heal_stale_runs`)."""
    path = _sqlite_path(uri)
    store = f"{path} ({credentials.redact(uri)})" if path else credentials.redact(uri)
    ended = (
        f" Run {run_id} cannot record its end there: it stays RUNNING until the next run.py or "
        f"accelexp-report on this host marks it FAILED."
        if run_id
        else ""
    )
    return (
        f"The disk of the MLflow store is full: {store}. Free space on that disk, or point "
        f"mlflow.tracking_uri at a store on another one (mlflow.tracking_uri=sqlite:///PATH/"
        f"mlflow.db).{ended}"
    )


class _QuietFullDisk(logging.Filter):
    """Drops MLflow's own multi-line log of a SQL error from a full disk: the error is raised
    to accelexp, which says it once (`StoreFullError`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (
            (exc is not None and disk_full(exc)) or disk_full(Exception(record.getMessage()))
        )


def _quiet_mlflow_full_disk() -> None:
    logger = logging.getLogger("mlflow.store.db.utils")
    if not any(isinstance(f, _QuietFullDisk) for f in logger.filters):
        logger.addFilter(_QuietFullDisk())


def significant(value: float, digits: int = METRIC_DIGITS) -> float:
    """`value` to `digits` significant digits: 0.000123456 -> 0.00012346, never to 0; nan and inf
    stay as they are."""
    return float(f"{float(value):.{digits}g}")


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast with a clear message when the tracking store cannot be used."""
    if uri.startswith(("http://", "https://")):
        health = f"{credentials.split(uri)[0].rstrip('/')}/health"  # basic auth: a header
        request = urllib.request.Request(health, headers=credentials.basic_auth_header(uri))
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                if response.status == 200:
                    return
                problem = f"HTTP {response.status}"
        except (urllib.error.URLError, OSError) as error:
            problem = str(getattr(error, "reason", error))
        raise TrackingUnavailableError(
            f"The MLflow tracking server at {credentials.redact(uri)} is unreachable ({problem}). "
            f"Start it (e.g. "
            f"`mlflow server --host 127.0.0.1 --port 5000 --backend-store-uri "
            f"sqlite:///outputs/mlflow.db`), fix mlflow.tracking_uri, or use the local store: "
            f"mlflow.tracking_uri=sqlite:///outputs/mlflow.db"
        )
    if _database_scheme(uri):
        _check_database(uri, timeout_s)
        return
    path = _sqlite_path(uri)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise TrackingUnavailableError(
                f"Cannot create the folder of the MLflow store {uri}: {error}"
            ) from error


def _database_scheme(uri: str) -> bool:
    """A store MLflow opens with SQLAlchemy on a database server (postgresql, mysql, mssql)."""
    from mlflow.store.db.db_types import DATABASE_ENGINES, SQLITE

    scheme = urllib.parse.urlsplit(uri).scheme.lower().partition("+")[0]
    return scheme in DATABASE_ENGINES and scheme != SQLITE


def _check_database(uri: str, timeout_s: float) -> None:
    """Connect to a database store once, for at most `timeout_s`: MLflow itself retries a
    failed connection for ~100 s (`create_sqlalchemy_engine_with_retry`) before it says why."""
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    errors: list[BaseException | None] = []

    def connect() -> None:
        try:
            engine = sqlalchemy.create_engine(uri, poolclass=NullPool)
            with engine.connect():
                pass
            engine.dispose()
        except Exception as error:  # the driver's, or its absence
            errors.append(error)
        else:
            errors.append(None)

    # a thread, so that no driver's own connect timeout (none by default in libpq) decides
    thread = threading.Thread(target=connect, name="accelexp-store-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if errors == [None]:
        return
    shown = credentials.redact(uri)
    local = "use the local store: mlflow.tracking_uri=sqlite:///outputs/mlflow.db"
    error = errors[0] if errors else None
    if isinstance(error, ImportError):
        raise TrackingUnavailableError(
            f"Cannot open the MLflow store {shown}: its database driver is not installed "
            f"({error}). Install it (PostgreSQL's: pip install -e '.[postgres]') or {local}"
        )
    problem = f"no answer in {timeout_s:g} s" if error is None else _first_line(error)
    raise TrackingUnavailableError(
        f"Cannot connect to the MLflow store {shown} ({problem}). Start the database, fix "
        f"mlflow.tracking_uri, or {local}"
    )


def _first_line(error: BaseException) -> str:
    """The driver's own message of a SQLAlchemy error (MLflow's wraps one), its first line."""
    link: BaseException | None = error
    while link is not None and getattr(link, "orig", None) is None:
        link = link.__cause__
    text = str(getattr(link, "orig", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Hold `<store>.lock` while a SQLite store is opened: one process at a time creates its
    tables and experiments. MLflow migrates a new store's schema on first use; two processes
    doing it at once fail ("table runs already exists") and can leave the store broken. A
    tracking server (http) serialises this itself: no lock."""
    path = _sqlite_path(uri)
    if path is None:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class RetryingClient:
    """An `MlflowClient` whose calls wait out a locked SQLite store.

    SQLite has one writer at a time. With many runs and sweeps writing to one store, a write can
    find the database locked for longer than MLflow's sessions wait (SQLite's busy_timeout, 20 s
    in MLflow 3): such a call is retried with backoff for up to `LOCKED_RETRY_S` before the error
    counts.
    """

    def __init__(self, uri: str) -> None:
        from mlflow import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if not callable(method):
            return method

        def retrying(*args: Any, **kwargs: Any) -> Any:
            delay, deadline = 0.1, time.monotonic() + LOCKED_RETRY_S
            while True:
                try:
                    return method(*args, **kwargs)
                except Exception as error:
                    if "database is locked" not in str(error) or time.monotonic() > deadline:
                        raise
                    log.warning("The MLflow store is locked by another writer: retrying.")
                    time.sleep(delay)
                    delay = min(2 * delay, 2.0)

        return retrying


class Tracker:
    def __init__(self, cfg: DictConfig, enabled: bool = True) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._client = None
        self._system_monitor = None

    # --- set-up --------------------------------------------------------------------------
    def connect(self, heal: bool = True) -> None:
        """Check the store and find or create the experiment (before any training); then, with
        `heal`, fail the experiment's runs of this host whose process is gone
        (`heal_stale_runs`)."""
        if not self.enabled:
            return
        check_reachable(self.cfg.tracking_uri)
        _quiet_mlflow_full_disk()
        path = _sqlite_path(self.cfg.tracking_uri)
        try:
            with store_lock(self.cfg.tracking_uri):  # also: one creator of the experiment
                new = path is not None and not path.exists()
                try:
                    self._client = RetryingClient(self.cfg.tracking_uri)  # migrates a new store
                    experiment = self._client.get_experiment_by_name(self.cfg.experiment)
                except Exception:
                    if new:  # a store half made (a full disk cut its tables short) stays broken
                        path.unlink(missing_ok=True)
                    raise
                if experiment is None:
                    self.experiment_id = self._client.create_experiment(
                        self.cfg.experiment, artifact_location=self._artifact_location()
                    )
                else:
                    self.experiment_id = experiment.experiment_id
        except Exception as error:  # the store exists but cannot be opened or written
            if disk_full(error):
                raise StoreFullError(full_store_message(self.cfg.tracking_uri)) from error
            raise TrackingUnavailableError(
                f"Cannot use the MLflow store {credentials.redact(self.cfg.tracking_uri)}: "
                f"{credentials.redact(_first_line(error))}"
            ) from error
        if heal:
            heal_stale_runs(self._client, [self.experiment_id], "run.py")

    def _artifact_location(self) -> str | None:
        if self.cfg.artifact_location:
            return self.cfg.artifact_location
        path = _sqlite_path(self.cfg.tracking_uri)
        if path is None:
            return None  # a tracking server chooses its own artifact store
        return (path.parent.resolve() / "mlartifacts" / self.cfg.experiment).as_uri()

    def start(self, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Param

        tags = {**tags, **_git_tags(), **_sweep_tags(), **where_it_runs()}
        with self._writing("the new run"):
            run = self._client.create_run(self.experiment_id, run_name=run_name, tags=dict(tags))
        self.run_id = run.info.run_id
        items = [Param(k, str(v)[:MAX_PARAM_VALUE]) for k, v in params.items()]
        with self._writing("the params"):
            for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
                self._client.log_batch(self.run_id, params=items[i : i + MAX_PARAMS_PER_BATCH])
        if self.cfg.log_system_metrics:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._system_monitor = SystemMetricsMonitor(
                self.run_id, sampling_interval=5, tracking_uri=self.cfg.tracking_uri
            )
            self._system_monitor.start()
        log.info("MLflow run %s (%s) in experiment %r", run_name, self.run_id, self.cfg.experiment)

    def resume(self, run_id: str, epoch: int, output_dir: Path) -> None:
        """Continue run `run_id` (RUNNING again): its metrics go on at the next epoch's step.
        It lives in this process now: its place is recorded (and how it ended before is
        dropped) before it is RUNNING again, so no healing takes it for its old process's."""
        if not self.enabled:
            return
        self.run_id = run_id
        self._client.log_batch(run_id, tags=_tag_list(where_it_runs()))
        if record.ENDED in self._client.get_run(run_id).data.tags:
            self._client.delete_tag(run_id, record.ENDED)
        self._client.update_run(run_id, status=RUNNING)
        self._client.set_tag(run_id, record.RESUMED_AFTER_EPOCH, str(epoch))
        self._client.set_tag(run_id, record.OUTPUT_DIR, str(output_dir.resolve()))
        log.info("MLflow run %s continues after epoch %d", run_id, epoch)

    # --- runs to continue (resume) -------------------------------------------------------
    def run_folder(self, run_id: str) -> str | None:
        """The output folder of run `run_id` (its `output_dir` tag), if the run exists."""
        from mlflow.exceptions import MlflowException

        try:
            return self._client.get_run(run_id).data.tags.get(record.OUTPUT_DIR)
        except MlflowException:
            return None

    def run_status(self, run_id: str) -> str | None:
        """Run `run_id`'s status (FINISHED, KILLED, ...), None if this store has no such run."""
        from mlflow.exceptions import MlflowException

        try:
            return self._client.get_run(run_id).info.status
        except MlflowException:
            return None

    def unfinished_run_folders(self, config_hash: str) -> list[str]:
        """Output folders of this experiment's runs of `config_hash` that did not finish (killed,
        failed, or still marked running), newest first."""
        runs = self._client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.{record.CONFIG_HASH} = '{config_hash}' "
            "and attributes.status != 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=50,
        )
        folder = record.OUTPUT_DIR
        return [run.data.tags[folder] for run in runs if folder in run.data.tags]

    def rejected_by_autotune(self, setting: str) -> dict[str, str]:
        """The overrides autotune measured on setting `setting` (`record.SETTING_ID`) on this
        host, in any experiment, and rejected the last time it decided on them: {override: why}."""
        if not self.enabled:
            return {}
        ids = [e.experiment_id for e in self._client.search_experiments()]
        runs = self._client.search_runs(
            ids,
            filter_string=f"tags.`{record.AUTOTUNE_BASE_SETTING}` = '{setting}' "
            f"and tags.{record.HOST} = '{platform.node()}'",
            order_by=["attributes.start_time DESC"],
            max_results=500,
        )
        newest: dict[str, dict[str, str]] = {}
        for run in runs:
            if record.AUTOTUNE_DECISION in run.data.tags:
                newest.setdefault(run.data.tags[record.AUTOTUNE_CANDIDATE], run.data.tags)
        return {
            override: tags.get(record.AUTOTUNE_WHY, "")
            for override, tags in newest.items()
            if tags[record.AUTOTUNE_DECISION] == record.AUTOTUNE_REJECTED
        }

    # --- during the run -------------------------------------------------------------------
    def log_metrics(self, metrics: Mapping[str, float | None], step: int | None = None) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(k, significant(v), now, step or 0) for k, v in metrics.items() if v is not None
        ]
        with self._writing("the metrics"):
            self._client.log_batch(self.run_id, metrics=batch)

    def log_series(self, values: Mapping[str, Mapping[int, float]]) -> None:
        """Metrics with a value per step of their own: {name: {step: value}}."""
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(name, significant(v), now, step)
            for name, series in values.items()
            for step, v in series.items()
        ]
        for start in range(0, len(batch), MAX_METRICS_PER_BATCH):
            with self._writing("the metrics"):
                self._client.log_batch(
                    self.run_id, metrics=batch[start : start + MAX_METRICS_PER_BATCH]
                )

    def log_dataset(
        self, name: str, identity: Mapping[str, Any], source: Path | str, context: str = "training"
    ) -> None:
        """Record the data set as a run input (the UI's Dataset column): its metadata only, no
        copy of the data. `identity` (split sizes, image shape, seeds...) tells two sets of one
        name apart: its hash is the digest. `source` is the folder the set was read from, or
        the name of the code that made or found it."""
        if not self.enabled:
            return
        from mlflow.data.code_dataset_source import CodeDatasetSource
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.data.sources import LocalArtifactDatasetSource
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        text = json.dumps({"name": name, **identity}, sort_keys=True, default=str)
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        if isinstance(source, Path):
            origin = LocalArtifactDatasetSource(source.resolve().as_uri())
        else:
            origin = CodeDatasetSource({"code": source, **{k: str(v) for k, v in identity.items()}})
        dataset = MetaDataset(origin, name=name, digest=digest)._to_mlflow_entity()
        tags = [InputTag(MLFLOW_DATASET_CONTEXT, context)]
        with self._writing(f"the data set {name}"):
            try:
                self._client.log_inputs(self.run_id, datasets=[DatasetInput(dataset, tags)])
            except Exception as error:  # a job beside it made the same set at the same moment
                if "UNIQUE constraint failed: datasets" not in str(error):
                    raise
                self._client.log_inputs(self.run_id, datasets=[DatasetInput(dataset, tags)])

    def log_model(self, model: Any, input_example: Any, name: str = "model") -> None:
        """`model` (a torch module on the CPU) as an MLflow model of this run, for the UI's Models
        column and `mlflow.pytorch.load_model`. MLflow's default format, a graph traced by
        `torch.export` from `input_example` (a batch, a tensor), loads without accelexp installed
        and runs no pickled code. Its requirements are given (torch and cloudpickle at their
        installed versions), so MLflow spends no time inferring them. A model that cannot be
        logged is a warning: the run's results are kept all the same."""
        if not self.enabled:
            return
        import mlflow
        import mlflow.pytorch
        import torch
        from mlflow.models import infer_signature

        with torch.no_grad():
            output = model(input_example)
        # tensor specs (what the export needs), from numpy arrays
        signature = infer_signature(input_example.numpy(), output.numpy())
        # mlflow.pytorch writes through the fluent API's store and experiment (else it puts the
        # model in experiment 0, whose artifacts go to ./mlruns)
        mlflow.set_tracking_uri(self.cfg.tracking_uri)
        mlflow.set_experiment(experiment_id=self.experiment_id)
        try:
            mlflow.pytorch.log_model(
                model,
                name=name,
                run_id=self.run_id,
                signature=signature,
                input_example=input_example.numpy(),
                pip_requirements=mlflow.pytorch.get_default_pip_requirements(),
            )
        except Exception as error:
            log.warning("Could not log the model of run %s to MLflow: %s", self.run_id, error)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if not self.enabled:
            return
        path = Path(path)
        with self._writing(f"the artifact {path.name}"):
            if path.is_dir():
                self._client.log_artifacts(self.run_id, str(path), artifact_path)
            elif path.is_file():
                self._client.log_artifact(self.run_id, str(path), artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if not self.enabled:
            return
        with self._writing("the tags"):
            self._client.log_batch(self.run_id, tags=_tag_list(tags))

    def log_text(self, text: str, artifact_file: str) -> None:
        """`text` as the artifact `artifact_file` (e.g. diagnosis.md) of this run."""
        if not self.enabled:
            return
        with self._writing(f"the artifact {artifact_file}"):
            self._client.log_text(self.run_id, text, artifact_file)

    @contextlib.contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        """A store that stops taking writes mid-run (a full disk, a server gone) is one message."""
        try:
            yield
        except Exception as error:
            if disk_full(error):
                raise StoreFullError(
                    full_store_message(self.cfg.tracking_uri, self.run_id)
                ) from error
            cause = _first_line(error)  # not the SQL
            run = f" of run {self.run_id}" if self.run_id else ""
            raise TrackingUnavailableError(
                f"Could not write {what}{run} to the MLflow store "
                f"{credentials.redact(self.cfg.tracking_uri)}: {cause}. Free space or restart "
                f"the tracking server."
            ) from error

    def end(self, status: str = FINISHED) -> None:
        """Close the run as FINISHED, FAILED or KILLED; what was logged before stays. A store
        that fails here is said in a line: the error that ended the run stays the one raised."""
        if not self.enabled or self.run_id is None:
            return
        try:
            if self._system_monitor is not None:
                self._system_monitor.finish()
            self._client.set_terminated(self.run_id, status=status)
        except Exception as error:
            log.warning(
                "Could not mark MLflow run %s as %s: %s", self.run_id, status, _first_line(error)
            )
            return
        log.info("Run %s: %s", status, self.where_to_look())

    def where_to_look(self) -> str:
        return where_to_look(self.cfg.tracking_uri, self.experiment_id, self.run_id)


def where_to_look(
    uri: str, experiment_id: str, run_id: str, artifact: str | None = None, command: bool = True
) -> str:
    """The link to a run, or to one of its artifacts, in the MLflow UI; for a store without a
    server, also the command that starts the UI (unless `command=False`). Short, never a
    password: `http://127.0.0.1:5000/#/experiments/1/runs/<id> (UI: mlflow ui ...)`."""
    page = f"#/experiments/{experiment_id}/runs/{run_id}"
    if artifact:  # the UI's artifact viewer opens on this file
        page += f"/artifacts/{artifact}"
    if uri.startswith(("http://", "https://")):
        return f"{credentials.split(uri)[0].rstrip('/')}/{page}"
    link = f"{LOCAL_UI}/{page}"
    if not command:
        return link
    return f"{link} (UI: mlflow ui --backend-store-uri {credentials.redact(uri)})"


def run_name(
    cfg: DictConfig,
    speed: str = "eager",
    overrides: Sequence[str] = (),
    parallelism: Mapping[str, str] | None = None,
) -> str:
    """`mlflow.run_name`, or what differs between runs: e.g. resnet18-horovod-np4-amp, and the
    speed switches that are on (`SpeedSwitches.summary()`), e.g. resnet50-single-bf16-tf32+cl.

    In a sweep what the jobs differ in comes first, in short (`np2`, `amp`, `lr=0.2`), then the
    rest of the name: `np2 amp simple_cnn-ddp`. The MLflow UI cuts names at about 15 characters,
    so rows stay told apart; no two jobs of a sweep share a name: repeats start with `r1 `,
    `r2 `... (what differs first, so the cut names still tell repeats apart)."""
    repeat = f"r{cfg.repeat_index + 1} " if cfg.repeats > 1 else ""
    if cfg.mlflow.run_name:
        return repeat + cfg.mlflow.run_name
    parts = _name_parts(cfg, speed, parallelism or {"parallelism": cfg.parallelism.name})
    swept = [k for k in os.environ.get(SWEPT_KEYS_ENV, "").split(",") if k]
    values = {}
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        values[key] = value
    shown = [key for key in swept if key in values]
    rest = "-".join(part for key, part in parts.items() if key not in shown)
    return repeat + " ".join([*(_short(key, values[key]) for key in shown), rest])


def _short(key: str, value: str) -> str:
    """A swept key's value as a run's name shows it: np2, amp, adamw (a group), lr=0.2; a number
    an optimizing sweeper drew to 4 significant digits (lr=0.03756, not 0.03756196144499839)."""
    if key == "parallelism.nprocs":
        return f"np{value}"
    if key in SHOWN_BY_VALUE or "." not in key:
        return value
    with contextlib.suppress(ValueError):
        if "." in value and len(value) > len(f"{float(value):.4g}"):
            value = f"{float(value):.4g}"
    return f"{key.rpartition('.')[2]}={value}"


def _name_parts(cfg: DictConfig, speed: str, parallelism: Mapping[str, str]) -> dict[str, str]:
    """The parts of a derived run name, by the key that sets each; `parallelism` is what the
    strategy says of itself (`accelexp.parallel.run_label`), e.g. hybrid-ddp-np2-s2c1."""
    parts = {"model": cfg.model.name, **parallelism}
    parts["precision"] = cfg.precision.name
    if speed != "eager":
        parts["speed"] = speed
    return parts


def run_tags(cfg: DictConfig, world_size: int, overrides: Sequence[str] = ()) -> dict[str, str]:
    """What a run is, as tags to group and filter by in the MLflow UI and the report; then
    `mlflow.tags`, the user's own (a study's rung, say)."""
    return {
        record.PARALLELISM: cfg.parallelism.name,
        record.PRECISION: cfg.precision.name,
        record.MODEL: cfg.model.name,
        record.DATA: cfg.data.name,
        record.WORLD_SIZE: str(world_size),
        record.REPEAT_INDEX: str(cfg.repeat_index),
        record.REPEATS: str(cfg.repeats),
        record.OVERRIDES: credentials.redact(" ".join(overrides)),
        **objective.tags(cfg.get("objective", objective.DEFAULT)),
        **{str(k): str(v) for k, v in (cfg.mlflow.get("tags") or {}).items()},
    }


def _sweep_tags() -> dict[str, str]:
    parent = os.environ.get(PARENT_RUN_ENV)
    if not parent:
        return {}
    return {record.PARENT_RUN: parent, record.SWEEP: os.environ.get(SWEEP_NAME_ENV, parent)}


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
    tracker = Tracker(cfg.mlflow)
    try:
        tracker.connect(heal=False)  # the job's own run: its failure says why it ended
    except TrackingUnavailableError:
        return None
    id_file = Path(output_dir) / RUN_ID_FILE
    try:
        if id_file.is_file():
            tracker.run_id = id_file.read_text().strip()
        else:
            name = run_name(cfg, overrides=overrides, parallelism=parallelism)
            tracker.start(name, {}, tags or {})
        tracker._client.log_text(tracker.run_id, error, "error.txt")
        tracker._client.set_terminated(tracker.run_id, status=FAILED)
    except Exception as failure:  # the store took the run's data but takes no more
        log.warning("Could not record the failure in MLflow: %s", _first_line(failure))
        return None
    return tracker.run_id


def close_run(
    mlflow_cfg: DictConfig, output_dir: str | Path, status: str, keep: Sequence[str] = (FINISHED,)
) -> None:
    """Close the job's run as `status` unless its status is one of `keep` (FINISHED): the rank
    that tracks it may have been killed before it could close it, or have seen its peers vanish
    first and closed it FAILED. Quietly nothing when the job has no run or no store."""
    id_file = Path(output_dir) / RUN_ID_FILE
    if not id_file.is_file():
        return
    tracker = Tracker(mlflow_cfg)
    try:
        tracker.connect(heal=False)  # the job's own run: `status` says how it ended
        run_id = id_file.read_text().strip()
        if tracker._client.get_run(run_id).info.status not in keep:
            tracker._client.set_terminated(run_id, status=status)
    except Exception as error:  # the store is gone: nothing more can be kept
        run_id = id_file.read_text().strip()
        log.warning("Could not mark run %s as %s: %s", run_id, status, _first_line(error))


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

    tracker = Tracker(mlflow_cfg)
    tracker.connect()
    client = tracker._client
    tags = {
        record.SWEEP_PARENT: "true",
        record.SWEEP_DIR: sweep_dir,
        **(tags or {}),
        **_git_tags(),
        **where_it_runs(),
    }
    run_id = client.create_run(tracker.experiment_id, run_name=name, tags=tags).info.run_id
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
    client = RetryingClient(mlflow_cfg.tracking_uri)
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


def _git_tags() -> dict[str, str]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {record.GIT_COMMIT: commit} if commit else {}


def _tag_list(tags: Mapping[str, Any]) -> list[Any]:
    from mlflow.entities import RunTag

    return [RunTag(k, str(v)) for k, v in tags.items()]


# --- stale runs: a run whose process is gone ---------------------------------------------


def where_it_runs() -> dict[str, str]:
    """This process as a run's tags: its host, its pid and when it started (a later process
    that reuses the pid started later)."""
    pid = os.getpid()
    return {
        record.HOST: platform.node(),
        record.PID: str(pid),
        record.PROCESS_START: f"{processes.started_at(pid):.2f}",
        record.PID_NAMESPACE: processes.pid_namespace(),
    }


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
