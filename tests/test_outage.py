"""A tracking server that goes away mid-run (`accelexp.tracking.outage`), for real: a tiny
training through `run.py` logs to a real `mlflow server`, which the test kills (SIGKILL, its whole
process group) as soon as the run's first epoch is checkpointed.

Both cases share one store and one server, built once a session (`built_once`), which first takes
tests/test_credentials.py's run with a password in its URI (one server start for both): gone for
a while (restarted on the same port a second later; its start takes seconds more), the run loses
nothing and waits for none of it; hung past a tiny `mlflow.outage_budget_s` (SIGSTOP: it takes
connections and never answers), the run stops with one message, its checkpoint kept and its run
found by `resume=auto` once the server goes on (SIGCONT).
"""

from __future__ import annotations

import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import TINY_DATA, _answers, built_once, new_store, output_of, run_here
from mlflow import MlflowClient

from accelexp.parallel.world import free_port
from accelexp.tracking.outage import UNSENT

REPO = Path(__file__).resolve().parents[1]
EPOCHS = 10  # ~0.2 s each: the outage spans most of them
GONE = "does not answer"  # the one warning when the server goes ...
BACK = "answers again"  # ... and the one when it is back
TOO_LONG_BUDGET_S = 2


def start_server(store: str, folder: Path, port: int) -> subprocess.Popen:
    """`mlflow server` of `store` on `port`, in a process group of its own (it starts uvicorn as a
    child), once it answers /health."""
    log = open(folder / f"server-{time.monotonic_ns()}.log", "w")  # noqa: SIM115 (its lifetime)
    process = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", store,
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--artifacts-destination", str(folder / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )  # fmt: skip
    deadline = time.monotonic() + 300  # a loaded machine; only to catch a server that never starts
    while not _answers(f"http://127.0.0.1:{port}/health"):
        assert process.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()
        time.sleep(0.2)
    return process


def kill(server: subprocess.Popen) -> None:
    """The server gone at once: SIGKILL to its uvicorn, then to the `mlflow server` that started
    it, each reaped by its parent (so that their CPU time counts as this test's)."""
    import psutil

    if server.poll() is None:
        for child in psutil.Process(server.pid).children(recursive=True):
            child.send_signal(signal.SIGKILL)
        time.sleep(0.2)  # its parent reaps it
        server.send_signal(signal.SIGKILL)
    server.wait(timeout=30)


def hang(server: subprocess.Popen) -> None:
    """The server hung: its process group stopped (SIGSTOP). The kernel still takes connections
    to its port; nothing answers them."""
    os.killpg(server.pid, signal.SIGSTOP)


def tiny_run(url: str, *overrides: str) -> tuple[str, ...]:
    return (
        "data=synthetic", *TINY_DATA, "progress=false", "threads=1", f"epochs={EPOCHS}",
        "max_steps_per_epoch=3", f"mlflow.tracking_uri={url}", *overrides,
    )  # fmt: skip


def when_checkpointed(job: Path, act: Callable[[], object]) -> threading.Thread:
    """A thread that does `act()` once the run in `job` has checkpointed its first epoch (its
    metrics handed to MLflow just before)."""

    def watch() -> None:
        while not (job / "checkpoints" / "last.pt").is_file():
            time.sleep(0.02)
        act()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def outage_runs(folder: Path, template: Path) -> dict:
    """The two cases on one store, one server: gone for a while, then gone for good. Each is
    `python run.py` in this process (`run_here`: a process of its own would cost 4.5 s of CPU
    to start, and prove nothing more here)."""
    store = new_store(folder / "store", template)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    servers = [start_server(store, folder, port)]
    times: list[float] = []

    def kill_and_restart() -> None:
        kill(servers[0])
        times.append(time.monotonic())
        time.sleep(1.0)
        servers.append(start_server(store, folder, port))
        times.append(time.monotonic())

    try:
        # first, test_credentials's run with a password in the URI (one server start for both)
        from test_credentials import run_with_a_password

        password = run_with_a_password(url, folder / "password")
        watcher = when_checkpointed(folder / "within" / "job", kill_and_restart)
        within = run_here(None, *tiny_run(url), tmp_path=folder / "within")
        watcher.join(timeout=600)
        watcher = when_checkpointed(folder / "too_long" / "job", lambda: hang(servers[-1]))
        budget = f"mlflow.outage_budget_s={TOO_LONG_BUDGET_S}"
        too_long = run_here(None, *tiny_run(url, budget), tmp_path=folder / "too_long")
        watcher.join(timeout=600)
        unsent = (folder / "too_long" / "job" / "checkpoints" / UNSENT).is_file()
        os.killpg(servers[-1].pid, signal.SIGCONT)  # back: the run is resumed
        resumed = run_here(
            None, *tiny_run(url, budget, "resume=auto"), tmp_path=folder / "too_long"
        )
    finally:
        for server in servers:
            kill(server)
    return {
        "store": store,
        "url": url,
        "password": password,
        "within": [within.returncode, output_of(within)],
        "outage_s": times[1] - times[0],
        "too_long": [too_long.returncode, output_of(too_long)],
        "unsent_kept": unsent,
        "resumed": [resumed.returncode, output_of(resumed)],
    }


@pytest.fixture
def outage(tmp_path_factory, mlflow_template_db) -> tuple[Path, dict]:
    return built_once(tmp_path_factory, "outage", lambda f: outage_runs(f, mlflow_template_db))


def runs_by_folder(store: str) -> dict[str, object]:
    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("accelexp")
    runs = client.search_runs([experiment.experiment_id])
    return {Path(run.data.tags["output_dir"]).parent.name: run for run in runs}


def steps_as_stored(store: str, run_id: str) -> list[int]:
    """The steps of a run's `train_loss` points in the order the store took them."""
    with sqlite3.connect(store.removeprefix("sqlite:///")) as db:
        rows = db.execute(
            "SELECT step FROM metrics WHERE run_uuid = ? AND key = 'train_loss' ORDER BY rowid",
            (run_id,),
        )
        return [step for (step,) in rows]


def test_a_server_gone_for_a_while_costs_the_run_no_time_and_no_data(outage):
    """Killed after epoch 1 and back seconds later: the run goes on training meanwhile (no
    epoch's wall time, `elapsed_s` from one epoch to the next, takes in the outage), says so in
    one line when the server goes and one when it is back (no urllib3 retry lines), and every
    metric point arrives, in the order the epochs logged them, before the run ends FINISHED."""
    _, built = outage
    code, said = built["within"]
    assert code == 0, said
    assert said.count(GONE) == 1 and said.count(BACK) == 1, said
    assert "Retrying" not in said and "Failed to log" not in said, said
    run = runs_by_folder(built["store"])["within"]
    assert run.info.status == "FINISHED"
    client = MlflowClient(tracking_uri=built["store"])
    elapsed = sorted(client.get_metric_history(run.info.run_id, "elapsed_s"), key=lambda m: m.step)
    assert sorted(m.step for m in elapsed) == list(range(1, EPOCHS + 1))
    assert "test_acc" in run.data.metrics  # the run's end, logged after its last epoch
    # sent in order: the store took each metric's points in the order of their steps
    assert steps_as_stored(built["store"], run.info.run_id) == list(range(1, EPOCHS + 1))
    # no epoch waited for the server: each epoch's wall time (train, evaluate, log, checkpoint)
    # is a small fraction of the outage; waiting on the server, one would hold most of it
    walls = [b.value - a.value for a, b in itertools.pairwise(elapsed)]
    assert max(walls) < 0.25 * built["outage_s"], (walls, built["outage_s"])


def test_a_server_gone_past_the_budget_stops_the_run_with_one_message_and_its_checkpoint(
    outage,
):
    """Hung after epoch 1 (it takes connections, never answers), with mlflow.outage_budget_s=2:
    one warning when it goes (a call timed out after the budget, not MLflow's 120 s), then one
    message naming the server, the budget and what to do (resume=auto, the checkpoint), exit 2;
    the checkpoint is kept, and the run, left RUNNING (its store could not be told; the next
    command on this host marks it FAILED once its process is gone, as test_stale_runs proves),
    is the unfinished run `resume=auto` takes."""

    folder, built = outage
    code, said = built["too_long"]
    assert code == 2, said
    url = said.split(GONE)[0].rsplit("server at ", 1)[1].strip()
    assert said.count(GONE) == 1 and BACK not in said, said
    assert said.split(GONE)[1].startswith(" (timed out)"), said  # hung, not refused
    errors = [line for line in said.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1, said
    assert f"tracking server at {url} has not answered" in errors[0]
    assert f"mlflow.outage_budget_s={TOO_LONG_BUDGET_S}" in errors[0]
    last = folder / "too_long" / "job" / "checkpoints" / "last.pt"
    assert (
        f"continue from the last checkpoint ({last}) with the same command and resume=auto"
        in (errors[0])
    )
    assert "Traceback" not in said and "Retrying" not in said, said
    assert last.is_file()
    # what resume=auto takes (`Tracker.unfinished_run_folders`: not FINISHED, its folder named)
    run = runs_by_folder(built["store"])["too_long"]
    assert run.data.tags["output_dir"] == str(last.parents[1])
    # the epochs trained while the server was gone kept their writes beside the checkpoint ...
    assert built["unsent_kept"] and f"kept in {last.parent / UNSENT}" in errors[0]
    # ... which the run's resume, the server back, sent first: every epoch's point, in order
    code, said = built["resumed"]
    assert code == 0, said
    assert run.info.status == "FINISHED", "resumed to its end"
    assert steps_as_stored(built["store"], run.info.run_id) == list(range(1, EPOCHS + 1))
    assert not (last.parent / UNSENT).exists()


def test_a_negative_outage_budget_is_refused(compose_cfg):
    from accelexp.config import ConfigError, validate

    with pytest.raises(ConfigError, match=r"mlflow.outage_budget_s=-1.*expected a number >= 0"):
        validate(compose_cfg("mlflow.outage_budget_s=-1"))


def test_an_outage_counts_from_the_start_of_the_call_that_found_it():
    """A server that never answers holds a call for its whole timeout: past the budget already
    when it times out, the run stops then, without a second call waiting as long."""
    from requests.exceptions import ReadTimeout

    from accelexp.tracking.outage import Outage, ServerGoneError

    calls = []

    def hung() -> None:
        calls.append(time.monotonic())
        time.sleep(0.3)
        raise ReadTimeout("Read timed out. (read timeout=0.3)")

    with pytest.raises(ServerGoneError, match=r"longer than mlflow\.outage_budget_s=0\.2"):
        Outage("http://127.0.0.1:1", budget_s=0.2).call(hung)
    assert len(calls) == 1


def test_kept_writes_stay_kept_until_sent_and_are_sent_once(tmp_path):
    """A resume that is killed while it sends the writes a server did not take resends only
    those it had not sent; a writer that meets the server gone again keeps the rest once,
    with its own writes after them; the file goes when the last is sent."""
    import functools

    from accelexp.tracking.outage import keep_unsent, take_unsent

    class Client:  # a tracking client's method: what the file keeps is its name and arguments
        def __init__(self) -> None:
            self.got: list[int] = []

        def log(self, value: int) -> None:
            self.got.append(value)

    path = tmp_path / UNSENT
    written = Client()
    assert keep_unsent(path, [("a point", functools.partial(written.log, v)) for v in (1, 2, 3)])
    client = Client()
    _, steps = take_unsent(path, client)
    for _, step in steps[:3]:  # the first point and its mark, then the second: killed
        step()
    taken, steps = take_unsent(path, client)  # the next resume
    assert len(steps) == 4  # points 2 and 3, each with its mark
    steps[0][1]()  # point 2 sent again (it was in flight); then the server goes ...
    queue = [*steps[1:], ("a new point", functools.partial(client.log, 4))]
    assert keep_unsent(path, queue, taken) == 2  # point 3 and the new one, not twice
    _, steps = take_unsent(path, client)
    for _, step in steps:
        step()
    assert client.got == [1, 2, 2, 3, 4]
    assert not path.exists() and not path.with_suffix(".sent").exists()
