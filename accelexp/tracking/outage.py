"""A tracking server that goes away mid-run: what the run logs waits, in order, off the loop.

MLflow's own async logging (`synchronous=False`) does not ride out an outage: each batch goes to
a pool of 10 threads (so batches may land out of order), each call sits in urllib3's retries
(7, backing off to 2 minutes, a console line each), and a batch that still fails is dropped with
an ERROR line (`async_logging_queue._log_run_data`); the error reaches the caller only if it
waits on the returned `RunOperations`. So accelexp keeps its own queue:

- `Writer`: one thread sends a run's writes (metrics, params, tags, texts, artifacts) in the
  order they were made, while training goes on; the loop only hands them over (`put`).
- `Outage`: a call that finds the server gone (refused, reset, timed out, a 5xx) is tried again,
  quietly, until the server answers or `mlflow.outage_budget_s` has passed since it went: one
  warning when it goes, one when it is back, nothing lost. Past the budget, the next call of the
  run raises one `ServerGoneError` naming the server and what to do, and the writes the server
  did not take are kept beside the run's checkpoints (`UNSENT`): the run's resume sends them
  first, so the epochs trained during the outage keep their figures, marking each sent (a
  resume killed meanwhile resends only the rest; the file goes after the last). MLflow's own urllib3
  retries are off in such a process (`quiet_retries`): the budget is the one policy. A server
  that takes connections and never answers (hung, stopped) is found gone when a call times out,
  at most the budget after it started (`bound_request_timeout`), and the outage counts from it.

Only a tracking server (`http(s)://`) is written this way: a SQLite store is a local file,
written in the loop's thread as before.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from accelexp.tracking import credentials
from accelexp.tracking.store import TrackingUnavailableError, error_chain, first_line, writing

log = logging.getLogger(__name__)

RETRIES_ENV = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"  # MLflow's urllib3 retries (7 by default)
TIMEOUT_ENV = "MLFLOW_HTTP_REQUEST_TIMEOUT"  # how long MLflow waits for an answer (120 s)
MLFLOW_TIMEOUT_S = 120
USER_TIMEOUT = os.environ.get(TIMEOUT_ENV)  # the user's own, which accelexp leaves alone
FIRST_WAIT_S, LONGEST_WAIT_S = 0.25, 2.0  # between tries while the server is gone
OUTAGE_BUDGET_S = 300.0  # mlflow.outage_budget_s of a config from before the key
KILLED_FLUSH_S = 10.0  # a run stopped by a signal waits this long at most for its writes
TRANSIENT_HTTP = ("too many 408", "too many 429", "too many 5")  # urllib3's "too many 503 ..."
GONE_TEXTS = (
    "Connection refused",
    "Connection reset",
    "Connection aborted",
    "Failed to establish a new connection",
    "Max retries exceeded",
    "RemoteDisconnected",
    "timed out",
    "timeout exception",
)

UNSENT = "mlflow_unsent.pkl"  # beside the checkpoints: writes a server gone too long did not take
T = TypeVar("T")


class ServerGoneError(TrackingUnavailableError):
    """The tracking server stayed away longer than the run's outage budget."""


def is_server(uri: str) -> bool:
    """A tracking server's URI (http, https), whose outages a run rides out."""
    return uri.startswith(("http://", "https://"))


def quiet_retries() -> None:
    """No urllib3 retries in MLflow's HTTP calls of this process (unless the user set some):
    each failed try is one quiet exception, and `Outage` decides how long to go on trying."""
    os.environ.setdefault(RETRIES_ENV, "0")


def bound_request_timeout(budget_s: float) -> None:
    """MLflow's HTTP calls in this process wait at most `budget_s` for an answer (MLflow's own
    120 s when the budget is longer; the user's `MLFLOW_HTTP_REQUEST_TIMEOUT` if set): a server
    that takes the connection and never answers (hung, stopped) is found gone within the budget."""
    if USER_TIMEOUT is None:
        os.environ[TIMEOUT_ENV] = str(max(1, math.ceil(min(MLFLOW_TIMEOUT_S, budget_s))))


def outage_for(mlflow_cfg: Any) -> Outage | None:
    """The `Outage` of the store `mlflow_cfg` names, when it is a tracking server (its urllib3
    retries off in this process, `quiet_retries`; a call waits at most the budget for an answer,
    `bound_request_timeout`); None for a database or a SQLite file."""
    if not is_server(mlflow_cfg.tracking_uri):
        return None
    quiet_retries()
    budget_s = mlflow_cfg.get("outage_budget_s", OUTAGE_BUDGET_S)
    bound_request_timeout(budget_s)
    return Outage(mlflow_cfg.tracking_uri, budget_s)


def server_gone(error: BaseException) -> bool:
    """Whether `error` says the server did not answer (rather than refused the request): a
    connection refused or reset, a timeout, a 5xx, anywhere in its chain (MLflow wraps the
    requests error in an `MlflowException` of its text)."""
    for link in error_chain(error):
        name = type(link).__name__
        if name in ("ConnectionError", "ConnectTimeout", "ReadTimeout", "RetryError"):
            return True
        text = str(link)
        if any(t in text for t in GONE_TEXTS) or any(t in text for t in TRANSIENT_HTTP):
            return True
    return False


class Outage:
    """One run's server and how long it may be gone (`budget_s`): calls made through `call`, by
    the loop's thread or the writer's, wait it out together, with one warning line when it goes
    and one when it is back."""

    def __init__(self, uri: str, budget_s: float) -> None:
        self.uri, self.budget_s = uri, budget_s
        self.since: float | None = None  # when the server was first found gone
        self.failure: ServerGoneError | None = None  # the budget ran out: the run stops
        self._lock = threading.Lock()

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)`, tried again while the server is gone, within the budget."""
        wait = FIRST_WAIT_S
        while True:
            if self.failure is not None:
                raise self.failure
            started = time.monotonic()
            try:
                result = fn(*args, **kwargs)
            except ServerGoneError:  # a call within this one ran out of the budget
                raise
            except Exception as error:
                if not server_gone(error):
                    raise
                left = self._gone(error, started)
                time.sleep(min(wait, max(left, 0.0)))
                wait = min(2 * wait, LONGEST_WAIT_S)
                continue
            if self.since is not None:
                self._back()
            return result

    def _gone(self, error: BaseException, started: float) -> float:
        """Say the server went (once an outage); raise past the budget; else the time left. The
        outage counts from the start of the call that found it (`started`): a server that never
        answers held that call for a whole request timeout."""
        with self._lock:
            now = time.monotonic()
            if self.since is None:
                self.since = started
                log.warning(
                    "The MLflow tracking server at %s does not answer (%s): training goes on, and "
                    "what the run logs waits here, in order, for up to %g s "
                    "(mlflow.outage_budget_s).",
                    credentials.redact(self.uri), credentials.redact(cause(error)),
                    self.budget_s,
                )  # fmt: skip
            left = self.since + self.budget_s - now
            if left < 0 and self.failure is None:
                self.failure = ServerGoneError(self.message(now - self.since))
            if self.failure is not None:
                raise self.failure from error
            return left

    def _back(self) -> None:
        with self._lock:
            if self.since is None:
                return
            gone_s, self.since = time.monotonic() - self.since, None
        log.warning(
            "The MLflow tracking server at %s answers again after %.0f s: what waited is sent, "
            "in order; nothing is lost.",
            credentials.redact(self.uri), gone_s,
        )  # fmt: skip

    def message(self, gone_s: float) -> str:
        return (
            f"The MLflow tracking server at {credentials.redact(self.uri)} has not answered for "
            f"{gone_s:.0f} s, longer than mlflow.outage_budget_s={self.budget_s:g}: the run stops "
            f"here. What it logged before the server went is kept; its run stays RUNNING until "
            f"the next run.py or accelexp-report on this host marks it FAILED. Start the server "
            f"again (or raise mlflow.outage_budget_s)."
        )


def cause(error: BaseException) -> str:
    """What the failed call met, in a few words: the innermost error's first line."""
    link = error
    while link.__cause__ is not None or link.__context__ is not None:
        link = link.__cause__ or link.__context__
    text = first_line(link)
    return text if len(text) <= 160 else text[:157] + "..."


def _as_data(write: Callable[[], Any]) -> tuple[str, tuple, dict] | None:
    """A write (`partial` of a client's method) as (method name, arguments) to keep in a file;
    None for one that is not such a call."""
    method = getattr(write, "func", None)
    bound = getattr(method, "__wrapped__", method)  # RetryingClient's wraps the client's
    if not isinstance(write, functools.partial) or not hasattr(bound, "__self__"):
        return None
    return method.__name__, write.args, write.keywords


def _read_kept(path: Path) -> tuple[str | None, list]:
    """The writes kept in `path` and the token naming this keeping of them (None: a file of
    before tokens, a plain list)."""
    data = pickle.loads(path.read_bytes())
    return (None, data) if isinstance(data, list) else (data["token"], data["writes"])


def _progress(path: Path) -> Path:
    return path.with_suffix(".sent")


def _sent(path: Path, token: str | None) -> int:
    """How many of the writes kept in `path` (under `token`) a resume has sent already."""
    try:
        said, count = _progress(path).read_text().split()
    except (OSError, ValueError):
        return 0
    return int(count) if said == token else 0


def _replace(path: Path, data: bytes) -> None:
    partial_path = path.with_name(path.name + ".partial")
    partial_path.write_bytes(data)
    partial_path.replace(path)


def keep_unsent(
    path: Path, writes: list[tuple[str, Callable[[], Any]]], taken: str | None = None
) -> int:
    """`writes` (what, write) into `path`, for `take_unsent`, after the writes kept there
    before that were not sent yet (unless they are the ones this writer `taken`: then they are
    among `writes`); the number of `writes` kept."""
    kept = [(what, data) for what, write in writes if (data := _as_data(write)) is not None]
    if not kept:
        return 0
    earlier: list = []
    if path.is_file():
        token, before = _read_kept(path)
        if token is None or token != taken:
            earlier = before[_sent(path, token) :]
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace(path, pickle.dumps({"token": os.urandom(8).hex(), "writes": earlier + kept}))
    _progress(path).unlink(missing_ok=True)
    return len(kept)


class _Sent:
    """A step of the writer's queue after the `count`th write kept in `path` (under `token`):
    it marks them sent, so a process killed while sending them resends only the rest (the one in
    flight at most twice); after the last, the file goes."""

    def __init__(self, path: Path, token: str | None, count: int, last: bool) -> None:
        self.path, self.token, self.count, self.last = path, token, count, last

    def __call__(self) -> None:
        if self.last:
            self.path.unlink(missing_ok=True)
            _progress(self.path).unlink(missing_ok=True)
        else:
            _replace(_progress(self.path), f"{self.token} {self.count}".encode())


def take_unsent(path: Path, client: Any) -> tuple[str | None, list[tuple[str, Callable[[], Any]]]]:
    """The writes `keep_unsent` kept in `path` and not yet sent, as calls of `client`'s methods
    in order, each followed by a step that marks it sent (the file goes after the last), and
    the token of that keeping (for the writer's `keep_unsent`, should the server go again)."""
    if not path.is_file():
        return None, []
    token, kept = _read_kept(path)
    done = _sent(path, token)
    writes: list[tuple[str, Callable[[], Any]]] = []
    for count, (what, (name, args, kwargs)) in enumerate(kept[done:], start=done + 1):
        writes.append((what, functools.partial(getattr(client, name), *args, **kwargs)))
        writes.append(("the kept writes' progress", _Sent(path, token, count, count == len(kept))))
    if done == len(kept):  # all sent, the file not yet gone
        writes.append(("the kept writes' progress", _Sent(path, token, done, last=True)))
    return token, writes


class Writer:
    """A run's writes, sent in order by one thread through `outage` while training goes on.

    `put` hands a write over (or raises the failure that stopped the writer: the run stops at its
    next write, between epochs); `flush` waits until all are sent (the run's end). Writes the
    server did not take before the budget ran out are kept in `unsent` (`keep_unsent`)."""

    def __init__(
        self, outage: Outage, run_id: str | None = None, unsent: Path | None = None
    ) -> None:
        self.outage, self.run_id, self.unsent = outage, run_id, unsent
        self.taken: str | None = None  # the token of the kept writes it sends (`take_unsent`)
        self.failure: BaseException | None = None
        self._queue: collections.deque[tuple[str, Callable[[], Any]]] = collections.deque()
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._send, name="accelexp-mlflow", daemon=True)
        self._thread.start()

    def put(self, what: str, write: Callable[[], Any]) -> None:
        """Send `write` (`what`, e.g. "the metrics", names it in an error) after those before."""
        with self._changed:
            if self.failure is not None:
                raise self.failure
            self._queue.append((what, write))
            self._changed.notify_all()

    def flush(self, limit_s: float | None = None) -> None:
        """Wait until every write is sent (at most `limit_s`); raise the writer's failure."""
        deadline = None if limit_s is None else time.monotonic() + limit_s
        with self._changed:
            while self._queue and self.failure is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._changed.wait(left)
            if self.failure is not None:
                raise self.failure
            if self._queue:
                raise TrackingUnavailableError(
                    f"{len(self._queue)} write(s) of run {self.run_id} could not be sent to the "
                    f"MLflow tracking server at {credentials.redact(self.outage.uri)} in "
                    f"{limit_s:g} s."
                )

    def close(self) -> None:
        """No more writes: the thread ends once it has sent (or given up on) those queued."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _send(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._closed:
                    self._changed.wait()
                if not self._queue:
                    return
                what, write = self._queue[0]
            try:
                with writing(self.outage.uri, what, self.run_id):
                    self.outage.call(write)
            except BaseException as error:  # the run stops at its next write
                with self._changed:
                    self.failure = self._kept(error)
                    self._queue.clear()
                    self._changed.notify_all()
                return
            with self._changed:
                self._queue.popleft()
                self._changed.notify_all()

    def _kept(self, error: BaseException) -> BaseException:
        """`error`, once the writes still queued (the one that failed first) are kept in
        `unsent` for the run's resume: said in its message."""
        if self.unsent is None or not isinstance(error, ServerGoneError):
            return error
        try:
            kept = keep_unsent(self.unsent, list(self._queue), self.taken)
        except OSError as failure:
            log.warning("Could not keep the run's unsent writes in %s: %s", self.unsent, failure)
            return error
        if not kept:
            return error
        said = (
            f"{error} The {kept} write(s) it did not take (metrics of the epochs trained "
            f"meanwhile, tags, artifacts) are kept in {self.unsent}: resume=auto sends them first."
        )
        kept_error = ServerGoneError(said)
        kept_error.__cause__ = error
        return kept_error
