"""Optuna studies through run.py: what `objective=` returns, a failed trial, the Pareto front in the
sweep's report, and the joblib launcher's worker processes.

Each study is `python run.py -m +experiment=optuna[_pareto]` in this process (`conftest.run_here`)
at the tiniest size that proves it: synthetic 16 px images, 3 steps, one epoch, 2 or 3 trials.
What is checked is read back from MLflow (the parent run, its children, their tags and metrics,
the report's artifacts) and from what Optuna's sweeper wrote (optimization_results.yaml), never
from the code under test: the front is computed here from the children's metrics.
"""

from __future__ import annotations

import math
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import new_store, output_of, run_here
from mlflow import MlflowClient

from accelexp import objective, record
from accelexp.report import main as report_main
from accelexp.report.pareto import dominates, non_dominated, pareto
from accelexp.tracking.query import RunRecord

TINY = (
    "data=synthetic",
    "data.num_train=256",
    "data.num_test=128",
    "data.image_size=16",
    "max_steps_per_epoch=3",
    "epochs=1",
    "progress=false",
    "threads=1",
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def study(tmp: Path, template: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, str]:
    """`run.py -m ...` at the tiny size into a store of its own, in this process."""
    uri = new_store(tmp, template)
    result = run_here(
        None,
        "-m",
        *TINY,
        *overrides,
        f"mlflow.tracking_uri={uri}",
        f"hydra.sweep.dir={tmp / 'sweep'}",
    )
    return result, uri


def runs_of(uri: str, experiment: str) -> tuple[object, list]:
    """(the sweep's parent run, its children, oldest first) in `experiment`."""
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parents = [r for r in runs if r.data.tags.get(record.SWEEP_PARENT) == "true"]
    assert len(parents) == 1, [r.info.run_name for r in runs]
    parent_id = parents[0].info.run_id
    children = [r for r in runs if r.data.tags.get(record.PARENT_RUN) == parent_id]
    assert len(children) == len(runs) - 1, "every other run is a child of the sweep"
    return parents[0], sorted(children, key=lambda r: r.info.start_time)


def artifact(uri: str, run_id: str, path: str) -> Path:
    return Path(MlflowClient(uri).download_artifacts(run_id, path))


def test_a_study_is_one_parent_run_and_a_failed_trial_does_not_stop_it(
    tmp_path, mlflow_template_db
):
    # TPE's seed 1 draws batch size 32, then 100000 (larger than the training set: that job
    # fails its validation, run.py returns None, Optuna's sweeper tells the trial FAIL)
    result, uri = study(
        tmp_path,
        mlflow_template_db,
        "+experiment=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.seed=1",
        "data.batch_size=choice(32,100000)",
    )
    assert result.returncode == 1, output_of(result)  # a failed job: the sweep's exit, as -m's
    parent, children = runs_of(uri, "optuna")
    by_status = {child.info.status: child for child in children}
    assert sorted(by_status) == ["FAILED", "FINISHED"], [c.info.run_name for c in children]
    finished, failed = by_status["FINISHED"], by_status["FAILED"]
    assert "data.batch_size=100000" in failed.data.tags[record.OVERRIDES]  # failed before params
    assert finished.data.params["data.batch_size"] == "32"
    assert parent.info.status == "FAILED"  # like any sweep with a failed job
    assert parent.info.run_name.startswith("sweep optimizer.lr=tag(log,interval(0.003,0.3))")
    assert parent.data.tags[record.OBJECTIVE] == "test_acc"
    assert parent.data.tags[record.OBJECTIVE_DIRECTIONS] == "maximize"
    assert finished.data.tags[record.OBJECTIVE] == "test_acc"
    # named by what the trials vary, a drawn lr to 4 significant digits
    lr = float(finished.data.params["optimizer.lr"])
    assert finished.info.run_name.startswith(f"lr={lr:.4g} ")
    # the study went on to its end: its result is the finished trial, logged on the parent
    results = yaml.safe_load(
        artifact(uri, parent.info.run_id, "optimization_results.yaml").read_text()
    )
    assert results["best_value"] == pytest.approx(finished.data.metrics[record.TEST_ACC])
    assert results["best_params"]["optimizer.lr"] == pytest.approx(lr)
    assert results["best_params"]["precision"] == finished.data.params["precision.name"]
    assert "report/report.html" in {
        a.path for a in MlflowClient(uri).list_artifacts(parent.info.run_id, "report")
    }
    assert "Traceback" not in output_of(result)


def test_a_two_objective_study_reports_its_pareto_front(tmp_path, mlflow_template_db, capsys):
    result, uri = study(
        tmp_path, mlflow_template_db, "+experiment=optuna_pareto", "hydra.sweeper.n_trials=3"
    )
    assert result.returncode == 0, output_of(result)
    parent, children = runs_of(uri, "optuna_pareto")
    assert parent.info.status == "FINISHED" and len(children) == 3
    assert parent.data.tags[record.OBJECTIVE] == "test_acc,samples_per_s"
    assert parent.data.tags[record.OBJECTIVE_DIRECTIONS] == "maximize,maximize"
    # the front, from the children's metrics: no other child at least as good on both, and
    # better on one
    values = {
        c.info.run_id: (c.data.metrics[record.TEST_ACC], c.data.metrics[record.THROUGHPUT])
        for c in children
    }
    front = {
        run_id
        for run_id, (acc, speed) in values.items()
        if not any(a >= acc and s >= speed and (a, s) != (acc, speed) for a, s in values.values())
    }
    assert front
    # what Optuna's sweeper found: the same points (it was told these very values)
    results = yaml.safe_load(
        artifact(uri, parent.info.run_id, "optimization_results.yaml").read_text()
    )
    assert sorted(tuple(s["values"]) for s in results["solutions"]) == sorted(
        values[run_id] for run_id in front
    )
    # the parent's report: the front's table, its CSV, the plot of every trial
    table = artifact(uri, parent.info.run_id, "report/pareto.csv").read_text().splitlines()
    assert table[0] == "run_name,run_id,status,overrides,test_acc,samples_per_s,on_front"
    assert {line.split(",")[1] for line in table[1:]} == front
    assert artifact(uri, parent.info.run_id, "report/pareto.png").read_bytes()[:8] == PNG_MAGIC
    page = artifact(uri, parent.info.run_id, "report/report.html").read_text()
    assert "<h2>Pareto front: test_acc vs samples_per_s</h2>" in page
    names = {c.info.run_id: c.info.run_name for c in children}
    assert all(names[run_id] in page for run_id in front)
    # and the command prints it
    capsys.readouterr()
    args = ["--sweep", "latest", "--format", "markdown", "--tracking-uri", uri]
    assert report_main([*args, "--output-dir", str(tmp_path / "report")]) == 0
    printed = capsys.readouterr().out
    assert "### Pareto front: test_acc vs samples_per_s" in printed
    assert all(names[run_id] in printed.split("### Pareto front")[1] for run_id in front)


def test_joblib_runs_the_jobs_in_worker_processes_as_children_of_the_parent(
    tmp_path, mlflow_template_db
):
    """Two sweeps through joblib's worker processes, which are started once and reused: the second
    sweep's jobs run in workers started during the first, and are still its own children."""
    from joblib.externals.loky import get_reusable_executor

    launcher = ("hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    try:
        grid, grid_uri = study(
            tmp_path / "grid", mlflow_template_db, *launcher, "precision=fp32,bf16"
        )
        assert grid.returncode == 0, output_of(grid)
        searched, uri = study(
            tmp_path / "optuna", mlflow_template_db, *launcher,
            "+experiment=optuna", "hydra.sweeper.n_trials=2",
        )  # fmt: skip
        assert searched.returncode == 0, output_of(searched)
    finally:
        get_reusable_executor().shutdown(wait=True)  # the workers hold torch: not for later tests
    _, grid_children = runs_of(grid_uri, "accelexp")
    parent, children = runs_of(uri, "optuna")
    assert sorted(c.data.tags["precision"] for c in grid_children) == ["bf16", "fp32"]
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)
    assert all(c.data.tags[record.SWEEP] == parent.info.run_name for c in children)
    workers = {c.data.tags[record.PID] for c in grid_children}
    assert str(os.getpid()) not in workers  # the jobs ran in other processes
    assert {c.data.tags[record.PID] for c in children} <= workers  # the same, reused


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["objective=accuracy"], "objective='accuracy' is not allowed: expected one of test_acc"),
        (["objective=[test_acc,test_acc]"], "a list of them without repeats"),
        (["objective=[]"], "objective=[] is not allowed"),
        (["objective=time_to_target", "target_accuracy=null"], "set target_accuracy"),
        (["-m", "+experiment=optuna", "objective=accuracy"], "objective='accuracy' is not"),
        (
            ["-m", "+experiment=optuna", "objective=time_to_target", "target_accuracy=0.5"],
            "time_to_target is minimized), but hydra.sweeper.direction=maximize: add "
            "hydra.sweeper.direction=minimize",
        ),
        (
            ["-m", "+experiment=optuna_pareto", "objective=test_acc"],
            "direction=[maximize,maximize]: add hydra.sweeper.direction=maximize",
        ),
        (["-m", "hydra/sweeper=optuna"], "add hydra.sweeper.direction=maximize"),  # its default
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_a_bad_objective_is_one_clear_message_and_exit_2(overrides, named, tmp_path, cli):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    flags = [o for o in overrides if o == "-m"]
    given = [o for o in overrides if o != "-m"]
    result = cli(
        *flags, *TINY, *given, f"mlflow.tracking_uri={uri}", f"hydra.sweep.dir={tmp_path}/s"
    )
    text = output_of(result)
    assert result.returncode == 2, text
    assert named in text, text
    assert "Traceback" not in text, text
    assert not (tmp_path / "mlflow.db").exists()  # refused before a run (a sweep's parent) began


# --- the pieces, on hand-made values ---------------------------------------------------------


def test_the_sweeper_gets_each_objective_and_the_worst_value_for_one_not_measured(caplog):
    metrics = {record.TEST_ACC: 0.5, record.THROUGHPUT: 900.0}
    assert objective.sweeper_value("test_acc", metrics) == 0.5
    assert objective.sweeper_value(["test_acc"], metrics) == 0.5  # one objective: one float
    assert objective.sweeper_value(["samples_per_s", "test_acc"], metrics) == [900.0, 0.5]
    with caplog.at_level("WARNING"):
        never = objective.sweeper_value(["test_acc", "time_to_target"], metrics)
    assert never == [0.5, math.inf]  # minimized: Optuna takes inf, the worst (it refuses NaN)
    assert "val_acc never reached target_accuracy" in caplog.text
    assert objective.tags(["test_acc", "samples_per_s"]) == {
        record.OBJECTIVE: "test_acc,samples_per_s",
        record.OBJECTIVE_DIRECTIONS: "maximize,maximize",
    }


def test_the_front_is_the_trials_no_other_beats_on_both_in_their_directions():
    up_down = ("maximize", "minimize")
    assert dominates((2, 1), (1, 1), up_down) and not dominates((1, 1), (1, 1), up_down)
    points = [(0.9, 30.0), (0.8, 10.0), (0.9, 30.0), (0.7, 20.0), (0.95, 40.0)]
    assert non_dominated(points, up_down) == [True, True, True, False, True]  # equal: both on it

    def run(name, status="FINISHED", **metrics):
        tags = {record.OBJECTIVE: "test_acc,time_to_target", record.OVERRIDES: f"seed={name}"}
        tags[record.OBJECTIVE_DIRECTIONS] = "maximize,minimize"
        return RunRecord(name, name, status, tags=tags, metrics=metrics)

    front = pareto([
        run("a", test_acc=0.9, time_to_target_s=30.0),
        run("b", test_acc=0.8, time_to_target_s=40.0),
        run("c", test_acc=0.95),  # never reached the target
        run("d", status="FAILED"),
        RunRecord("e", "e", "FINISHED", metrics={"test_acc": 1.0}),  # no objectives: not a trial
    ])  # fmt: skip
    assert [t.run_name for t in front.rows] == ["a"] and front.rows[0].overrides == "seed=a"
    assert [t.run_name for t in front.trials] == ["a", "b"]
    assert front.left_out == [
        "1 run(s) with other objectives",
        "c: no time_to_target_s",
        "d: FAILED",
    ]
    assert pareto([RunRecord("e", "e", "FINISHED")]) is None
    drawn = replace(front.rows[0], overrides="optimizer.lr=0.03756196144499839 seed=1")
    assert front.layout.text(drawn, "overrides") == "optimizer.lr=0.03756 seed=1"  # CSV: as drawn
