"""A team's tracking store as docs/tracking.md sets it up: a real `mlflow server` on a real
PostgreSQL database (`postgresql+psycopg://user:password@...`), and runs logging straight to it.

One throwaway cluster (tests/postgres.py: initdb, password authentication) and one server on it
for the module, and one launch the tests read: a `run.py -m` process sweeps into a new
experiment through the server while this process sweeps straight into the database, with the
password in `mlflow.tracking_uri`, into an experiment where a killed process left its run RUNNING.
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import psutil
import pytest
from conftest import REPO, TINY_DATA, TINY_RUN, output_of, run_here, served
from mlflow import MlflowClient
from omegaconf import OmegaConf
from postgres import Cluster, cluster
from test_credentials import SECRET, files_with_secret

from accelexp import processes, record
from accelexp.tracking.store import TrackingUnavailableError, open_experiment

TINY = ("data=synthetic", *TINY_DATA, *TINY_RUN)
THROUGH_SERVER, STRAIGHT = ("precision.name", "fp32,bf16"), ("seed", "1,2")  # (param, values)


@pytest.fixture(scope="session")
def database() -> Iterator[Cluster]:
    """A new PostgreSQL cluster whose user `alice` logs in with the password SECRET."""
    with cluster("alice", SECRET) as found:
        yield found


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


@pytest.fixture(scope="module")
def team(database, tmp_path_factory):
    """(server URL, folder, {experiment: (exit code, output)} of the two sweeps, the runs left
    RUNNING before them: {name: run id})."""
    tmp = tmp_path_factory.mktemp("team")
    with served(database.uri(), tmp / "server") as base:  # it migrates the database
        client = MlflowClient(base)
        direct = client.create_experiment("direct", (tmp / "direct-artifacts").as_uri())
        here = os.getpid(), psutil.Process().create_time()
        before = {
            "killed": left_running(client, direct, "killed", *killed_process()),
            "alive": left_running(client, direct, "alive", *here),
        }
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "MLFLOW_"))}
        through_server = subprocess.Popen(
            [sys.executable, "run.py", "-m", *TINY, f"precision={THROUGH_SERVER[1]}",
             f"mlflow.tracking_uri={base}", "mlflow.experiment=team",
             f"hydra.sweep.dir={tmp / 'team'}"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        straight = run_here(None, "-m", *TINY, f"seed={STRAIGHT[1]}",
                            f"mlflow.tracking_uri={database.uri()}", "mlflow.experiment=direct",
                            f"hydra.sweep.dir={tmp / 'direct'}")  # fmt: skip
        said = through_server.communicate(timeout=600)[0]
        ended = {
            "team": (through_server.returncode, said),
            "direct": (straight.returncode, output_of(straight)),
        }
        yield base, tmp, ended, before


def runs(base: str, experiment: str) -> list:
    client = MlflowClient(base)
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


@pytest.mark.parametrize(
    "experiment, swept",
    [("team", THROUGH_SERVER), ("direct", STRAIGHT)],
    ids=["server", "straight"],
)
def test_two_sweeps_at_once_log_every_job_under_its_parent(team, experiment, swept):
    """One through the server, one straight to the database, at the same time."""
    base, _, ended, before = team
    assert ended[experiment][0] == 0, ended[experiment][1]
    found = [r for r in runs(base, experiment) if r.info.run_id not in before.values()]
    (parent,) = [r for r in found if r.data.tags.get(record.SWEEP_PARENT) == "true"]
    key, values = swept
    assert parent.info.run_name == f"sweep {key.partition('.')[0]}={values}"
    children = [r for r in found if r.data.tags.get(record.PARENT_RUN) == parent.info.run_id]
    assert len(children) == len(found) - 1
    assert sorted(child.data.params[key] for child in children) == sorted(values.split(","))
    assert [r.info.status for r in (parent, *children)] == ["FINISHED"] * 3


def test_clients_opening_a_new_experiment_at_once_all_get_it(team):
    """Two sweeps started together into a new experiment: each finds it missing and creates it,
    and the database refuses the second (a unique name) — which found it made."""
    base = team[0]
    for attempt in range(3):
        mlflow_cfg = OmegaConf.create(
            {"tracking_uri": base, "experiment": f"race {attempt}", "artifact_location": None}
        )
        ready, opened = threading.Barrier(6), []

        def open_it(mlflow_cfg=mlflow_cfg, ready=ready, opened=opened) -> None:
            ready.wait()
            try:
                opened.append(open_experiment(mlflow_cfg)[1])
            except Exception as error:
                opened.append(repr(error))

        clients = [threading.Thread(target=open_it) for _ in range(6)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        made = MlflowClient(base).get_experiment_by_name(f"race {attempt}").experiment_id
        assert opened == [made] * 6


def test_a_run_left_running_by_a_killed_process_is_healed_by_the_next_sweep(team):
    base, _, ended, before = team
    assert ended["direct"][0] == 0, ended["direct"][1]
    client = MlflowClient(base)
    killed, alive = (client.get_run(before[name]) for name in ("killed", "alive"))
    assert (killed.info.status, alive.info.status) == ("FAILED", "RUNNING")
    pid = killed.data.tags[record.PID]
    assert killed.data.tags[record.ENDED].startswith(f"process {pid} on host {platform.node()} "
                                                     f"is gone; found by run.py at ")  # fmt: skip
    assert record.ENDED not in alive.data.tags


def test_a_sweep_straight_to_the_database_keeps_its_password_nowhere(team, database):
    base, tmp, ended, before = team
    code, text = ended["direct"]
    assert code == 0, text
    made = [r for r in runs(base, "direct") if r.info.run_id not in before.values()]
    assert len(made) == 3  # the parent, 2 jobs
    clean = f"postgresql+psycopg://127.0.0.1:{database.port}/mlflow"  # the user in PGUSER
    for run in made:
        assert not [v for v in (*run.data.params.values(), *run.data.tags.values()) if SECRET in v]
        if record.PARENT_RUN in run.data.tags:
            assert run.data.params["mlflow.tracking_uri"] == clean
    assert (tmp / "direct" / "multirun.yaml").is_file()
    assert SECRET not in text
    assert files_with_secret(tmp / "direct", tmp / "direct-artifacts") == []


def test_a_run_straight_to_the_database_into_an_experiment_the_server_made_is_refused(
    team, database
):
    """Its artifacts are behind the server (mlflow-artifacts:/): said before the run begins,
    not at its first artifact, after its params and metrics."""
    mlflow_cfg = OmegaConf.create(
        {"tracking_uri": database.uri(), "experiment": "team", "artifact_location": None}
    )
    with pytest.raises(TrackingUnavailableError) as error:
        open_experiment(mlflow_cfg)
    said = str(error.value)
    assert "'team' keeps its artifacts behind its tracking server (mlflow-artifacts:/" in said
    assert "mlflow.tracking_uri=http://HOST:5000" in said and SECRET not in said
