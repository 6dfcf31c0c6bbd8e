"""Stale runs heal: a run left RUNNING by a process that died without a word (SIGKILL, a reboot,
a store that could not take its end) is marked FAILED, with the tag `accelexp.ended` saying why,
by the next command on its host that opens the store (`Tracker.connect`, the report's queries).
Runs of other hosts, runs whose process lives and runs from before the tags are left; the report
shows a run still RUNNING as such, never as a result. In-process, on runs made by hand."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import time

import psutil
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from accelexp import processes, record
from accelexp.report import main
from accelexp.tracking import Tracker, query
from accelexp.tracking.life import heal_stale_runs, start_sweep
from accelexp.tracking.names import PARENT_RUN_ENV, SWEEP_NAME_ENV, SWEPT_KEYS_ENV, where_it_runs

HERE = platform.node()


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has ended (and been waited for)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def me() -> tuple[int, float]:
    return os.getpid(), psutil.Process().create_time()


def running(client, experiment_id, name, host=HERE, pid=None, started=0.0, tags=None) -> str:
    """A run left RUNNING by process `pid` (started at `started`) on `host`, in this pid
    namespace unless `tags` name another; no place tags when `pid` is None (a run logged before
    them)."""
    tags = dict(tags or {})
    place = {record.HOST: host}
    if pid is not None:
        place |= {
            record.PID: str(pid),
            record.PROCESS_START: f"{started:.2f}",
            record.PID_NAMESPACE: tags.pop(record.PID_NAMESPACE, processes.pid_namespace()),
        }
    return client.create_run(experiment_id, run_name=name, tags=place | tags).info.run_id


def statuses(client, *run_ids) -> list[str]:
    return [client.get_run(run_id).info.status for run_id in run_ids]


def test_opening_the_store_fails_this_hosts_runs_whose_process_is_gone(
    compose_cfg, tracking_uri, dead_pid, caplog
):
    cfg = compose_cfg()
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.create_experiment(cfg.mlflow.experiment)
    pid, started = me()
    gone = running(client, experiment, "gone", pid=dead_pid, started=started)
    reused = running(client, experiment, "reused pid", pid=pid, started=started - 3600)
    parent = running(client, experiment, "sweep", pid=dead_pid, tags={record.SWEEP_PARENT: "true"})
    alive = running(client, experiment, "alive", pid=pid, started=started)
    elsewhere = running(client, experiment, "elsewhere", host="other-host", pid=dead_pid)
    container = {record.PID_NAMESPACE: "pid:[1]"}  # another container of this host's name
    contained = running(client, experiment, "container", pid=dead_pid, tags=container)
    untagged = running(client, experiment, "before the tags")

    with caplog.at_level(logging.INFO, logger="accelexp.tracking.life"):
        Tracker(cfg.mlflow).connect()

    assert statuses(client, gone, reused, parent) == ["FAILED"] * 3
    assert statuses(client, alive, elsewhere, contained, untagged) == ["RUNNING"] * 4
    ended = client.get_run(gone).data.tags[record.ENDED]
    assert ended.startswith(f"process {dead_pid} on host {HERE} is gone; found by run.py at 20")
    assert client.get_run(parent).data.tags[record.ENDED].startswith(f"process {dead_pid} ")
    assert record.ENDED not in client.get_run(alive).data.tags
    (line,) = [r.getMessage() for r in caplog.records if "left RUNNING" in r.getMessage()]
    assert line.startswith("Marked 3 run(s) FAILED")

    caplog.clear()  # healed once: the next command finds nothing to say
    Tracker(cfg.mlflow).connect()
    assert not [r for r in caplog.records if "left RUNNING" in r.getMessage()]


def test_runs_and_sweep_parents_record_where_their_process_lives(
    compose_cfg, tracking_uri, monkeypatch
):
    cfg = compose_cfg()
    tracker = Tracker(cfg.mlflow)
    tracker.connect()
    tracker.start("here", {}, {})
    for name in (PARENT_RUN_ENV, SWEEP_NAME_ENV, SWEPT_KEYS_ENV):  # which start_sweep sets:
        monkeypatch.setenv(name, "")  # unset again after the test, as they were
    parent = start_sweep(cfg.mlflow, "sweep x=1,2", {"x": "1,2"}, "d")
    client = MlflowClient(tracking_uri=tracking_uri)
    pid, started = me()
    for run_id in (tracker.run_id, parent):
        tags = client.get_run(run_id).data.tags
        assert (tags[record.HOST], tags[record.PID]) == (HERE, str(pid))
        assert float(tags[record.PROCESS_START]) == pytest.approx(started, abs=0.01)
        assert tags[record.PID_NAMESPACE] == os.readlink("/proc/self/ns/pid")


def test_a_healed_run_resumed_lives_in_its_new_process(
    compose_cfg, tracking_uri, dead_pid, tmp_path
):
    """resume=auto takes a healed (FAILED) run up again: RUNNING, here, without the old end."""
    cfg = compose_cfg()
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.create_experiment(cfg.mlflow.experiment)
    run_id = running(client, experiment, "killed", pid=dead_pid)
    tracker = Tracker(cfg.mlflow)
    tracker.connect()
    assert statuses(client, run_id) == ["FAILED"]

    tracker.resume(run_id, 1, tmp_path)
    tags = client.get_run(run_id).data.tags
    assert statuses(client, run_id) == ["RUNNING"]
    assert (tags[record.PID], record.ENDED in tags) == (str(os.getpid()), False)


def test_a_store_error_while_healing_is_a_warning(caplog):
    class Broken:
        def search_runs(self, *args, **kwargs):
            raise RuntimeError("disk I/O error\nSELECT ...")

    with caplog.at_level(logging.WARNING, logger="accelexp.tracking.life"):
        assert heal_stale_runs(Broken(), ["1"], "run.py") == 0
    assert "Could not look for runs left RUNNING by processes now gone: disk I/O error" in (
        caplog.text
    )


def test_a_process_is_gone_when_its_pid_is_free_reused_or_a_zombie(dead_pid):
    pid, started = me()
    assert not processes.is_gone(pid, started)
    assert processes.is_gone(pid, started - 3600)  # the pid of an earlier process
    assert processes.is_gone(dead_pid, started)
    zombie = subprocess.Popen(["true"])  # exited, not waited for
    try:
        deadline = time.monotonic() + 5
        while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert processes.is_gone(zombie.pid, psutil.Process(zombie.pid).create_time())
    finally:
        zombie.wait()
    assert where_it_runs()[record.PID] == str(pid)


def test_the_report_heals_and_shows_a_running_run_as_running(
    tracking_uri, dead_pid, tmp_path, capsys
):
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.create_experiment("stale", (tmp_path / "artifacts").as_uri())
    config = {"parallelism": "single", "world_size": "1", "model": "m", "data": "d"}

    def measured(name, precision, status, host=HERE, pid=None) -> str:
        tags = config | {"precision": precision}
        run_id = running(client, experiment, name, host, pid, tags=tags)
        history = [Metric("samples_per_s", 100.0, 0, epoch) for epoch in (1, 2)]
        history += [Metric("timed_steps", 20, 0, epoch) for epoch in (1, 2)]
        client.log_batch(run_id, metrics=[*history, Metric("throughput", 100.0, 0, 2)])
        if status != "RUNNING":
            client.set_terminated(run_id, status)
        return run_id

    measured("fp32", "fp32", "FINISHED")
    measured("amp elsewhere", "amp", "RUNNING", host="gpu-node-7", pid=1)
    gone = measured("bf16 killed", "bf16", "RUNNING", pid=dead_pid)

    assert [r.status for r in query.experiment_runs(tracking_uri, experiment)] == [
        "FAILED",
        "RUNNING",
        "FINISHED",
    ]
    assert "found by accelexp-report at" in client.get_run(gone).data.tags[record.ENDED]

    args = ["--experiment", "stale", "--tracking-uri", tracking_uri, "--format", "json"]
    assert main([*args, "--no-plots", "--output-dir", str(tmp_path / "report")]) == 0
    out, err = capsys.readouterr()
    rows = {row["run_name"]: row for row in json.loads(out)}
    assert rows["fp32"]["samples_per_s"] == 100.0
    elsewhere = rows["amp elsewhere"]
    assert (elsewhere["status"], elsewhere["samples_per_s"], elsewhere["amp_gain"]) == (
        "RUNNING",
        None,
        None,
    )
    assert elsewhere["note"] == "still running on gpu-node-7: no figures until it ends"
    killed = rows["bf16 killed"]
    assert (killed["status"], killed["samples_per_s"]) == ("FAILED", None)
    assert killed["note"].startswith(f"process {dead_pid} on host {HERE} is gone; found by")
    assert f"bf16 killed ({gone}) FAILED: process {dead_pid} on host" in err


def test_the_diagnosis_gives_a_running_run_no_figures():
    from accelexp.report.diagnose import diagnose, footnote
    from accelexp.tracking.query import RunRecord

    shares = {f"time/{part}_s": 1.0 for part in ("input", "forward", "backward", "optimizer")}
    tags = {"parallelism": "single", "world_size": "1", "precision": "fp32", record.HOST: "n7"}
    runs = [
        RunRecord(name, name, status, tags=tags, metrics=shares | {"time/other_s": 1.0})
        for name, status in (("done", "FINISHED"), ("busy", "RUNNING"))
    ]
    done, busy = sorted(diagnose(runs), key=lambda row: row.run_name != "done")
    assert done.input_pct == 20.0
    assert (busy.input_pct, busy.step_time_s) == (None, None)
    assert busy.note == "still running on n7: no figures until it ends"
    assert footnote([done, busy]) == "— still running, no figures until it ends: busy."
