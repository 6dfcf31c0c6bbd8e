"""Reaching the MLflow store: is it there, can it be opened, what its errors mean.

`check_reachable` fails fast, before any data is loaded, with a message that says what to type;
`open_experiment` opens the store (one process at a time creates a SQLite store's tables:
`store_lock`) and finds or creates the experiment; `RetryingClient` waits out a SQLite store
locked by other writers (and, given a tracking server's `Outage`, a server gone for a while:
`accelexp.tracking.outage`); `writing` turns a store that stops taking writes mid-run (a full disk,
a server gone) into one message (`StoreFullError`, `TrackingUnavailableError`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from accelexp.errors import AccelexpError
from accelexp.tracking import credentials

log = logging.getLogger(__name__)

MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value
MAX_PARAMS_PER_BATCH = 100  # MLflow's limit on params in one log_batch call
MAX_METRICS_PER_BATCH = 1000  # MLflow's limit on metrics in one log_batch call
LOCKED_RETRY_S = 120.0  # how long a write waits out a SQLite store locked by other writers


class TrackingUnavailableError(AccelexpError):
    """The MLflow tracking store cannot be reached or opened."""


class StoreFullError(TrackingUnavailableError):
    """The disk of the MLflow store (its database or its artifacts) is full."""


FULL_DISK_TEXTS = ("database or disk is full", "No space left on device")


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """`error` and each error behind it, once: its cause, its context, and the driver's error
    SQLAlchemy keeps as `orig` (MLflow and SQLAlchemy wrap what went wrong)."""
    seen: set[int] = set()
    chain: list[BaseException | None] = [error]
    while chain:
        link = chain.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        yield link
        chain += [link.__cause__, link.__context__, getattr(link, "orig", None)]


def disk_full(error: BaseException) -> bool:
    """Whether a full disk is what `error` comes from: ENOSPC, or SQLite's "database or disk is
    full", anywhere in its chain."""
    return any(
        (isinstance(link, OSError) and link.errno == errno.ENOSPC)
        or any(text in str(link) for text in FULL_DISK_TEXTS)
        for link in error_chain(error)
    )


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
    problem = f"no answer in {timeout_s:g} s" if error is None else first_line(error)
    raise TrackingUnavailableError(
        f"Cannot connect to the MLflow store {shown} ({problem}). Start the database, fix "
        f"mlflow.tracking_uri, or {local}"
    )


def first_line(error: BaseException) -> str:
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

    def __init__(self, uri: str, outage: Any = None) -> None:
        """`outage`: a tracking server's `accelexp.tracking.outage.Outage`, whose calls wait out
        the server's absence (within its budget)."""
        from mlflow import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        self.outage = outage

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if not callable(method):
            return method

        def locked_retrying(*args: Any, **kwargs: Any) -> Any:
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

        def retrying(*args: Any, **kwargs: Any) -> Any:
            if self.outage is None:
                return locked_retrying(*args, **kwargs)
            return self.outage.call(locked_retrying, *args, **kwargs)

        return functools.wraps(method)(retrying)  # the client's method by name (outage.UNSENT)


def open_experiment(mlflow_cfg: DictConfig, outage: Any = None) -> tuple[RetryingClient, str]:
    """Check the store, open it and find or create the experiment `mlflow_cfg.experiment`:
    (a client, the experiment's id; its calls wait out a server gone within `outage`'s budget,
    when given). A store that cannot be opened or written is a `TrackingUnavailableError` (a
    full disk: `StoreFullError`)."""
    uri = mlflow_cfg.tracking_uri
    check_reachable(uri)
    _quiet_mlflow_full_disk()
    path = _sqlite_path(uri)
    try:
        with store_lock(uri):  # also: one creator of the experiment
            new = path is not None and not path.exists()
            try:
                client = RetryingClient(uri, outage)  # migrates a new store
                experiment = client.get_experiment_by_name(mlflow_cfg.experiment)
            except Exception:
                if new:  # a store half made (a full disk cut its tables short) stays broken
                    path.unlink(missing_ok=True)
                raise
            if experiment is None:
                experiment_id = _create_experiment(client, mlflow_cfg)
            else:
                experiment_id = experiment.experiment_id
    except Exception as error:  # the store exists but cannot be opened or written
        if disk_full(error):
            raise StoreFullError(full_store_message(uri)) from error
        raise TrackingUnavailableError(
            f"Cannot use the MLflow store {credentials.redact(uri)}: "
            f"{credentials.redact(first_line(error))}"
        ) from error
    if experiment is not None and not uri.startswith(("http://", "https://")):
        _refuse_served_artifacts(uri, experiment.name, experiment.artifact_location)
    return client, experiment_id


def _refuse_served_artifacts(uri: str, name: str, location: str | None) -> None:
    """An experiment a tracking server made keeps its artifacts behind the server
    (`mlflow-artifacts:/`): a run logging straight to the database could write its params and
    metrics there, then fail at its first artifact. Said before it begins."""
    if not (location or "").startswith("mlflow-artifacts:"):
        return
    raise TrackingUnavailableError(
        f"MLflow experiment {name!r} keeps its artifacts behind its tracking server ({location}), "
        f"which a run logging straight to the store {credentials.redact(uri)} cannot reach. Log "
        f"through the server (mlflow.tracking_uri=http://HOST:5000), or use an experiment of "
        f"your own (mlflow.experiment=NAME mlflow.artifact_location=s3://BUCKET/PATH)."
    )


def _create_experiment(client: RetryingClient, mlflow_cfg: DictConfig) -> str:
    """Create the experiment `mlflow_cfg.experiment`; its id. A database store or a tracking
    server has no `store_lock`: another process that created it meanwhile (two sweeps started at
    once into a new experiment) made it for both, and its id is this one's."""
    from mlflow.exceptions import MlflowException

    try:
        return client.create_experiment(
            mlflow_cfg.experiment, artifact_location=_artifact_location(mlflow_cfg)
        )
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        made = client.get_experiment_by_name(mlflow_cfg.experiment)
        if made is None:
            raise
        return made.experiment_id


def _artifact_location(mlflow_cfg: DictConfig) -> str | None:
    if mlflow_cfg.artifact_location:
        return mlflow_cfg.artifact_location
    path = _sqlite_path(mlflow_cfg.tracking_uri)
    if path is None:
        return None  # a tracking server chooses its own artifact store
    return (path.parent.resolve() / "mlartifacts" / mlflow_cfg.experiment).as_uri()


@contextlib.contextmanager
def writing(uri: str, what: str, run_id: str | None = None) -> Iterator[None]:
    """A store that stops taking writes mid-run (a full disk, a server gone) is one message."""
    try:
        yield
    except AccelexpError:  # said already (a server gone past the run's outage budget)
        raise
    except Exception as error:
        if disk_full(error):
            raise StoreFullError(full_store_message(uri, run_id)) from error
        cause = first_line(error)  # not the SQL
        run = f" of run {run_id}" if run_id else ""
        raise TrackingUnavailableError(
            f"Could not write {what}{run} to the MLflow store {credentials.redact(uri)}: "
            f"{cause}. Free space or restart the tracking server."
        ) from error
