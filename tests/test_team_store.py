"""A team's tracking store as docs/tracking.md sets it up: a real `mlflow server` on a real
PostgreSQL database (`postgresql+psycopg://user:password@...`), and runs logging straight to it.

One launch, once a test session whichever xdist workers ask (`conftest.built_once`), which the
tests read: a throwaway cluster (tests/postgres.py: initdb, password authentication) under a
server; a `run.py -m` process sweeps into a new experiment through the server while this process
sweeps straight into the database, the password in `mlflow.tracking_uri`, into an experiment
where a SIGKILLed process left its run RUNNING; then clients open a new experiment at once, and
a run straight to the database asks for an experiment the server made.
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
from conftest import REPO, TINY_DATA, TINY_RUN, built_once, output_of, run_here, served
from mlflow import MlflowClient
from omegaconf import OmegaConf
from postgres import cluster
from test_credentials import SECRET, files_with_secret, secret_uri

from accelexp import processes, record
from accelexp.tracking.store import TrackingUnavailableError, open_experiment

TINY = ("data=synthetic", *TINY_DATA, *TINY_RUN)
THROUGH_SERVER, STRAIGHT = ("precision.name", "fp32,bf16"), ("seed", "1,2")  # (param, values)
AT_ONCE = 6  # clients opening one new experiment at once


def killed_process() -> tuple[int, float]:
    """(pid, start time) of a process that was SIGKILLed (and waited for)."""
    child = subprocess.Popen(["sleep", "60"])
    started = psutil.Process(child.pid).create_time()
    child.send_signal(signal.SIGKILL)
    child.wait()
    return child.pid, started


def left_running(client: MlflowClient, experiment_id: str, name: str, pid: int, started: float):
    """A run RUNNING, as process `pid` of this host (started at `started`) leaves it."""
    place = {
        record.HOST: platform.node(),
        record.PID: str(pid),
        record.PROCESS_START: f"{started:.2f}",
        record.PID_NAMESPACE: processes.pid_namespace(),
    }
    return client.create_run(experiment_id, run_name=name, tags=place).info.run_id


def opened_at_once(uri: str, experiment: str) -> list[str]:
    """What `AT_ONCE` clients that open the new `experiment` together get: its id, or their
    error."""
    mlflow_cfg = OmegaConf.create(
        {"tracking_uri": uri, "experiment": experiment, "artifact_location": None}
    )
    ready, opened = threading.Barrier(AT_ONCE), []

    def open_it() -> None:
        ready.wait()
        try:
            opened.append(open_experiment(mlflow_cfg)[1])
        except Exception as error:
            opened.append(repr(error))

    clients = [threading.Thread(target=open_it) for _ in range(AT_ONCE)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    return opened


def refused(mlflow_cfg: dict) -> str:
    try:
        open_experiment(OmegaConf.create(mlflow_cfg))
    except TrackingUnavailableError as error:
        return str(error)
    return "not refused"


def runs(client: MlflowClient, experiment: str) -> list[dict]:
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return [
        {"id": r.info.run_id, "name": r.info.run_name, "status": r.info.status,
         "params": r.data.params, "tags": r.data.tags}
        for r in found
    ]  # fmt: skip


def launch_team(tmp: Path) -> dict:
    """The launch (see the module's docstring); what the tests read of it."""
    with cluster("alice", SECRET) as database, served(database.uri(), tmp / "server") as base:
        client = MlflowClient(base)  # the server has migrated the database
        direct = client.create_experiment("direct", (tmp / "direct-artifacts").as_uri())
        before = {
            "killed": left_running(client, direct, "killed", *killed_process()),
            "alive": left_running(client, direct, "alive", os.getpid(),
                                  psutil.Process().create_time()),
        }  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "MLFLOW_"))}
        through_server = subprocess.Popen(
            [sys.executable, "run.py", "-m", *TINY, f"precision={THROUGH_SERVER[1]}",
             f"mlflow.tracking_uri={secret_uri(base)}", "mlflow.experiment=team",
             f"hydra.sweep.dir={tmp / 'team'}"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        straight = run_here(None, "-m", *TINY, f"seed={STRAIGHT[1]}",
                            f"mlflow.tracking_uri={database.uri()}", "mlflow.experiment=direct",
                            f"hydra.sweep.dir={tmp / 'direct'}")  # fmt: skip
        said = through_server.communicate(timeout=600)[0]
        races = {f"race {n}": opened_at_once(base, f"race {n}") for n in range(3)}
        return {
            "port": database.port,
            "base": base,
            "ended": {
                "team": [through_server.returncode, said],
                "direct": [straight.returncode, output_of(straight)],
            },
            "before": before,
            "runs": {name: runs(client, name) for name in ("team", "direct")},
            "races": {name: [opened, client.get_experiment_by_name(name).experiment_id]
                      for name, opened in races.items()},
            "refused": refused({"tracking_uri": database.uri(), "experiment": "team",
                                "artifact_location": None}),
        }  # fmt: skip


@pytest.fixture(scope="module")
def team(tmp_path_factory) -> tuple[Path, dict]:
    return built_once(tmp_path_factory, "team-store", launch_team)


@pytest.mark.parametrize(
    "experiment, swept",
    [("team", THROUGH_SERVER), ("direct", STRAIGHT)],
    ids=["server", "straight"],
)
def test_two_sweeps_at_once_log_every_job_under_its_parent(team, experiment, swept):
    """One through the server, one straight to the database, at the same time."""
    found = team[1]
    code, said = found["ended"][experiment]
    assert code == 0, said
    made = [r for r in found["runs"][experiment] if r["id"] not in found["before"].values()]
    (parent,) = [r for r in made if r["tags"].get(record.SWEEP_PARENT) == "true"]
    key, values = swept
    assert parent["name"] == f"sweep {key.partition('.')[0]}={values}"
    children = [r for r in made if r["tags"].get(record.PARENT_RUN) == parent["id"]]
    assert len(children) == len(made) - 1
    assert sorted(child["params"][key] for child in children) == sorted(values.split(","))
    assert [r["status"] for r in (parent, *children)] == ["FINISHED"] * 3


def test_clients_opening_a_new_experiment_at_once_all_get_it(team):
    """Two sweeps started together into a new experiment: each finds it missing and creates it,
    and the database refuses the second (a unique name) — which takes the one made."""
    for name, (opened, made) in team[1]["races"].items():
        assert opened == [made] * AT_ONCE, name


def test_a_run_left_running_by_a_killed_process_is_healed_by_the_next_sweep(team):
    found = team[1]
    assert found["ended"]["direct"][0] == 0, found["ended"]["direct"][1]
    runs_by_id = {r["id"]: r for r in found["runs"]["direct"]}
    killed, alive = (runs_by_id[found["before"][name]] for name in ("killed", "alive"))
    assert (killed["status"], alive["status"]) == ("FAILED", "RUNNING")
    pid = killed["tags"][record.PID]
    assert killed["tags"][record.ENDED].startswith(f"process {pid} on host {platform.node()} "
                                                   f"is gone; found by run.py at ")  # fmt: skip
    assert record.ENDED not in alive["tags"]


def test_a_sweep_straight_to_the_database_keeps_its_password_nowhere(team):
    tmp, found = team
    code, said = found["ended"]["direct"]
    assert code == 0, said
    made = [r for r in found["runs"]["direct"] if r["id"] not in found["before"].values()]
    assert len(made) == 3  # the parent, 2 jobs
    clean = f"postgresql+psycopg://127.0.0.1:{found['port']}/mlflow"  # the user in PGUSER
    for run in made:
        assert not [v for v in (*run["params"].values(), *run["tags"].values()) if SECRET in v]
        if record.PARENT_RUN in run["tags"]:
            assert run["params"]["mlflow.tracking_uri"] == clean
    assert (tmp / "direct" / "multirun.yaml").is_file()
    assert SECRET not in said
    assert files_with_secret(tmp / "direct", tmp / "direct-artifacts") == []


def test_a_sweep_through_the_server_with_a_password_in_the_uri_keeps_it_nowhere(team):
    """`http://alice:<password>@host` (the server ignores basic auth, which is all this needs):
    the sweep's process works, and the password is in none of what it printed, the runs the
    server recorded (params, tags), the sweep's folder or the server's artifacts. (That the
    credentials are sent is test_credentials's; the password of a database store, the next
    test's.)"""
    tmp, found = team
    code, said = found["ended"]["team"]
    assert code == 0, said
    assert SECRET not in said
    made = found["runs"]["team"]
    assert len(made) == 3 and {r["status"] for r in made} == {"FINISHED"}  # the parent, 2 jobs
    for run in made:
        assert not [v for v in (*run["params"].values(), *run["tags"].values()) if SECRET in v]
        if record.PARENT_RUN in run["tags"]:  # a job: the URI it was given, without the password
            assert run["params"]["mlflow.tracking_uri"] == found["base"]
    assert (tmp / "team" / "multirun.yaml").is_file()
    assert files_with_secret(tmp / "team", tmp / "server" / "artifacts") == []


def test_a_run_straight_to_the_database_into_an_experiment_the_server_made_is_refused(team):
    """Its artifacts are behind the server (mlflow-artifacts:/): said before the run begins,
    not at its first artifact, after its params and metrics."""
    said = team[1]["refused"]
    assert "'team' keeps its artifacts behind its tracking server (mlflow-artifacts:/" in said
    assert "mlflow.tracking_uri=http://HOST:5000" in said and SECRET not in said
