"""The report: numbers computed by hand from known histories, read back from a real SQLite store.

The store is written with MlflowClient the way accelexp writes it (tags, params, per-epoch
histories, final metrics, a sweep parent with children, a FAILED child with error.txt). Every
first epoch is deliberately off (warm-up), so a report that does not skip it gets other numbers.
Real tiny runs (`accelexp.train.run`) check that a one-epoch run's throughput is steady-state or
not reported at all.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import new_store
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, Run

from accelexp.report import (
    BRIEF_WIDTH,
    MIN_STEADY_STEPS,
    BaselineError,
    compare,
    diagnose,
    main,
    measure,
    throughput,
    to_csv,
    to_json,
    to_markdown,
    write_sweep_report,
)
from accelexp.report.cli import sweep_title
from accelexp.report.compare import everything_set_aside, sweep_baseline
from accelexp.tracking import query
from accelexp.tracking.query import RunRecord
from accelexp.train import run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPORT_FILES = {
    "summary.csv",
    "summary.md",
    "report.html",
    "throughput.png",
    "efficiency.png",
    "amp_gain.png",
    "accuracy_vs_time.png",
}


# --- the store ----------------------------------------------------------------------------------
@dataclass
class Job:
    """One job's run: samples/s per epoch (epoch 1 is warm-up), peak memory per epoch."""

    name: str
    parallelism: str
    world_size: int
    precision: str
    samples_per_s: list[float]
    status: str = "FINISHED"
    peak_mem_mb: list[float] | None = None
    timed_steps: int = 20  # per epoch, as the engine logs it
    final: dict[str, float] = field(
        default_factory=lambda: {"best_val_acc": 0.9, "test_acc": 0.88, "total_time_s": 40.0}
    )


REACHED = {"best_val_acc": 0.72, "test_acc": 0.71, "total_time_s": 40.0, "time_to_target_s": 25.0}
DDP_SWEEP = [  # medians of epochs 2..: 100, 155, 180, 290
    Job("ddp1-fp32", "ddp", 1, "fp32", [50, 100, 110, 90], peak_mem_mb=[100, 120, 110, 115],
        final=REACHED),
    Job("ddp1-amp", "ddp", 1, "amp", [80, 150, 160], peak_mem_mb=[60, 70, 65]),
    Job("ddp2-fp32", "ddp", 2, "fp32", [10, 180, 190, 170]),
    Job("ddp2-amp", "ddp", 2, "amp", [20, 300, 280, 290]),
    Job("ddp4-fp32", "ddp", 4, "fp32", [333], status="FAILED"),
]  # fmt: skip
LONE = Job("single-fp32", "single", 1, "fp32", [30, 90])
TWO_WORKERS_SWEEP = [
    Job("ws2-fp32", "ddp", 2, "fp32", [5, 200, 200]),
    Job("ws2-amp", "ddp", 2, "amp", [5, 300, 300]),
]


def log_job(
    client: MlflowClient, experiment_id: str, job: Job, start: int, parent: Run | None = None
) -> str:
    """`job`'s run as accelexp logs it (a child of `parent` when given); returns its id."""
    tags = {
        "parallelism": job.parallelism,
        "precision": job.precision,
        "model": "simple_cnn",
        "data": "synthetic",
        "world_size": str(job.world_size),
    }
    if parent is not None:
        tags |= {"mlflow.parentRunId": parent.info.run_id, "sweep": parent.info.run_name}
    run_id = client.create_run(experiment_id, start, tags, job.name).info.run_id
    params = {
        "world_size": job.world_size,
        "parallelism.name": job.parallelism,
        "parallelism.nprocs": job.world_size,
        "precision.name": job.precision,
        "model.name": "simple_cnn",
        "data.name": "synthetic",
    }
    peaks = job.peak_mem_mb or [100.0] * len(job.samples_per_s)
    metrics = []
    for epoch, (samples, peak) in enumerate(zip(job.samples_per_s, peaks, strict=True), 1):
        at = start + epoch
        metrics += [
            Metric("samples_per_s", samples, at, epoch),
            Metric("val_acc", 0.5 + 0.1 * epoch, at, epoch),
            Metric("elapsed_s", 10.0 * epoch, at, epoch),
            Metric("peak_mem_mb", peak, at, epoch),
            Metric("timed_steps", job.timed_steps, at, epoch),
        ]
    if job.status == "FINISHED":
        metrics += [Metric(k, v, start + 99, 0) for k, v in job.final.items()]
    client.log_batch(run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in params.items()])
    client.set_terminated(run_id, status=job.status)
    return run_id


def log_sweep(
    client: MlflowClient, experiment_id: str, name: str, start: int, grid: dict, jobs: list[Job]
) -> tuple[str, dict[str, str]]:
    """A sweep's parent run and its children; returns (parent id, {job name: run id})."""
    tags = {"accelexp.sweep": "true", "sweep_dir": f"outputs/multirun/{name}"}
    parent = client.create_run(experiment_id, start, tags, name)
    client.log_batch(parent.info.run_id, params=[Param(k, v) for k, v in grid.items()])
    client.set_terminated(parent.info.run_id)
    ids = {}
    for i, job in enumerate(jobs, 1):
        ids[job.name] = log_job(client, experiment_id, job, start + i, parent)
    return parent.info.run_id, ids


@pytest.fixture(scope="module")
def store(tmp_path_factory, mlflow_template_db):
    """Experiments `scaling` (DDP_SWEEP, whose last job FAILED, and the LONE run, newer than the
    sweep), `other` (the newest sweep: two workers only, so no default baseline) and `empty`."""
    home = tmp_path_factory.mktemp("report-store")
    uri = new_store(home, mlflow_template_db)
    client = MlflowClient(tracking_uri=uri)

    def experiment(name: str) -> str:
        return client.create_experiment(name, (home / "mlartifacts" / name).as_uri())

    scaling, other = experiment("scaling"), experiment("other")
    experiment("empty")
    grid = {"parallelism.nprocs": "1,2", "precision": "fp32,amp"}
    sweep, ids = log_sweep(client, scaling, "ddp-sweep", 1000, grid, DDP_SWEEP)
    error = home / "error.txt"
    error.write_text("RuntimeError: worker 3 ran out of memory\n")
    client.log_artifact(ids["ddp4-fp32"], str(error))
    ids[LONE.name] = log_job(client, scaling, LONE, start=5000)
    two = {"precision": "fp32,amp"}
    newest, _ = log_sweep(client, other, "ws2-only", 2000, two, TWO_WORKERS_SWEEP)
    return {"uri": uri, "sweep": sweep, "newest": newest, "ids": ids}


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# --- compare(): pure, on hand-made records ------------------------------------------------------
def record(
    name,
    parallelism,
    world_size,
    precision,
    samples,
    *,
    model="m",
    status="FINISHED",
    start=0,
    timed_steps: int | None = 20,
    params: dict[str, str] | None = None,
    device: str | None = None,
    tags: dict[str, str] | None = None,
    metrics: dict[str, float] | None = None,
) -> RunRecord:
    """A run as `query` reads it back; `timed_steps` None: logged before the engine logged it."""
    timed = {} if timed_steps is None else {"timed_steps": float(timed_steps)}
    return RunRecord(
        run_id=f"id-{name}",
        name=name,
        status=status,
        start_time=start,
        tags={
            "parallelism": parallelism,
            "precision": precision,
            "model": model,
            "data": "d",
            "world_size": str(world_size),
        }
        | ({"device": device} if device else {})
        | (tags or {}),
        params=params or {},
        metrics={"best_val_acc": 0.9, "test_acc": 0.85, **timed, **(metrics or {})},
        histories={"samples_per_s": list(enumerate(samples, start=1))},
    )


def test_throughput_is_the_median_after_the_first_epoch_else_the_steady_first_epoch():
    assert throughput(record("a", "ddp", 1, "fp32", [1000, 10, 30, 20])) == 20
    assert throughput(record("b", "ddp", 1, "fp32", [1000, 10])) == 10
    assert throughput(record("c", "ddp", 1, "fp32", [7])) == 7  # one epoch, warm-up left out
    assert measure(record("d", "ddp", 1, "fp32", [])) == (None, "no samples_per_s logged")


@pytest.mark.parametrize(
    ("samples", "timed_steps", "steady"),
    [([7], 9, 9), ([1000, 7], 5, 5), ([1000, 7, 7], 4, 8)],  # the epochs after the first count
)
def test_a_run_with_too_few_steady_steps_has_no_throughput_but_a_note(samples, timed_steps, steady):
    value, why = measure(record("short", "ddp", 1, "fp32", samples, timed_steps=timed_steps))
    assert value is None
    assert why == (
        f"too short to measure: {steady} steady steps, need ≥ {MIN_STEADY_STEPS} "
        f"(raise max_steps_per_epoch or epochs)"
    )
    assert throughput(record("enough", "ddp", 1, "fp32", [1000, 7, 7], timed_steps=5)) == 7


def test_a_one_epoch_run_logged_before_timed_steps_is_not_measured_a_longer_one_is():
    value, why = measure(record("old", "ddp", 1, "fp32", [7], timed_steps=None))
    assert value is None and "its only epoch includes warm-up" in why
    assert throughput(record("old2", "ddp", 1, "fp32", [1000, 9], timed_steps=None)) == 9


def test_each_parallelism_is_compared_with_its_own_one_worker_run():
    rows = compare(
        [
            record("hvd2", "horovod", 2, "fp32", [1, 120, 120]),
            record("ddp1", "ddp", 1, "fp32", [1, 100, 100], start=5),  # the newest baseline
            record("hvd1", "horovod", 1, "fp32", [1, 80, 80]),
            record("ddp2", "ddp", 2, "fp32", [1, 180, 180]),
        ]
    )
    by_name = {row.run_name: row for row in rows}
    assert [row.run_name for row in rows] == ["ddp1", "ddp2", "hvd1", "hvd2"]
    assert by_name["hvd2"].baseline_run == "hvd1"
    assert by_name["hvd2"].speedup == pytest.approx(1.5)  # 120/80, not 120/100
    assert by_name["hvd2"].scaling_efficiency == pytest.approx(0.75)
    assert by_name["ddp2"].baseline_run == "ddp1"
    assert by_name["ddp2"].speedup == pytest.approx(1.8)
    assert by_name["ddp2"].scaling_efficiency == pytest.approx(0.9)


def test_a_baseline_of_the_same_model_wins_over_the_same_parallelism():
    rows = compare(
        [
            record("big-single", "single", 1, "fp32", [1, 50, 50], model="big"),
            record("small-ddp1", "ddp", 1, "fp32", [1, 400, 400], model="small"),
            record("big-ddp2", "ddp", 2, "fp32", [1, 90, 90], model="big"),
        ]
    )
    big = next(row for row in rows if row.run_name == "big-ddp2")
    assert big.baseline_run == "big-single"
    assert big.speedup == pytest.approx(1.8)


def test_baseline_keys_can_name_any_world_size_and_mixed_precision_gain_needs_same_world():
    rows = compare(
        [
            record("fp32-2", "ddp", 2, "fp32", [0, 200]),
            record("bf16-2", "ddp", 2, "bf16", [0, 300]),
            record("bf16-4", "ddp", 4, "bf16", [0, 500]),
        ],
        "world_size=2,precision=fp32",
    )
    by_name = {row.run_name: row for row in rows}
    assert by_name["bf16-2"].amp_gain == pytest.approx(1.5)
    assert by_name["bf16-4"].amp_gain is None  # no fp32 run with 4 workers
    assert by_name["bf16-4"].speedup == pytest.approx(2.5)
    assert by_name["bf16-4"].scaling_efficiency == pytest.approx(1.25)  # 2.5 / (4/2)
    assert by_name["fp32-2"].amp_gain is None


def test_no_baseline_is_an_error_listing_the_configurations_unless_lenient():
    records = [record("two", "ddp", 2, "fp32", [0, 200]), record("amp", "ddp", 2, "amp", [0, 3])]
    with pytest.raises(BaselineError) as raised:
        compare(records)
    message = str(raised.value)
    assert "world_size=1,precision=fp32" in message
    assert "parallelism=ddp world_size=2 precision=fp32" in message
    assert "precision=amp" in message
    rows = compare(records, strict=False)
    assert [r.speedup for r in rows] == [None, None]
    assert rows[1].amp_gain == pytest.approx(3 / 200)


def test_a_sweeps_own_ratios_are_taken_against_its_first_run_over_what_varies():
    """`precision_target` reads the sweep's ratios: a sweep of a speed switch at bf16 has them
    (the report's default baseline, fp32, matches none of its runs); an A/A sweep too."""
    r0 = {"repeat_index": "0"}
    runs = [
        record("cl", "single", 1, "bf16", [0, 330], start=2, tags={"speed": "channels_last", **r0}),
        record("eager", "single", 1, "bf16", [0, 300], start=1, tags=r0),
    ]  # fmt: skip
    assert sweep_baseline(runs) == {"speed": "eager"}
    by_name = {row.run_name: row for row in compare(runs, sweep_baseline(runs))}
    assert by_name["cl"].speedup == pytest.approx(1.1)
    assert [r.speedup for r in compare(runs, strict=False)] == [None, None]
    assert sweep_baseline(runs[1:]) == {"world_size": "1", "precision": "bf16"}


def test_a_failed_baseline_does_not_count():
    records = [
        record("one", "ddp", 1, "fp32", [0, 100], status="FAILED"),
        record("two", "ddp", 2, "fp32", [0, 200]),
    ]
    with pytest.raises(BaselineError, match=r"not finished with a throughput: one"):
        compare(records)


SETUP = {"epochs": "3", "data.batch_size": "128", "data.image_size": "32", "optimizer.name": "sgd"}


def test_a_mixed_experiment_compares_like_for_like_only_and_says_why_not():
    """Runs that differ in more than the study varies are not compared; the note names the
    nearest run and what differs. Tracking, seed and progress keys never count."""

    def setup(**changes: str) -> dict[str, str]:
        return {**SETUP, "parallelism.nprocs": "1", "precision.init_scale": "65536", **changes}

    records = [
        record("base", "ddp", 1, "fp32", [1, 100, 100], params=setup(seed="1")),
        record("two", "ddp", 2, "fp32", [1, 180, 180], params=setup(**{"parallelism.nprocs": "2",
               "mlflow.run_name": "two", "seed": "2", "progress": "False"})),
        record("amp", "ddp", 1, "amp", [1, 150, 150], params=setup(**{"precision.init_scale":
               "1024"})),
        record("short", "ddp", 2, "fp32", [1, 200], params=setup(epochs="1")),
        record("bigger", "ddp", 2, "amp", [1, 300, 300],
               params=setup(**{"data.batch_size": "256", "parallelism.nprocs": "2"})),
        record("resnet", "ddp", 2, "bf16", [1, 50, 50], model="resnet", params=setup(
               **{"data.image_size": "64", "epochs": "5", "optimizer.name": "adamw",
                  "data.batch_size": "64", "parallelism.nprocs": "2"})),
    ]  # fmt: skip
    rows = {row.run_name: row for row in compare(records)}
    assert rows["two"].speedup == pytest.approx(1.8) and rows["two"].note == ""
    assert rows["amp"].speedup == pytest.approx(1.5)  # precision may differ from the baseline's
    assert rows["amp"].amp_gain == pytest.approx(1.5)  # precision.* may differ too
    assert rows["short"].speedup is None and rows["short"].scaling_efficiency is None
    assert rows["short"].note == (
        "no like-for-like baseline: nearest (base) differs in epochs (1 vs 3)"
    )
    bigger = rows["bigger"]
    assert (bigger.speedup, bigger.amp_gain) == (None, None)
    assert bigger.note == (
        "no like-for-like baseline: nearest (base) differs in data.batch_size (256 vs 128); "
        "no like-for-like fp32 run: nearest (two) differs in data.batch_size (256 vs 128)"
    )
    assert rows["resnet"].note.startswith(
        "no like-for-like baseline: nearest (base) differs in model (resnet vs m), "
        "data.batch_size (64 vs 128), data.image_size (64 vs 32), epochs (5 vs 3) and 1 more; "
    )
    assert "no like-for-like fp32 run: nearest (two) differs in model (resnet vs m)" in (
        rows["resnet"].note
    )
    markdown = to_markdown(compare(records))
    assert "Figures left blank, and why:" in markdown
    assert "- short: no like-for-like baseline: nearest (base) differs in epochs (1 vs 3)" in (
        markdown
    )
    assert json.loads(to_json(compare(records)))[-1]["note"]  # json and csv carry the notes


def test_runs_on_other_devices_are_not_compared_and_the_device_is_a_column():
    asked = {"device": "auto", "device_type": "cuda"}  # the device asked for is not compared
    rows = compare(
        [
            record("cpu", "single", 1, "fp32", [1, 10], device="cpu", params=asked),
            record("h200", "ddp", 2, "fp32", [1, 900], device="NVIDIA H200", params=asked),
            record("old", "ddp", 2, "amp", [1, 20], params={"device": "cuda"}),  # no device tag
        ]
    )
    assert [row.device for row in rows] == ["cpu", "NVIDIA H200", ""]
    assert rows[1].note == (
        "no like-for-like baseline: nearest (cpu) differs in device (NVIDIA H200 vs cpu)"
    )
    assert rows[2].speedup == 2.0  # what only one of two runs logged is not compared


def test_a_like_for_like_baseline_too_short_to_measure_is_named():
    rows = compare(
        [
            record("base", "ddp", 1, "fp32", [1000, 100], timed_steps=5, start=1),
            record("two", "ddp", 2, "fp32", [1000, 180, 180], timed_steps=20),
        ],
    )
    assert rows[0].note.startswith("too short to measure: 5 steady steps")
    assert rows[1].speedup is None
    assert rows[1].note == (
        "the like-for-like baseline, base, has no throughput: too short to measure: 5 steady "
        "steps, need ≥ 10 (raise max_steps_per_epoch or epochs)"
    )


@pytest.mark.parametrize("selector", ["workers=1", "world_size", "=1", ""])
def test_a_malformed_baseline_names_the_allowed_keys(selector):
    with pytest.raises(BaselineError, match="world_size, precision, parallelism, model, data"):
        compare([record("a", "ddp", 1, "fp32", [1])], selector)


# --- reading the store --------------------------------------------------------------------------
# --- repeats, intervals and contention -----------------------------------------------------------
T_975_2 = 4.302652729749464  # Student's t, 97.5 % quantile, 2 degrees of freedom


def repeat(precision, index, samples_per_s, *, contended="", test_acc=0.85, sweep="parent-1"):
    """Repeat `index` of `precision` in a sweep run with repeats=3, as the engine logs it."""
    tags = {
        "repeats": "3",
        "repeat_index": str(index),
        "config_id": f"cfg-{precision}",
        "mlflow.parentRunId": sweep,
    }
    if contended:
        tags |= {"noise": "contended", "noise_evidence": contended}
    return record(
        f"r{index + 1} {precision} m-single", "single", 1, precision, [samples_per_s] * 2,
        start=10 * index + (precision == "amp"), tags=tags,
        metrics={"throughput": samples_per_s, "test_acc": test_acc},
    )  # fmt: skip


def test_repeats_of_one_configuration_are_one_row_with_intervals_computed_by_hand():
    fp32 = [100.0, 104.0, 98.0]
    amp = [150.0, 160.0, 147.0]
    accuracy = [0.80, 0.84, 0.82]
    records = [
        repeat(p, i, v, test_acc=a)
        for i, (f, m, a) in enumerate(zip(fp32, amp, accuracy, strict=True))
        for p, v in (("fp32", f), ("amp", m))
    ]
    rows = {row.precision: row for row in compare(records)}
    assert sorted(rows) == ["amp", "fp32"] and rows["fp32"].repeats == 3
    base = rows["fp32"]
    assert base.run_name == "fp32 m-single" and base.label == "fp32 m-single ×3"
    # a rate over repeats: t interval of the logs of 100, 104, 98, taken back with exp
    logs = [math.log(100), math.log(104), math.log(98)]
    centre = sum(logs) / 3
    half = T_975_2 * (sum((x - centre) ** 2 for x in logs) / 2) ** 0.5 / 3**0.5
    assert base.samples_per_s == pytest.approx(math.exp(centre))  # the geometric mean
    assert (base.samples_per_s_low, base.samples_per_s_high) == pytest.approx(
        (math.exp(centre - half), math.exp(centre + half))
    )
    assert base.test_acc == pytest.approx(0.82) and base.test_acc_sd == pytest.approx(0.02)
    # AMP gain paired by repeat index: log ratios of 150/100, 160/104, 147/98
    logs = [0.4054651081081644, 0.4307829160924542, 0.4054651081081644]
    mean = sum(logs) / 3
    sd = (sum((x - mean) ** 2 for x in logs) / 2) ** 0.5
    gain = rows["amp"]
    assert gain.amp_gain == pytest.approx(2.718281828459045**mean)
    assert gain.amp_gain_low == pytest.approx(2.718281828459045 ** (mean - T_975_2 * sd / 3**0.5))
    assert gain.amp_gain_high == pytest.approx(2.718281828459045 ** (mean + T_975_2 * sd / 3**0.5))
    assert gain.speedup == gain.amp_gain  # the fp32 repeats are the baseline too
    assert base.speedup == 1.0
    # --diagnose keeps a row per repeat, a configuration's repeats together
    assert [row.run_name for row in diagnose(records)] == [
        f"r{i} {precision} m-single" for precision in ("fp32", "amp") for i in (1, 2, 3)
    ]  # a repeat's name starts with what differs: its index


def test_a_contended_repeat_is_set_aside_with_its_evidence():
    evidence = "other processes used 1.0 of 2 cores while it was timed"
    records = [
        repeat("fp32", 0, 100.0),
        repeat("fp32", 1, 40.0, contended=evidence),
        repeat("fp32", 2, 102.0),
    ]
    (row,) = compare(records)
    assert row.repeats == 2 and row.samples_per_s == pytest.approx((100.0 * 102.0) ** 0.5)
    assert row.note == f"r2 set aside: contended ({evidence})"
    assert row.noise == ""  # the row's figures are clean


def test_a_contended_run_is_marked_and_left_out_of_every_ratio():
    evidence = "the hypervisor stole 9% of the CPU time"
    quiet = record("fp32", "single", 1, "fp32", [100, 100])
    contended = {"noise": "contended", "noise_evidence": evidence}
    noisy = record("amp", "single", 1, "amp", [300, 300], tags=contended)
    rows = {row.precision: row for row in compare([quiet, noisy])}
    amp = rows["amp"]
    assert amp.samples_per_s == 300 and amp.amp_gain is None and amp.speedup is None
    assert amp.noise == "contended" and amp.label == "amp"  # marked in a column, not the name
    assert amp.note == f"contended ({evidence}); its speed is left out of every ratio"
    # the default table: the mark in a `noise` column of its own, whatever the name's width
    rows["amp"].run_name = "r1 simple_cnn-horovod-np2-amp-with-a-name-longer-than-its-column"
    lines = brief_table([rows["fp32"], rows["amp"]]).splitlines()
    header = next(line for line in lines if "samples/s" in line)
    assert "noise" in header
    marked = [line for line in lines if "contended" in line and "300" in line]
    assert len(marked) == 1 and header.index("noise") <= marked[0].index("contended")
    assert max(len(line) for line in lines) <= BRIEF_WIDTH
    assert "noise" not in brief_table([rows["fp32"]])  # no contended row: no column
    # a contended baseline is no baseline: the other rows say so
    noisy_base = record("fp32", "single", 1, "fp32", [100, 100], tags=contended)
    clean = compare([noisy_base, record("amp2", "single", 1, "amp", [90, 90])])[1]
    assert clean.speedup is None and clean.amp_gain is None
    assert clean.note == (
        "the like-for-like baseline, fp32, has no throughput: contended; "
        "the like-for-like fp32 run, fp32, has no throughput: contended"
    )


def brief_table(rows) -> str:
    """The default rich table of `rows`, as `accelexp-report` prints it into a pipe."""
    from rich.console import Console

    from accelexp.report.formats import RUNS_BRIEF, render_table

    console = Console(width=BRIEF_WIDTH, record=True, file=io.StringIO())
    console.print(render_table(rows, "t", RUNS_BRIEF), width=BRIEF_WIDTH)
    return console.export_text()


def test_when_every_run_was_set_aside_one_line_says_so_and_what_to_do():
    evidence = "other processes used 1.0 of 2 cores while it was timed"
    records = [
        repeat(p, i, v, contended=evidence)
        for i in range(3)
        for p, v in (("fp32", 100.0 + i), ("amp", 150.0 + i))
    ]
    rows = compare(records)
    assert all(row.noise == "contended" and row.speedup is None for row in rows)
    assert [row.note for row in rows] == ["", ""]  # not the evidence once per repeat per row
    line = everything_set_aside(records)
    assert "all 6 runs" in line and line.count(evidence) == 1
    assert "compare=lockstep" in line and "quiet machine" in line
    markdown = to_markdown(rows, summary=line)
    assert markdown.count(evidence) == 1 and line in markdown
    # one quiet run: its rows say what was set aside, and no line is needed
    records[0] = repeat("fp32", 0, 100.0)
    assert everything_set_aside(records) == ""
    assert evidence in compare(records)[0].note


@pytest.mark.parametrize(
    ("speedup", "efficiency"),
    [
        ((1.05, 0.96, 1.16), "no measurable difference (0.48–0.58)"),
        ((1.82, 1.75, 1.90), "0.91 (0.88–0.95)"),
    ],
)
def test_an_efficiency_reads_no_measurable_difference_where_its_speedup_does(speedup, efficiency):
    row = compare([record("fp32", "single", 1, "fp32", [100, 100])])[0]
    row.speedup, row.speedup_low, row.speedup_high = speedup
    row.scaling_efficiency, row.scaling_efficiency_low, row.scaling_efficiency_high = (
        value / 2 for value in speedup
    )
    from accelexp.report.formats import RUNS_BRIEF

    assert RUNS_BRIEF.text(row, "scaling_efficiency") == efficiency
    assert efficiency in to_markdown([row])


@pytest.mark.parametrize(
    ("gain", "cell"),
    [
        ((1.02, 0.97, 1.07), "no measurable difference (0.97–1.07)"),
        ((1.82, 1.75, 1.90), "1.82× (1.75–1.90)"),
    ],
)
def test_a_ratio_whose_interval_includes_one_reads_no_measurable_difference(gain, cell):
    row = compare([record("fp32", "single", 1, "fp32", [100, 100])])[0]
    row.amp_gain, row.amp_gain_low, row.amp_gain_high = gain
    assert cell in to_markdown([row])
    from accelexp.report.formats import RUNS_BRIEF

    assert RUNS_BRIEF.text(row, "amp_gain") == cell


def test_query_reads_sweeps_children_and_histories(store):
    uri = store["uri"]
    children = query.child_runs(uri, store["sweep"])
    assert sorted(r.name for r in children) == [
        "ddp1-amp",
        "ddp1-fp32",
        "ddp2-amp",
        "ddp2-fp32",
        "ddp4-fp32",
    ]
    runs = query.experiment_runs(uri, query.experiment_id(uri, "scaling"))
    assert {r.name for r in runs} == {r.name for r in children} | {"single-fp32"}  # no parent
    assert query.latest_sweep(uri).run_id == store["newest"]
    assert query.latest_sweep(uri, "scaling").run_id == store["sweep"]
    assert query.metric_history(uri, store["ids"]["ddp1-fp32"], "samples_per_s") == [
        (1, 50.0),
        (2, 100.0),
        (3, 110.0),
        (4, 90.0),
    ]
    failed = next(r for r in children if r.name == "ddp4-fp32")
    assert failed.status == "FAILED"
    assert failed.setting("world_size") == "4"


def test_unknown_experiment_lists_the_existing_ones(store):
    with pytest.raises(query.UnknownExperimentError) as raised:
        query.experiment_id(store["uri"], "scalling")
    assert "'scalling'" in str(raised.value)
    assert "empty, other, scaling" in str(raised.value)


# --- the command --------------------------------------------------------------------------------
def test_a_store_that_is_not_sqlite_is_one_line_saying_what_to_do(capsys, tmp_path):
    text = tmp_path / "notadb.db"
    text.write_text("not a database\n")
    code, out, err = run_main(capsys, "--tracking-uri", f"sqlite:///{text}", "--experiment", "x")
    assert code == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"Cannot use the MLflow store sqlite:///{text}: " in err
    assert "not a database" in err and "--tracking-uri" in err


def test_sweep_as_csv_with_numbers_computed_by_hand(store, capsys, tmp_path):
    code, out, _ = run_main(
        capsys,
        "--tracking-uri",
        store["uri"],
        "--sweep",
        store["sweep"],
        "--format",
        "csv",
        "--output-dir",
        str(tmp_path),
        "--no-plots",
    )
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["run_name"] for r in rows] == [
        "ddp1-fp32",
        "ddp1-amp",
        "ddp2-fp32",
        "ddp2-amp",
        "ddp4-fp32",
    ]
    by_name = {r["run_name"]: r for r in rows}

    def number(name: str, column: str) -> float:
        return float(by_name[name][column])

    # samples/s: medians of epochs 2.. -> 100, 155, 180, 290
    assert [float(r["samples_per_s"]) for r in rows[:4]] == [100, 155, 180, 290]
    assert [float(r["speedup"]) for r in rows[:4]] == pytest.approx([1.0, 1.55, 1.8, 2.9])
    efficiency = [float(r["scaling_efficiency"]) for r in rows[:4]]
    assert efficiency == pytest.approx([1.0, 1.55, 0.9, 1.45])
    assert by_name["ddp1-fp32"]["amp_gain"] == ""
    assert by_name["ddp2-fp32"]["amp_gain"] == ""
    assert number("ddp1-amp", "amp_gain") == pytest.approx(1.55)
    assert number("ddp2-amp", "amp_gain") == pytest.approx(290 / 180)
    assert number("ddp1-fp32", "peak_mem_mb") == 120  # max of the history, not the last
    assert number("ddp1-amp", "peak_mem_mb") == 70
    assert number("ddp1-fp32", "best_val_acc") == pytest.approx(0.72)
    assert number("ddp1-fp32", "test_acc") == pytest.approx(0.71)
    assert number("ddp1-fp32", "time_to_target_s") == 25
    assert by_name["ddp1-amp"]["time_to_target_s"] == ""
    assert {r["baseline_run"] for r in rows[:4]} == {"ddp1-fp32"}
    failed = by_name["ddp4-fp32"]
    assert failed["status"] == "FAILED"
    assert failed["world_size"] == "4"
    blanks = ("samples_per_s", "speedup", "scaling_efficiency", "test_acc", "peak_mem_mb")
    assert all(failed[column] == "" for column in blanks)
    assert (tmp_path / "summary.csv").read_text() == out


def test_experiment_as_json_keeps_ddp_on_its_own_baseline(store, capsys, tmp_path):
    code, out, _ = run_main(
        capsys,
        "--tracking-uri",
        store["uri"],
        "--experiment",
        "scaling",
        "--format",
        "json",
        "--output-dir",
        str(tmp_path),
        "--no-plots",
    )
    assert code == 0
    rows = json.loads(out)
    assert rows[0]["run_name"] == "single-fp32"  # single sorts before ddp
    assert rows[0]["samples_per_s"] == 90
    assert rows[0]["speedup"] == 1.0
    ddp2 = next(r for r in rows if r["run_name"] == "ddp2-fp32")
    assert ddp2["baseline_run"] == "ddp1-fp32"
    assert ddp2["speedup"] == pytest.approx(1.8)  # not 180/90
    assert ddp2["world_size"] == 2
    assert next(r for r in rows if r["status"] == "FAILED")["speedup"] is None
    assert len(rows) == 6


def test_markdown_and_table_formats(store, capsys, tmp_path):
    base = ["--tracking-uri", store["uri"], "--sweep", store["sweep"], "--no-plots"]
    code, out, _ = run_main(capsys, *base, "--format", "markdown", "--output-dir", str(tmp_path))
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 2 + 5
    assert lines[0].startswith("| run | status | parallelism | workers |")
    assert "| ddp2-amp | FINISHED | ddp | 2 | amp |" in out
    assert "2.90×" in out
    assert "**FAILED**" in out
    assert (tmp_path / "summary.md").read_text() == out

    code, out, err = run_main(capsys, *base, "--output-dir", str(tmp_path))
    assert code == 0
    assert all(name in out for name in ("ddp1-fp32", "ddp2-amp", "ddp4-fp32", "FAILED", "1.55×"))
    assert f"to {tmp_path}" in err
    assert "ddp4-fp32" in err and "error.txt" in err


def test_plots_are_png_files_and_the_default_folder_is_named_after_the_sweep(
    store, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(
        capsys,
        "--tracking-uri",
        store["uri"],
        "--experiment",
        "scaling",
        "--sweep",
        "latest",
        "--format",
        "csv",
    )
    assert code == 0
    folder = tmp_path / "outputs" / "reports" / "ddp-sweep"
    assert {p.name for p in folder.iterdir()} == REPORT_FILES
    for name in ("throughput.png", "efficiency.png", "accuracy_vs_time.png"):
        assert (folder / name).read_bytes()[:8] == PNG_MAGIC, name
    assert "outputs/reports/ddp-sweep" in err


def test_latest_sweep_overall_and_a_baseline_of_two_workers(store, capsys, tmp_path):
    code, out, _ = run_main(
        capsys,
        "--tracking-uri",
        store["uri"],
        "--sweep",
        "latest",
        "--baseline",
        "world_size=2,precision=fp32",
        "--format",
        "json",
        "--output-dir",
        str(tmp_path),
    )
    assert code == 0
    rows = json.loads(out)
    assert [r["run_name"] for r in rows] == ["ws2-fp32", "ws2-amp"]
    assert [r["speedup"] for r in rows] == pytest.approx([1.0, 1.5])
    assert rows[1]["amp_gain"] == pytest.approx(1.5)
    # one world size: throughput still plots its points
    assert (tmp_path / "throughput.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--experiment", "nope"], ["'nope'", "empty, other, scaling"]),
        (["--experiment", "empty"], ["'empty' has no runs"]),
        (["--sweep", "latest"], ["world_size=1,precision=fp32", "world_size=2 precision=amp"]),
        (["--sweep", "0123456789abcdef"], ["No MLflow run with id '0123456789abcdef'"]),
        (["--experiment", "empty", "--sweep", "latest"], ["No sweep in experiment 'empty'"]),
        (["--experiment", "scaling", "--baseline", "gpus=1"], ["unknown: gpus"]),
    ],
)
def test_errors_are_one_line_and_exit_2(store, capsys, tmp_path, args, expected):
    code, out, err = run_main(
        capsys, "--tracking-uri", store["uri"], "--output-dir", str(tmp_path), *args
    )
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("accelexp-report: error: ")
    for text in expected:
        assert text in err
    assert not (tmp_path / "summary.csv").exists()


def test_the_default_table_fits_100_columns_and_wide_shows_every_column(store, capsys, tmp_path):
    base = ["--tracking-uri", store["uri"], "--experiment", "scaling", "--no-plots"]
    code, out, _ = run_main(capsys, *base, "--output-dir", str(tmp_path))
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= BRIEF_WIDTH
    for text in ("ddp2-amp", "ddp4-fp32 (FAILED)", "samples/s", "speedup", "1.55×", "1.61×"):
        assert text in out, text
    assert "parallelism" not in out and "test acc" not in out  # details: --wide

    code, wide, _ = run_main(capsys, *base, "--wide", "--output-dir", str(tmp_path))
    assert code == 0
    assert max(len(line) for line in wide.splitlines()) > BRIEF_WIDTH
    header = next(line for line in wide.splitlines() if "parallelism" in line)
    columns = ("status", "parallelism", "workers", "speed", "model", "data", "samples/s",
               "efficiency", "AMP gain", "test acc", "time to target (s)", "baseline")  # fmt: skip
    for column in columns:
        assert column in header, column


def test_a_one_epoch_run_is_measured_after_warm_up_or_reported_too_short(
    compose_cfg, tracking_uri, capsys, tmp_path
):
    """Real one-epoch runs: 16 steps (4 warm-up, 12 timed) get a steady throughput; 5 steps
    (1 warm-up, 4 timed) are too short, and the report says so instead of a number."""
    sizes = ("data.num_train=640", "data.batch_size=32")
    for name, steps in (("long", 16), ("short", 5)):
        cfg = compose_cfg(*sizes, f"max_steps_per_epoch={steps}", f"mlflow.run_name={name}")
        run(cfg, tmp_path / name)
    runs = {r.name: r for r in query.experiment_runs(tracking_uri, query.experiment_id(
        tracking_uri, "accelexp"))}  # fmt: skip
    long = runs["long"].metrics
    assert (long["timed_steps"], runs["short"].metrics["timed_steps"]) == (12, 4)
    # the throughput counts the 12 timed steps' samples in the time they took
    assert long["samples_per_s"] == pytest.approx(12 * 32 / long["epoch_time_s"], rel=1e-3)

    base = ["--tracking-uri", tracking_uri, "--experiment", "accelexp", "--no-plots",
            "--output-dir", str(tmp_path / "report")]  # fmt: skip
    code, out, _ = run_main(capsys, *base, "--format", "csv")
    assert code == 0
    rows = {r["run_name"]: r for r in csv.DictReader(io.StringIO(out))}
    assert float(rows["long"]["samples_per_s"]) == pytest.approx(long["samples_per_s"])
    assert rows["short"]["samples_per_s"] == rows["short"]["speedup"] == ""
    assert rows["short"]["note"].endswith(  # after "contended (...); " on a shared machine
        "too short to measure: 4 steady steps, need ≥ 10 (raise max_steps_per_epoch or epochs)"
    )
    code, out, _ = run_main(capsys, *base)
    assert code == 0
    table = " ".join(out.split())  # "short: [contended (...); ]too short to measure: ..."
    assert "short: " in table and "too short to measure: 4 steady steps, need ≥ 10" in table


def test_a_missing_store_is_reported_not_created(capsys, tmp_path):
    db = tmp_path / "nowhere.db"
    code, _, err = run_main(capsys, "--tracking-uri", f"sqlite:///{db}", "--experiment", "x")
    assert code == 2
    assert "No MLflow store" in err
    assert not db.exists()


def test_experiment_or_sweep_is_required(capsys):
    with pytest.raises(SystemExit) as raised:
        main([])
    assert raised.value.code == 2
    assert "--experiment" in capsys.readouterr().err


# --- the sweep's own report ---------------------------------------------------------------------
def test_write_sweep_report_logs_its_files_to_the_parent_run(store, tmp_path):
    paths = write_sweep_report(store["uri"], store["sweep"], tmp_path / "report")
    assert {p.name for p in paths} == REPORT_FILES
    assert all(p.is_file() for p in paths)
    client = MlflowClient(tracking_uri=store["uri"])
    logged = {Path(f.path).name for f in client.list_artifacts(store["sweep"], "report")}
    assert logged == REPORT_FILES
    rows = list(csv.DictReader(io.StringIO((tmp_path / "report" / "summary.csv").read_text())))
    assert float(next(r for r in rows if r["run_name"] == "ddp2-fp32")["speedup"]) == 1.8


def test_write_sweep_report_without_a_baseline_still_writes_the_table(store, tmp_path):
    paths = write_sweep_report(store["uri"], store["newest"], tmp_path)
    names = {p.name for p in paths}
    assert names == REPORT_FILES - {"efficiency.png"}  # nothing to plot without a baseline
    rows = list(csv.DictReader(io.StringIO((tmp_path / "summary.csv").read_text())))
    assert [r["speedup"] for r in rows] == ["", ""]
    assert float(rows[1]["amp_gain"]) == 1.5
    client = MlflowClient(tracking_uri=store["uri"])
    logged = {Path(f.path).name for f in client.list_artifacts(store["newest"], "report")}
    assert logged == names


def test_formats_of_no_rows_are_still_well_formed():
    assert to_csv([]).splitlines()[0].startswith("run_name,run_id,status,")
    assert json.loads(to_json([])) == []
    assert len(to_markdown([]).splitlines()) == 2


def test_a_sweeps_title_says_sweep_once():
    named = RunRecord("abc123", "sweep 2026-12-01 scaling", "FINISHED")
    assert sweep_title(named) == "sweep 2026-12-01 scaling (abc123)"
    assert sweep_title(RunRecord("abc123", "my study", "FINISHED")) == "Sweep my study (abc123)"
