"""The autotune loop: its decisions against intervals computed here by hand, a real loop at the
tiniest size through run.py, and a rejected override that later verdicts leave out."""

from __future__ import annotations

import json
import math
import platform
import statistics
from pathlib import Path

import numpy as np
import pytest
from conftest import new_store, output_of, run_here
from matplotlib.container import ErrorbarContainer
from mlflow import MlflowClient
from scipy import stats as scipy_stats

from accelexp import record
from accelexp.autotune import AutotunePath, Candidate, Step, decide, merged
from accelexp.autotune.loop import MIN_QUIET_PAIRS
from accelexp.autotune.path import (
    ARTIFACTS,
    PATH_JSON,
    PATH_PLOT,
    PATH_TABLE,
    console,
    path_figure,
    table,
)
from accelexp.schema import AutotuneConfig
from accelexp.tracking.query import RunRecord

TOLERANCE = 0.01
# a model so small that each step's fixed costs outweigh its arithmetic: overhead-bound, whose
# verdict's first advice is a doubled batch (more work for the same per-step costs)
TINY = (
    "data=synthetic",
    "data.num_train=1024",
    "data.num_test=64",
    "data.image_size=8",
    "data.batch_size=16",
    "model=mlp",
    "model.widths=[16]",
    "max_steps_per_epoch=24",
    "progress=false",
)


def by_hand(numerator: list[float], denominator: list[float]) -> tuple[float, float]:
    """The paired 95 % interval of a ratio: a t interval of the log ratios, taken back."""
    logs = np.log(np.array(numerator) / np.array(denominator))
    half = scipy_stats.t.ppf(0.975, logs.size - 1) * logs.std(ddof=1) / math.sqrt(logs.size)
    return math.exp(logs.mean() - half), math.exp(logs.mean() + half)


def made_run(name: str, index: int, throughput: float, acc: float, status: str = "FINISHED"):
    """A run as the store gives it back: one epoch of 50 timed steps, repeat `index` of a sweep."""
    return RunRecord(
        run_id=f"{name}{index}",
        name=name,
        status=status,
        tags={record.REPEAT_INDEX: str(index), record.PARENT_RUN: "sweep", record.REPEATS: "3"},
        metrics={record.THROUGHPUT: throughput, record.TIMED_STEPS: 50, record.TEST_ACC: acc},
        histories={record.SAMPLES_PER_S: [(1, throughput)]},
    )


BASE = [100.0, 112.0, 95.0]


@pytest.mark.parametrize(
    ("speeds", "accs", "status"),
    [
        ([131.0, 150.0, 122.0], [0.80] * 3, "FINISHED"),  # faster beyond doubt, as accurate
        ([104.0, 108.0, 99.0], [0.80] * 3, "FINISHED"),  # within the noise
        ([131.0, 150.0, 122.0], [0.78] * 3, "FINISHED"),  # faster, 0.02 less accurate
        ([131.0, 150.0, 122.0], [0.80] * 3, "FAILED"),
    ],
    ids=["faster", "no-difference", "less-accurate", "failed"],
)
def test_a_candidate_is_kept_when_its_interval_lies_above_one_at_the_same_accuracy(
    speeds: list[float], accs: list[float], status: str
) -> None:
    base = [made_run("base", i, s, 0.80) for i, s in enumerate(BASE)]
    runs = [
        made_run("cand", i, s, a, status) for i, (s, a) in enumerate(zip(speeds, accs, strict=True))
    ]
    step = Step(1, [], Candidate("precision=bf16", "half-width arithmetic"), runs, base)
    decide(step, TOLERANCE)

    low, high = by_hand(speeds, BASE)
    accurate = np.mean(accs) >= 0.80 - TOLERANCE
    assert step.kept == (status == "FINISHED" and low > 1 and accurate), step.why
    if status == "FINISHED":
        assert step.speedup.low == pytest.approx(low) and step.speedup.high == pytest.approx(high)
    else:
        assert step.speedup is None and "did not finish (FAILED)" in step.why


def test_the_path_draws_every_candidate_with_its_interval_and_ends_with_a_line_to_paste() -> None:
    base = [made_run("base", i, s, 0.80) for i, s in enumerate(BASE)]

    def measured(override: str, speeds: list[float], status: str = "FINISHED") -> Step:
        runs = [made_run(override, i, s, 0.80, status) for i, s in enumerate(speeds)]
        step = Step(1, [], Candidate(override, "advised"), runs, base)
        decide(step, TOLERANCE)
        return step

    start = ["+experiment=autotune", "model=mlp", "repeats=3", "autotune.max_trials=7"]
    path = AutotunePath(list(start), list(start), stopped="none of the 3 candidate(s) helped")
    path.steps = [
        measured("precision=bf16", [104.0, 108.0, 99.0]),  # within the noise
        measured("threads=1", [80.0, 90.0, 75.0]),  # slower
        measured("data.batch_size=32", [131.0, 150.0, 122.0], "FAILED"),
    ]
    (axes,) = path_figure(path).axes
    bars = [
        list(segment[:, 1])
        for container in axes.containers
        if isinstance(container, ErrorbarContainer)
        for segment in container.lines[2][0].get_segments()
    ]
    for step in path.steps[:2]:  # each measured candidate at its speedup, with its interval
        assert [step.speedup.low, step.speedup.high] in [pytest.approx(bar) for bar in bars]
    assert "data.batch_size=32: not measured" in {text.get_text() for text in axes.texts}

    said = console(path, Path("autotune")).splitlines()
    assert said[-1] == "Keep the start: python run.py model=mlp"  # the sweep's keys left out
    assert any(line.startswith("Undecided") and "precision=bf16" in line for line in said)
    assert "threads=1" not in next(line for line in said if line.startswith("Undecided"))
    assert "run it: `python run.py model=mlp`" in table(path)

    path.steps.append(measured("precision=bf16", [131.0, 150.0, 122.0]))
    path.steps[-1].chosen = True
    path.best = merged(path.best, "precision=bf16")
    assert console(path, Path("autotune")).splitlines()[-1] == (
        "Run it: python run.py model=mlp precision=bf16"
    )


def test_in_lockstep_a_candidate_is_decided_by_its_rounds_from_one_repeat() -> None:
    """compare=lockstep: one repeat of base and candidate in one process, slices paired round by
    round, decides (repeats would need MIN_QUIET_PAIRS); the interval is the batch means of the
    rounds' log ratios, computed here by hand."""
    rounds = range(16)
    base = [100.0 * (1 + 0.2 * math.sin(r)) for r in rounds]  # the host drifts; both alike
    faster = [b * 1.1 * (1 + 0.01 * math.cos(3 * r)) for r, b in zip(rounds, base, strict=True)]

    def lockstep_run(name: str, rates: list[float]) -> RunRecord:
        run = made_run(name, 0, statistics.fmean(rates), 0.80)
        run.tags |= {record.COMPARE: record.COMPARE_LOCKSTEP,
                     record.LOCKSTEP_PROCESS: record.PROCESS_SHARED}  # fmt: skip
        run.histories[record.LOCKSTEP_SAMPLES_PER_S] = list(enumerate(rates))
        return run

    step = Step(1, [], Candidate("data.batch_size=64", "overhead"),
                [lockstep_run("candidate", faster)], [lockstep_run("base", base)])  # fmt: skip
    decide(step, TOLERANCE)
    logs = np.log(np.array(faster) / np.array(base))
    batches = logs.reshape(4, 4).mean(axis=1)  # 16 rounds: 4 batches of 4
    half = scipy_stats.t.ppf(0.975, 3) * batches.std(ddof=1) / 2
    low, high = math.exp(batches.mean() - half), math.exp(batches.mean() + half)
    assert (step.speedup.low, step.speedup.high) == pytest.approx((low, high), rel=1e-9)
    assert step.kept and "lockstep in one process: 1 incarnation, 16 rounds" in step.why, step.why


def test_a_candidate_replaces_the_same_keys_of_its_base() -> None:
    base = ["+experiment=autotune", "precision=fp32", "threads=2"]
    assert merged(base, "parallelism=ddp parallelism.nprocs=2 threads=1") == [
        "+experiment=autotune",
        "precision=fp32",
        "parallelism=ddp",
        "parallelism.nprocs=2",
        "threads=1",
    ]


def test_autotune_follows_the_verdict_and_decides_by_the_measured_interval(
    tmp_path: Path, mlflow_template_db: Path
) -> None:
    """Round 0 runs the base for its verdict (overhead-bound: a doubled batch first); round 1
    measures the base and the candidate 3 times each, interleaved; then max_trials stops it.
    Every decision is checked against the interval computed here from the runs' figures."""
    uri = new_store(tmp_path, mlflow_template_db)
    result = run_here(
        None,
        "-m",
        "+experiment=autotune",
        *TINY,
        "repeats=3",
        "autotune.max_trials=7",
        f"mlflow.tracking_uri={uri}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert result.returncode == 0, output_of(result)[-3000:]
    path = json.loads((tmp_path / "sweep" / ARTIFACTS / PATH_JSON).read_text())
    assert path["trials"] == 7, path

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("autotune").experiment_id
    every = client.search_runs([experiment])
    (parent,) = [r for r in every if r.data.tags.get(record.SWEEP_PARENT) == "true"]
    trials = {r.info.run_id: r for r in every if r is not parent}
    assert len(trials) == 7
    assert {r.data.tags[record.PARENT_RUN] for r in trials.values()} == {parent.info.run_id}
    assert parent.data.tags[record.AUTOTUNE_BEST] == path["found"]
    logged = {a.path for a in client.list_artifacts(parent.info.run_id, ARTIFACTS)}
    assert logged == {f"{ARTIFACTS}/{name}" for name in (PATH_TABLE, PATH_JSON, PATH_PLOT)}

    (step,) = path["steps"]
    runs = [trials[i] for i in step["runs"]]
    base_runs = [trials[i] for i in step["base_runs"]]
    (first,) = [r for r in trials.values() if r.data.tags[record.AUTOTUNE_ROUND] == "0"]
    advised = json.loads(first.data.tags[record.DIAGNOSIS_ADVICE])
    assert step["candidate"] == advised[0][0], advised  # the verdict's first advice
    for run in runs:
        assert run.data.tags[record.AUTOTUNE_CANDIDATE] == step["candidate"]
        assert run.data.tags[record.AUTOTUNE_DECISION] == step["decision"]
        assert run.data.tags[record.AUTOTUNE_BASE_SETTING] == first.data.tags[record.SETTING_ID]
    accs = [np.mean([r.data.metrics[record.TEST_ACC] for r in side]) for side in (runs, base_runs)]
    accurate = accs[0] >= accs[1] - AutotuneConfig().accuracy_tolerance
    mine, theirs = (throughputs(side, quiet=True) for side in (runs, base_runs))
    if len(mine.keys() & theirs.keys()) < MIN_QUIET_PAIRS:  # a shared machine: every pair
        mine, theirs = (throughputs(side, quiet=False) for side in (runs, base_runs))
        assert "what a pair shared cancels" in step["why"], step
    common = sorted(mine.keys() & theirs.keys())
    low, high = by_hand([mine[i] for i in common], [theirs[i] for i in common])
    assert (step["speedup_low"], step["speedup_high"]) == pytest.approx((low, high), rel=1e-3)
    assert (step["decision"] == record.AUTOTUNE_KEPT) == (low > 1 and accurate), step
    kept = step["decision"] == record.AUTOTUNE_KEPT
    assert path["found"] == (step["candidate"] if kept else ""), path
    # kept: a second round has no room within max_trials; rejected: nothing else was tried
    assert ("max_trials=7" if kept else "none of the 1 candidate(s)") in path["stopped"], path
    table = (tmp_path / "sweep" / ARTIFACTS / PATH_TABLE).read_text()
    assert f"`{step['candidate']}`" in table and step["why"] in table
    assert "Autotune stopped" in output_of(result)


@pytest.mark.alone  # slices a neighbour shared are set aside: no other test beside it
def test_autotune_in_lockstep_pairs_its_candidate_round_by_round(
    tmp_path: Path, mlflow_template_db: Path
) -> None:
    """compare=lockstep: round 1's base and candidate run as live jobs taking turns, and the
    decision pairs their slices (the path says how); every trial is a lockstep run."""
    uri = new_store(tmp_path, mlflow_template_db)
    result = run_here(
        None, "-m", "+experiment=autotune", *TINY, "repeats=2", "autotune.max_trials=5",
        "compare=lockstep", "lockstep.slice_steps=2", "lockstep.warmup_rounds=0",
        f"mlflow.tracking_uri={uri}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )  # fmt: skip
    assert result.returncode == 0, output_of(result)[-3000:]
    path = json.loads((tmp_path / "sweep" / ARTIFACTS / PATH_JSON).read_text())
    (step,) = path["steps"]
    assert step["paired"].startswith("lockstep"), step
    client = MlflowClient(uri)
    trials = client.search_runs([client.get_experiment_by_name("autotune").experiment_id])
    tags = [r.data.tags for r in trials if record.AUTOTUNE_ROUND in r.data.tags]
    assert len(tags) == 5 and {t[record.COMPARE] for t in tags} == {record.COMPARE_LOCKSTEP}


def throughputs(runs: list, quiet: bool) -> dict[str, float]:
    """The steady throughput of each run by repeat index (what a ratio pairs); with `quiet`,
    only those not timed on a shared machine (`noise`)."""
    return {
        r.data.tags[record.REPEAT_INDEX]: r.data.metrics[record.THROUGHPUT]
        for r in runs
        if not quiet or r.data.tags[record.NOISE] == record.NOISE_QUIET
    }


def test_an_override_autotune_rejected_is_not_offered_again_on_that_setting(
    tmp_path: Path, mlflow_template_db: Path
) -> None:
    """A verdict of a setting on this host leaves out what autotune measured there and
    rejected (looked up in the store by the setting's id), and says so in its evidence; the
    same run is advised it when the store holds no such decision."""
    uri = new_store(tmp_path, mlflow_template_db)

    def verdict_of_a_run(folder: str) -> tuple[dict[str, str], str]:
        """(the tags, the id) of a real run at the tiny size, in `folder`: input-bound on any
        machine (each batch waits 30 ms), so both runs get the same verdict."""
        args = (*TINY, "epochs=1", "debug.input_delay_ms=30", f"mlflow.tracking_uri={uri}")
        result = run_here(None, *args, f"hydra.run.dir={tmp_path / folder}")
        assert result.returncode == 0, output_of(result)[-3000:]
        runs = client.search_runs([client.get_experiment_by_name("accelexp").experiment_id])
        (run,) = [r for r in runs if r.data.tags.get(record.OUTPUT_DIR, "").endswith(folder)]
        return run.data.tags, run.info.run_id

    client = MlflowClient(uri)
    tags, _ = verdict_of_a_run("first")
    advised = [override for override, _ in json.loads(tags[record.DIAGNOSIS_ADVICE])]
    rejected = advised[0]
    trial = client.create_run(client.get_experiment_by_name("accelexp").experiment_id)
    for key, value in {
        record.AUTOTUNE_CANDIDATE: rejected,
        record.AUTOTUNE_DECISION: record.AUTOTUNE_REJECTED,
        record.AUTOTUNE_WHY: "no measurable difference: 1.01× (0.93–1.10)",
        record.AUTOTUNE_BASE_SETTING: tags[record.SETTING_ID],
        record.HOST: platform.node(),
    }.items():
        client.set_tag(trial.info.run_id, key, value)
    client.set_terminated(trial.info.run_id)

    tags, run_id = verdict_of_a_run("second")
    advice = [override for override, _ in json.loads(tags[record.DIAGNOSIS_ADVICE])]
    assert advice == [o for o in advised if o != rejected]
    diagnosis = Path(client.download_artifacts(run_id, "diagnosis.md", str(tmp_path)))
    assert f"autotune measured {rejected} here and rejected it" in diagnosis.read_text()
