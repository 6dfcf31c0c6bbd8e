"""Lockstep: a sweep's configurations as live jobs taking turns, proved on real jobs.

One real lockstep sweep — a single-process job beside a 2-worker DDP job (Gloo), tiny, a turn
of one step — feeds the checks that no step of a job runs during another job's turn and that the
two ranks of the DDP job take each turn together, from the jobs' own step ends and turns on the
host's monotonic clock. A crashed job, a SIGINT to the sweeper, a refused launcher and the
precision target are real sweeps too; the interval across incarnations is checked on numbers
made here.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import signal
import types
from pathlib import Path

import pytest
from conftest import new_store, output_of
from jobs import Job
from mlflow import MlflowClient
from omegaconf import OmegaConf
from test_sweeps import TINY, runs_of, sweep

from accelexp import stats
from accelexp.errors import ConfigError
from accelexp.lockstep import sweep as by_repeat
from accelexp.lockstep import together
from accelexp.lockstep.sweep import MIN_REPEATS_FOR_TARGET, check, memory_problem
from accelexp.record import (
    COMPARE,
    CONFIG_ID,
    FINISHED,
    LOCKSTEP_INCARNATION,
    LOCKSTEP_PROCESS,
    NOISE,
    PARENT_RUN,
    PROCESS_SHARED,
    REPEAT_INDEX,
    REPEATS,
    SAMPLES_PER_S,
    THROUGHPUT,
    TIMED_STEPS,
    TRAIN_LOSS,
    lockstep_file,
)
from accelexp.report.compare import group, ratio
from accelexp.tracking import query

TURN_OF_ONE_STEP = ("compare=lockstep", "lockstep.slice_steps=1", "lockstep.warmup_rounds=0")


def windows(folder: Path, rank: int) -> tuple[list[tuple[int, float, float]], list[float]]:
    """A rank's turns (round, granted, handed back) and step ends, as it recorded them."""
    kept = json.loads((folder / lockstep_file(rank)).read_text())
    return [tuple(t) for t in kept["turns"]], kept["step_ends"]


@pytest.fixture(scope="module")
def taking_turns(tmp_path_factory: pytest.TempPathFactory, mlflow_template_db: Path):
    """A lockstep sweep of one single-process job and one 2-worker DDP job."""
    tmp = tmp_path_factory.mktemp("lockstep")
    result, uri = sweep(
        tmp, mlflow_template_db, "parallelism=ddp", "parallelism.nprocs=1,2", *TURN_OF_ONE_STEP
    )
    return result, uri, tmp / "sweep"


def assert_turns_taken(folder: Path) -> None:
    """Jobs 0 and 1 of a lockstep sweep in `folder` took turns: no two turns overlap, each step
    of a job ended inside one of its own turns, one turn of each job per round."""
    first, second = (windows(folder / str(job), 0) for job in (0, 1))
    turns = sorted([(t, 0) for t in first[0]] + [(t, 1) for t in second[0]])
    for (earlier, _), (later, _) in itertools.pairwise(turns):
        assert earlier[2] <= later[1], f"turns overlap: {earlier} and {later}"
    assert {who for _, who in turns} == {0, 1}
    for own_turns, step_ends in (first, second):
        assert step_ends, "the job trained"
        for end in step_ends:  # each step ended inside one of its own job's turns
            assert any(granted <= end <= back for _, granted, back in own_turns), end
    rounds = [t[0] for t, _ in turns]
    assert rounds == sorted(rounds), "one turn of each job per round, round after round"


@pytest.mark.alone  # slices a neighbour shared are set aside: no other test beside it
def test_no_step_of_a_job_runs_during_another_jobs_turn(taking_turns) -> None:
    result, _, folder = taking_turns
    assert result.returncode == 0, output_of(result)
    assert_turns_taken(folder)


@pytest.mark.alone  # slices a neighbour shared are set aside: no other test beside it
def test_the_ranks_of_a_job_take_each_turn_together(taking_turns) -> None:
    _, _, folder = taking_turns
    (rank0, _), (rank1, steps1) = windows(folder / "1", 0), windows(folder / "1", 1)
    assert [t[0] for t in rank0] == [t[0] for t in rank1], "the same rounds"
    for a, b in zip(rank0, rank1, strict=True):  # both inside the job's turn of that round
        assert max(a[1], b[1]) < min(a[2], b[2])
    single = windows(folder / "0", 0)[0]
    for end in steps1:
        assert not any(granted < end < back for _, granted, back in single)


@pytest.mark.alone  # slices a neighbour shared are set aside: no other test beside it
def test_lockstep_runs_are_paired_by_round_and_process_in_the_report(taking_turns) -> None:
    """The one-process job went on in a fresh process after epoch 1 (`epochs_per_process=1`),
    the DDP job's workers lived the whole run: the rounds pair into two incarnations."""
    _, uri, _ = taking_turns
    parent, children = runs_of(uri)
    assert parent.info.status == "FINISHED"
    assert {c.info.status for c in children} == {"FINISHED"}
    assert {c.data.tags[COMPARE] for c in children} == {"lockstep"}
    client = MlflowClient(uri)
    processes = {
        c.data.tags["world_size"]: {
            m.value for m in client.get_metric_history(c.info.run_id, LOCKSTEP_INCARNATION)
        }
        for c in children
    }
    assert processes == {"1": {0.0, 1.0}, "2": {0.0}}, processes
    single, ddp = sorted(
        group(query.child_runs(uri, parent.info.run_id)),
        key=lambda g: g.first.tags["world_size"],
    )
    paired = ratio(ddp, single)
    assert paired.method.startswith("lockstep: t over 2 incarnations"), paired


@pytest.mark.alone  # slices a neighbour shared are set aside: no other test beside it
def test_jobs_sharing_one_process_take_turns_and_train_as_they_would_alone(
    tmp_path: Path, mlflow_template_db: Path
) -> None:
    """Two identical one-process jobs (lockstep.process=auto: threads of one process) take
    turns as processes do; each keeps its own RNG stream (dropout draws every step), so both
    train the same losses, and their slices pair as one process's rounds."""
    result, uri = sweep(tmp_path, mlflow_template_db, "+mlflow.tags.side=a,b",
                        "max_steps_per_epoch=8", *TURN_OF_ONE_STEP)  # fmt: skip
    assert result.returncode == 0, output_of(result)
    assert "share one process" in output_of(result)
    assert_turns_taken(tmp_path / "sweep")
    parent, children = runs_of(uri)
    assert {c.data.tags[LOCKSTEP_PROCESS] for c in children} == {PROCESS_SHARED}
    client = MlflowClient(uri)
    losses = [
        [m.value for m in client.get_metric_history(c.info.run_id, TRAIN_LOSS)] for c in children
    ]
    assert len(losses[0]) == 2 and losses[0] == losses[1], losses
    a, b = group(query.child_runs(uri, parent.info.run_id))
    assert ratio(b, a).method.startswith("lockstep in one process"), ratio(b, a)


def test_slices_in_seconds_give_a_job_of_slow_steps_fewer_steps_a_turn(
    tmp_path: Path, mlflow_template_db: Path
) -> None:
    """`lockstep.slice_s`: each job's slices are sized from its first timed slice, so a job
    whose batches arrive 100 ms late holds at most 3 steps a 0.3-s turn, one of plain tiny
    steps more (the first turns hold `slice_steps`=1). It reads only the jobs' own turns and
    step ends, never a ratio: a neighbour slows both jobs' steps, and their slices are sized from
    that (plain tiny steps would have to take over 85 ms each to fit 3 in 0.3 s), so it needs no
    room to itself."""
    result, _ = sweep(tmp_path, mlflow_template_db, "debug.input_delay_ms=0,100",
                      "max_steps_per_epoch=30", "epochs=1", "lockstep.slice_s=0.3",
                      *TURN_OF_ONE_STEP)  # fmt: skip
    assert result.returncode == 0, output_of(result)
    held = {}  # steps trained in each turn, by job
    for job in (0, 1):
        turns, step_ends = windows(tmp_path / "sweep" / str(job), 0)
        held[job] = [sum(granted <= end <= back for end in step_ends) for _, granted, back in turns]
    plain, delayed = max(held[0]), max(held[1])
    assert delayed <= 3 < plain, held


@pytest.mark.parametrize("process", ["own", "shared"])
def test_a_crashed_job_ends_alone_and_the_others_go_on(
    tmp_path: Path, mlflow_template_db: Path, process: str
) -> None:
    result, uri = sweep(
        tmp_path,
        mlflow_template_db,
        "debug.raise_on_rank=null,0",
        "debug.raise_at_step=2",
        f"lockstep.process={process}",
        "epochs=1",  # step 3, after the crash, is the other job's alone: one process of each
        *TURN_OF_ONE_STEP,
    )
    text = output_of(result)
    assert result.returncode == 1, text
    assert "lockstep: job 1 (debug.raise_on_rank=0) stopped" in text
    assert "debug.raise_on_rank=null go on alone" in text
    parent, children = runs_of(uri)
    statuses = {c.data.params["debug.raise_on_rank"]: c.info.status for c in children}
    assert statuses == {"None": "FINISHED", "0": "FAILED"}, statuses
    assert parent.info.status == "FAILED"


@pytest.mark.parametrize("process", ["own", "shared"])
def test_a_job_that_holds_its_turn_too_long_is_stopped_as_hung(
    tmp_path: Path, mlflow_template_db: Path, process: str
) -> None:
    """A step that takes 15 s in a turn allowed 5 s: that job is named and its run FAILED; a
    process each, the other finishes alone; in one process, it stops with it. (5 s, not 1: the
    healthy job's last turn, its test pass and logging, took over 1 s on a loaded machine.)"""
    result, uri = sweep(tmp_path, mlflow_template_db, "debug.input_delay_ms=0,15000",
                        "lockstep.turn_timeout_s=5", f"lockstep.process={process}",
                        "epochs=1", *TURN_OF_ONE_STEP)  # fmt: skip
    text = output_of(result)
    assert result.returncode == 1, text
    assert (
        "job 1 (debug.input_delay_ms=15000) stopped in round 0: it held its turn over 5 s" in text
    )
    parent, children = runs_of(uri)
    statuses = {c.data.params["debug.input_delay_ms"]: c.info.status for c in children}
    alone = "FINISHED" if process == "own" else "FAILED"
    assert statuses == {"0.0": alone, "15000.0": "FAILED"}, statuses
    assert parent.info.status == "FAILED"


@pytest.mark.parametrize("process", ["own", "shared"])
def test_sigint_stops_every_job_and_closes_every_run(
    tmp_path: Path, mlflow_template_db: Path, process: str
) -> None:
    """SIGTERM to each job's own process (own), or to the one process whose threads hold them
    all (shared). A job's process lives the whole run here (`epochs_per_process=null`): fresh
    processes at each epoch are the taking_turns sweep's."""
    uri = new_store(tmp_path, mlflow_template_db)
    job = Job(
        tmp_path, "-m", *TINY, "epochs=50", "max_steps_per_epoch=4", "precision=fp32,bf16",
        *TURN_OF_ONE_STEP, f"lockstep.process={process}", "lockstep.epochs_per_process=null",
        f"mlflow.tracking_uri={uri}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )  # fmt: skip
    try:
        job.wait_for("epoch 1/50", count=2)  # both are training, taking turns
        job.signal(signal.SIGINT)
        code = job.finish()  # and nothing it started is left
    finally:
        job.kill_everything()
    assert code == 128 + signal.SIGINT, job.output
    assert "go on alone" not in job.output  # every job was stopped, none goes on
    parent, children = runs_of(uri)
    assert parent.info.status == "KILLED"
    assert len(children) == 2 and {c.info.status for c in children} == {"KILLED"}


def test_lockstep_refuses_a_launcher_it_cannot_hand_turns_to(
    tmp_path: Path, mlflow_template_db: Path
) -> None:
    result, _ = sweep(tmp_path, mlflow_template_db, "precision=fp32,bf16", "compare=lockstep",
                      "hydra/launcher=joblib")  # fmt: skip
    assert result.returncode == 2, output_of(result)
    assert "compare=lockstep runs the sweep's jobs side by side" in output_of(result)


MEASURABLE = ("+mlflow.tags.side=a,b", "data.num_train=1024", "max_steps_per_epoch=16", "epochs=1")


@pytest.mark.alone  # slices a neighbour shared are set aside: no other test beside it
def test_a_precision_target_met_stops_sampling(tmp_path: Path, mlflow_template_db: Path) -> None:
    """A target met at once stops at the least repeats an interval needs (12 timed steps)."""
    met, uri = sweep(tmp_path, mlflow_template_db, *MEASURABLE, "precision_target=0.99",
                     "max_repeats=8")  # fmt: skip
    assert met.returncode == 0, output_of(met)
    # at the first repeat from MIN_REPEATS_FOR_TARGET on whose interval is that wide (a run a
    # neighbour shared is set aside: a repeat more, seen once in CI), never the whole budget
    reached = re.search(r"precision target ±99 % reached: .*, (\d+) repeats", output_of(met))
    assert reached, output_of(met)
    repeats = int(reached.group(1))
    assert MIN_REPEATS_FOR_TARGET <= repeats < 8
    assert {c.data.tags[REPEAT_INDEX] for c in runs_of(uri)[1]} == {str(i) for i in range(repeats)}


def test_a_precision_target_that_cannot_be_met_spends_the_budget_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Runs up to max_repeats, never more, and says how wide its widest ratio got. The ratios
    are read back after each repeat as the report computes them (`Repeats.precision`, through
    `compare`), from hand-made runs whose bf16 side reads 10 % off either way: ±15 % after 5
    repeats, never ±0.0001 %. That real runs logged to MLflow are read back the same way, and
    stop the sweep once within its target, is test_a_precision_target_met_stops_sampling's."""
    config = OmegaConf.create({"compare": "repeats", "precision_target": 0.000001, "repeats": 1,
                               "max_repeats": MIN_REPEATS_FOR_TARGET, "seed": 0,
                               "repeat_seed": "same",
                               "mlflow": {"tracking_uri": "sqlite:///unused.db"}})  # fmt: skip
    records: list[query.RunRecord] = []

    def launch(batch: list[list[str]], number: int) -> None:
        for job in batch:  # what each job of the repeat logged
            settings = dict(o.split("=", 1) for o in job)
            index, precision = int(settings["repeat_index"]), settings["precision"]
            speed = 100.0 * (1 if precision == "fp32" else (1.1 if index % 2 else 0.9))
            records.append(query.RunRecord(
                f"{precision}{index}", f"r{index + 1} {precision}", FINISHED, start_time=number,
                tags={NOISE: "quiet", REPEAT_INDEX: str(index), REPEATS: "5",
                      CONFIG_ID: precision, PARENT_RUN: "parent"},
                params={"precision": precision, "world_size": "1"},
                metrics={THROUGHPUT: speed, TIMED_STEPS: 11.0},
                histories={SAMPLES_PER_S: [(1, speed)]},
            ))  # fmt: skip

    monkeypatch.setattr(query, "child_runs", lambda uri, run_id: list(records))
    parent = types.SimpleNamespace(run_id="parent")
    jobs = [["precision=fp32"], ["precision=bf16"]]
    with caplog.at_level(logging.INFO, logger="accelexp.lockstep.sweep"):
        by_repeat.Repeats(config, jobs, launch, lambda o: config, parent).run()
    budget = MIN_REPEATS_FOR_TARGET  # 5
    assert len(records) == 2 * budget
    assert {r.tags[REPEAT_INDEX] for r in records} == {str(i) for i in range(budget)}
    said = [r.getMessage() for r in caplog.records]
    assert f"budget spent at ±14.6 % after {budget} repeats (widest: bf16)" in said, said
    assert not any("reached" in line for line in said), said


def test_a_target_asks_for_a_budget_of_at_least_the_repeats_it_is_checked_from() -> None:
    config = OmegaConf.create({"compare": "lockstep", "precision_target": 0.03, "repeats": 2,
                               "max_repeats": MIN_REPEATS_FOR_TARGET - 1})  # fmt: skip
    with pytest.raises(ConfigError, match=f"raise max_repeats to {MIN_REPEATS_FOR_TARGET} or"):
        check(config, "hydra._internal.core_plugins.basic_launcher.BasicLauncher")
    config.max_repeats = MIN_REPEATS_FOR_TARGET
    check(config, "hydra._internal.core_plugins.basic_launcher.BasicLauncher")


@pytest.mark.parametrize(("noise", "launched"), [("quiet", [0, 2]), ("contended", [0, 2, 4, 6])])
def test_a_sweep_with_no_ratio_to_sample_stops_unless_its_runs_were_set_aside(
    monkeypatch: pytest.MonkeyPatch, noise: str, launched: list[int]
) -> None:
    """More repeats cannot give a ratio to configurations the report does not compare: the
    sweep says so and stops at the least repeats instead of spending max_repeats. Runs set aside
    because other work shared the machine are no such proof: it samples on (a neighbour made
    every run of a precision-target sweep contended, and it stopped after 2 of 5 repeats)."""
    config = OmegaConf.create({"compare": "repeats", "precision_target": 0.02, "repeats": 1,
                               "max_repeats": 4, "seed": 0, "repeat_seed": "vary",
                               "mlflow": {"tracking_uri": "sqlite:///unused.db"}})  # fmt: skip
    jobs = [["optimizer.lr=0.1"], ["optimizer.lr=0.2"]]
    records = [
        query.RunRecord(
            f"run{i}",
            f"lr={lr}",
            "FINISHED",
            tags={NOISE: noise},
            params={"optimizer.lr": lr, "world_size": "1", "precision": "fp32"},
            metrics={THROUGHPUT: 100.0},
        )
        for i, lr in enumerate(["0.1", "0.2"])
    ]
    monkeypatch.setattr(query, "child_runs", lambda uri, run_id: records)
    started: list[int] = []
    parent = types.SimpleNamespace(run_id="parent")
    repeats = by_repeat.Repeats(
        config, jobs, lambda batch, n: started.append(n), lambda o: config, parent
    )
    repeats.run()
    assert started == launched  # two configurations a repeat


def test_a_process_bias_is_inside_the_interval_across_incarnations() -> None:
    """Three incarnations whose processes ran 0 %, +6 % and -6 % apart for their whole life:
    each alone is precise and wrong; across them the interval holds 1.0 and says so."""
    noise = [0.001 * math.sin(k) for k in range(40)]  # a small round-to-round jitter
    incarnations = [[(100 * bias * (1 + e), 100.0) for e in noise] for bias in (1.0, 1.06, 0.94)]
    alone = stats.lockstep_ratio(incarnations[1:2])
    assert not alone.contains(1.0) and "not in the interval" in alone.method
    across = stats.lockstep_ratio(incarnations)
    assert across.contains(1.0) and across.method.startswith("lockstep: t over 3 incarnations")


def test_jobs_that_set_the_heap_unlike_do_not_share_a_process(compose_cfg) -> None:
    """glibc's thresholds are the process's: a sweep of speed.heap is lockstep in a process per
    job (auto), never in one that would run both sides with one heap."""
    pinned, dynamic = compose_cfg("speed.heap=pinned"), compose_cfg("speed.heap=dynamic")
    assert together.why_not([pinned, pinned]) == ""
    assert "speed.heap=dynamic,pinned" in together.why_not([pinned, dynamic])


def test_jobs_that_would_not_fit_one_gpu_together_are_refused() -> None:
    """Forecast peaks (CUDA contexts included) add up: under the GPU's memory they start, over
    it the message names each job's share and what to do."""
    fits = {"precision=fp32": 30 * 1024.0, "precision=bf16": 20 * 1024.0}
    assert memory_problem(fits, device_mb=64 * 1024.0) == ""
    problem = memory_problem(fits, device_mb=40 * 1024.0)
    assert "adds up to 50.0 GiB (precision=fp32 30.0 GiB, precision=bf16 20.0 GiB" in problem
    assert "Use compare=repeats" in problem
