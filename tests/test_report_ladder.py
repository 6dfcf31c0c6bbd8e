"""The speed-up ladder and the `speed` column: gains computed by hand, read back from a real store.

The store holds the ladder study as `python run.py -m +experiment=speedups` logs it: a sweep
parent with one child per rung, tagged `rung`, `rung_index` and `speed`, the compile rung with its
`compile_s`. Every first epoch is deliberately off (warm-up, compilation), so a ladder that does
not skip it gets other numbers. A second ladder has a FAILED middle rung; a plain sweep of old
runs has no `speed` tag at all.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import CONF_DIR, new_store
from hydra import compose, initialize_config_dir
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from omegaconf import OmegaConf

from accelexp.config import register_configs
from accelexp.config.catalog import flatten
from accelexp.report import compare, ladder, main, write_sweep_report
from accelexp.report.ladder import RUNG_NAMES
from accelexp.tracking.query import RunRecord

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LADDER_FILES = {"ladder.csv", "ladder.md", "ladder.png"}


# --- the store ----------------------------------------------------------------------------------
@dataclass
class Rung:
    """One rung's run: samples/s per epoch (epoch 1 is warm-up)."""

    rung: str
    index: int
    precision: str
    speed: str
    samples_per_s: list[float]
    status: str = "FINISHED"
    compile_s: float | None = None


LADDER = [  # medians of epochs 2..: 100, 150, 190, 310, 340, 512
    Rung("fp32", 0, "fp32", "eager", [10, 100, 110, 90]),
    Rung("tf32", 1, "fp32", "tf32", [5, 150, 140, 160]),
    Rung("channels_last", 2, "fp32", "tf32+cl", [5, 180, 200, 190]),
    Rung("amp", 3, "amp", "tf32+cl", [1, 300, 320]),
    Rung("bf16", 4, "bf16", "tf32+cl", [2, 330, 340, 350]),
    Rung("compile", 5, "bf16", "tf32+cl+compile:default", [1, 512, 512], compile_s=42.0),
]
FAILED_MIDDLE = [
    Rung("channels_last", 2, "fp32", "tf32+cl", [5], status="FAILED") if r.index == 2 else r
    for r in LADDER
]
SAMPLES = [100, 150, 190, 310, 340, 512]
GAIN_VS_FP32 = [1.0, 1.5, 1.9, 3.1, 3.4, 5.12]
GAIN_VS_PREVIOUS = [None, 150 / 100, 190 / 150, 310 / 190, 340 / 310, 512 / 340]


def log_rung(client: MlflowClient, experiment_id: str, rung: Rung, start: int, parent: str) -> str:
    """`rung`'s run as a job of the speedups study logs it, a child of `parent`."""
    switches = rung.speed.split("+")
    tags = {
        "mlflow.parentRunId": parent,
        "parallelism": "single",
        "precision": rung.precision,
        "model": "simple_cnn",
        "data": "synthetic",
        "world_size": "1",
        "speed": rung.speed,
        "tf32": str("tf32" in switches).lower(),
        "channels_last": str("cl" in switches).lower(),
        "compile": "default" if "compile:default" in switches else "off",
        "rung": rung.rung,
        "rung_index": str(rung.index),
    }
    run_id = client.create_run(experiment_id, start, tags, f"simple_cnn-{rung.rung}").info.run_id
    metrics = []
    for epoch, samples in enumerate(rung.samples_per_s, 1):
        at = start + epoch
        metrics += [
            Metric("samples_per_s", samples, at, epoch),
            Metric("val_acc", 0.5 + 0.1 * epoch, at, epoch),
            Metric("elapsed_s", 10.0 * epoch, at, epoch),
            Metric("peak_mem_mb", 100.0 + rung.index + epoch, at, epoch),
        ]
    if rung.compile_s is not None:
        metrics.append(Metric("compile_s", rung.compile_s, start + 1, 1))
    if rung.status == "FINISHED":
        final = {"best_val_acc": 0.8 + rung.index / 100, "test_acc": 0.79}
        metrics += [Metric(k, v, start + 99, 0) for k, v in final.items()]
    params = [Param("precision.name", rung.precision), Param("world_size", "1")]
    client.log_batch(run_id, metrics=metrics, params=params)
    client.set_terminated(run_id, status=rung.status)
    return run_id


def log_plain(client: MlflowClient, experiment_id: str, name: str, precision: str, start: int,
              samples: list[float], parent: str, speed: str | None = None) -> None:  # fmt: skip
    """A run from before the speed switches: no `speed` tag unless given."""
    tags = {
        "mlflow.parentRunId": parent,
        "parallelism": "ddp",
        "precision": precision,
        "model": "simple_cnn",
        "data": "synthetic",
        "world_size": "1",
    }
    if speed is not None:
        tags["speed"] = speed
    run_id = client.create_run(experiment_id, start, tags, name).info.run_id
    history = [Metric("samples_per_s", s, start + e, e) for e, s in enumerate(samples, 1)]
    client.log_batch(run_id, metrics=history)
    client.set_terminated(run_id)


def sweep_parent(client: MlflowClient, experiment_id: str, name: str, start: int) -> str:
    tags = {"accelexp.sweep": "true", "sweep_dir": f"outputs/multirun/{name}"}
    run_id = client.create_run(experiment_id, start, tags, name).info.run_id
    client.set_terminated(run_id)
    return run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory, mlflow_template_db):
    """Experiment `speedups` (the ladder, then a newer ladder whose channels_last FAILED) and
    `plain` (a sweep of an fp32 and an amp run without `speed` tags, and an amp run tagged
    `eager`)."""
    home = tmp_path_factory.mktemp("ladder-store")
    uri = new_store(home, mlflow_template_db)
    client = MlflowClient(tracking_uri=uri)

    def experiment(name: str) -> str:
        return client.create_experiment(name, (home / "mlartifacts" / name).as_uri())

    speedups, plain = experiment("speedups"), experiment("plain")
    sweeps = {}
    for name, rungs, start in (("ladder", LADDER, 1000), ("ladder-failed", FAILED_MIDDLE, 2000)):
        sweeps[name] = sweep_parent(client, speedups, name, start)
        for i, rung in enumerate(rungs, 1):
            log_rung(client, speedups, rung, start + 10 * i, sweeps[name])
    sweeps["plain"] = parent = sweep_parent(client, plain, "plain", 3000)
    log_plain(client, plain, "old-fp32", "fp32", 3010, [1, 200, 200], parent)
    log_plain(client, plain, "old-amp", "amp", 3020, [1, 300, 300], parent)
    log_plain(client, plain, "new-amp", "amp", 3030, [1, 500, 500], parent, speed="eager")
    return {"uri": uri, **sweeps}


def report(capsys, store, sweep: str, *args: str) -> tuple[str, str]:
    code = main(["--tracking-uri", store["uri"], "--sweep", store[sweep], *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


# --- the ladder, pure ---------------------------------------------------------------------------
def rung_record(
    rung: str | None,
    index: int | None,
    samples: list[float],
    *,
    status: str = "FINISHED",
    start: int = 0,
    precision: str = "fp32",
    params: dict[str, str] | None = None,
    timed_steps: int | None = None,
) -> RunRecord:
    tags = {"precision": precision, "model": "m", "data": "d", "world_size": "1"}
    tags |= {"rung": rung} if rung is not None else {}
    tags |= {"rung_index": str(index)} if index is not None else {}
    return RunRecord(
        run_id=f"id-{rung}-{start}",
        name=f"{rung}-{start}",
        status=status,
        start_time=start,
        tags=tags,
        params=params or {},
        metrics={} if timed_steps is None else {"timed_steps": float(timed_steps)},
        histories={"samples_per_s": list(enumerate(samples, start=1))},
    )


def test_rungs_are_compared_like_for_like_and_a_short_rung_says_so():
    """Rungs may differ in precision and speed switches only; a rung of other epochs gets no
    gain, and its note says what differs; a rung too short to measure says that instead."""
    setup = {"epochs": "3", "speed.tf32": "False", "precision.init_scale": "65536"}
    rows = ladder(
        [
            rung_record("fp32", 0, [0, 100], params=setup),
            rung_record("tf32", 1, [0, 150], params=setup | {"speed.tf32": "True"}),
            rung_record("channels_last", 2, [0, 300], params=setup | {"epochs": "1"}),
            rung_record(
                "amp", 3, [0, 600], params=setup | {"precision.init_scale": "1024"}, precision="amp"
            ),
            rung_record("bf16", 4, [9], params=setup, timed_steps=4),
        ]
    )
    assert rows[1].gain_vs_previous == rows[1].gain_vs_fp32 == pytest.approx(1.5)
    assert (rows[2].gain_vs_previous, rows[2].gain_vs_fp32) == (None, None)
    assert rows[2].note == (
        "not like for like with rung tf32: differs in epochs (1 vs 3); "
        "not like for like with rung fp32: differs in epochs (1 vs 3)"
    )
    assert rows[3].gain_vs_previous is None  # over channels_last: epochs differ
    assert rows[3].gain_vs_fp32 == pytest.approx(6.0)
    assert rows[4].samples_per_s is None
    assert rows[4].note.startswith("too short to measure: 4 steady steps, need ≥ 10")


def test_runs_off_the_ladder_make_no_ladder():
    assert ladder([rung_record(None, None, [1, 2])]) == []


def test_a_missing_rung_is_a_blank_row_and_the_next_gain_is_over_the_last_measured():
    rows = ladder(
        [
            rung_record("amp", 3, [0, 400], precision="amp"),
            rung_record("fp32", 0, [0, 100]),
            rung_record("tf32", 1, [0, 160]),
        ]
    )
    assert [(r.rung_index, r.rung, r.status) for r in rows] == [
        (0, "fp32", "FINISHED"),
        (1, "tf32", "FINISHED"),
        (2, "channels_last", "MISSING"),
        (3, "amp", "FINISHED"),
    ]
    missing = rows[2]
    assert (missing.run_name, missing.samples_per_s, missing.gain_vs_previous) == (None,) * 3
    assert rows[3].gain_vs_previous == pytest.approx(400 / 160)
    assert rows[3].previous_rung == "tf32"
    assert rows[3].vs_previous == "2.50× (vs tf32)"
    assert rows[1].vs_previous == "1.60×"
    assert rows[3].gain_vs_fp32 == pytest.approx(4.0)


def test_of_several_runs_of_a_rung_the_newest_finished_one_counts():
    rows = ladder(
        [
            rung_record("fp32", 0, [0, 100], start=1),
            rung_record("fp32", 0, [0, 200], start=2),
            rung_record("fp32", 0, [0, 999], start=3, status="FAILED"),
            rung_record("tf32", 1, [0, 300], start=1, status="FAILED"),
        ]
    )
    assert rows[0].run_name == "fp32-2"
    assert rows[0].samples_per_s == 200
    assert (rows[1].status, rows[1].samples_per_s, rows[1].precision) == ("FAILED", None, "fp32")


def test_without_a_measured_fp32_rung_there_is_no_gain_over_fp32():
    rows = ladder(
        [
            rung_record("fp32", 0, [0, 100], status="FAILED"),
            rung_record("tf32", 1, [0, 150]),
            rung_record("channels_last", 2, [0, 300]),
        ]
    )
    assert [r.gain_vs_fp32 for r in rows] == [None, None, None]
    assert [r.gain_vs_previous for r in rows] == [None, None, 2.0]
    assert rows[2].vs_previous == "2.00×"


def test_a_rung_is_placed_by_its_name_when_it_has_no_index():
    rows = ladder([rung_record("tf32", None, [0, 150]), rung_record("fp32", None, [0, 100])])
    assert [(r.rung, r.gain_vs_fp32) for r in rows] == [("fp32", 1.0), ("tf32", 1.5)]


def test_the_checkpointing_rung_is_rung_6_with_every_block_checkpointed_off_the_default_ladder():
    """A memory lever, not a speed-up: on the ladder (rung 7) when asked for, never by default
    (simple_cnn, the study's model, has no blocks); its gain below 1 shows as the loss it is."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        rung = {
            name: flatten(OmegaConf.to_container(compose("config", [
                "+experiment=speedups", "model=vit_tiny", f"+rung={name}",
            ])))
            for name in ("bf16_true", "activation_checkpointing")
        }  # fmt: skip
    before, after = rung["bf16_true"], rung["activation_checkpointing"]
    changed = {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)}
    assert changed == {
        "speed.activation_checkpointing",
        "mlflow.tags.rung",
        "mlflow.tags.rung_index",
    }
    assert after["speed.activation_checkpointing"] == "full"
    index = int(after["mlflow.tags.rung_index"])
    assert index == RUNG_NAMES.index("activation_checkpointing") == len(RUNG_NAMES) - 1
    default = OmegaConf.load(CONF_DIR / "experiment" / "speedups.yaml").hydra.sweeper.params
    assert "activation_checkpointing" not in default["+rung"].split(",")

    checkpointed = [
        rung_record("bf16_true", 6, [0, 200], precision="bf16_true"),
        rung_record("activation_checkpointing", 7, [0, 150], precision="bf16_true",
                    params={"speed.activation_checkpointing": "full"}),
    ]  # fmt: skip
    checkpointed[0].params["speed.activation_checkpointing"] = "none"
    for record, peak in zip(checkpointed, (800.0, 500.0), strict=True):
        record.metrics["peak_mem_mb"] = peak
    rows = ladder(checkpointed)
    assert [row.status for row in rows[:6]] == ["MISSING"] * 6
    lever = rows[7]
    assert (lever.rung, lever.previous_rung) == ("activation_checkpointing", "bf16_true")
    assert lever.gain_vs_previous == pytest.approx(150 / 200) and lever.vs_previous == "0.75×"
    assert (rows[6].peak_mem_mb, lever.peak_mem_mb) == (800.0, 500.0)  # what it buys


# --- the speed column, pure ---------------------------------------------------------------------
def run_record(name: str, precision: str, samples: list[float], speed: str | None, start: int = 0):
    tags = {"parallelism": "single", "precision": precision, "model": "m", "data": "d"}
    tags |= {"world_size": "1"} | ({"speed": speed} if speed is not None else {})
    return RunRecord(
        run_id=f"id-{name}",
        name=name,
        status="FINISHED",
        start_time=start,
        tags=tags,
        histories={"samples_per_s": list(enumerate(samples, start=1))},
    )


def test_amp_gain_pairs_amp_with_the_fp32_run_of_the_same_speed():
    rows = compare(
        [
            run_record("fp32-eager", "fp32", [0, 100], "eager", start=1),
            run_record("fp32-cl", "fp32", [0, 200], "tf32+cl", start=2),
            run_record("fp32-compiled", "fp32", [0, 400], "cl+compile:default", start=3),
            run_record("amp-eager", "amp", [0, 150], "eager"),
            run_record("amp-cl", "amp", [0, 500], "tf32+cl"),
        ]
    )
    by_name = {row.run_name: row for row in rows}
    assert by_name["amp-eager"].amp_gain == pytest.approx(1.5)  # not 150/400, the newest fp32
    assert by_name["amp-cl"].amp_gain == pytest.approx(2.5)
    assert by_name["amp-cl"].baseline_run == "fp32-cl"  # same speed wins over the newest
    assert by_name["amp-cl"].speedup == pytest.approx(2.5)
    assert [(row.precision, row.speed) for row in rows] == [
        ("fp32", "eager"),
        ("fp32", "cl+compile:default"),
        ("fp32", "tf32+cl"),
        ("amp", "eager"),
        ("amp", "tf32+cl"),
    ]


def test_a_missing_speed_tag_reads_as_eager():
    old_fp32 = run_record("old-fp32", "fp32", [0, 100], speed=None)
    rows = compare(
        [
            old_fp32,
            run_record("new-amp", "amp", [0, 300], "eager"),
            run_record("new-fp32-cl", "fp32", [0, 250], "cl", start=5),
        ],
        "world_size=1,precision=fp32,speed=eager",
    )
    by_name = {row.run_name: row for row in rows}
    assert by_name["old-fp32"].speed == "eager"
    assert by_name["new-amp"].amp_gain == pytest.approx(3.0)
    assert {row.baseline_run for row in rows} == {"old-fp32"}  # the selector names speed:
    assert by_name["new-fp32-cl"].speedup == pytest.approx(2.5)  # it may differ, like for like
    rung = ladder([RunRecord("r", "r", "FINISHED", tags={"rung": "fp32", "rung_index": "0"})])
    assert rung[0].speed == "eager"


# --- the command on the store -------------------------------------------------------------------
def test_ladder_as_json_with_gains_computed_by_hand(store, capsys, tmp_path):
    out, _ = report(
        capsys, store, "ladder", "--format", "json", "--output-dir", str(tmp_path), "--no-plots"
    )
    document = json.loads(out)
    assert set(document) == {"runs", "ladder"}
    rungs = document["ladder"]
    assert [r["rung"] for r in rungs] == [r.rung for r in LADDER]
    assert [r["rung_index"] for r in rungs] == list(range(6))
    assert [r["samples_per_s"] for r in rungs] == SAMPLES
    assert [r["gain_vs_fp32"] for r in rungs] == pytest.approx(GAIN_VS_FP32)
    assert [r["gain_vs_previous"] for r in rungs] == pytest.approx(GAIN_VS_PREVIOUS)
    assert [r["speed"] for r in rungs] == [r.speed for r in LADDER]
    assert [r["compile_s"] for r in rungs] == [None] * 5 + [42.0]
    assert [r["status"] for r in rungs] == ["FINISHED"] * 6
    assert rungs[3]["peak_mem_mb"] == 103 + 3  # the highest epoch's, not the last
    assert rungs[5]["best_val_acc"] == pytest.approx(0.85)
    assert {r["model"] for r in rungs} == {"simple_cnn"}

    runs = {r["run_name"]: r for r in document["runs"]}
    assert runs["simple_cnn-amp"]["amp_gain"] == pytest.approx(310 / 190)  # over channels_last
    assert runs["simple_cnn-bf16"]["amp_gain"] == pytest.approx(340 / 190)
    assert runs["simple_cnn-compile"]["amp_gain"] is None  # no fp32 run compiled
    assert runs["simple_cnn-compile"]["compile_s"] == 42.0
    assert runs["simple_cnn-amp"]["baseline_run"] == "simple_cnn-channels_last"  # same speed
    assert runs["simple_cnn-tf32"]["speedup"] == 1.0  # its own baseline
    assert [r["speed"] for r in document["runs"]] == [r.speed for r in LADDER]  # sorted


def test_a_baseline_by_speed_makes_speedup_the_gain_over_fp32(store, capsys, tmp_path):
    out, _ = report(
        capsys,
        store,
        "ladder",
        "--baseline",
        "world_size=1,precision=fp32,speed=eager",
        "--format",
        "json",
        "--output-dir",
        str(tmp_path),
        "--no-plots",
    )
    document = json.loads(out)
    assert [r["speedup"] for r in document["runs"]] == pytest.approx(GAIN_VS_FP32)
    assert {r["baseline_run"] for r in document["runs"]} == {"simple_cnn-fp32"}


def test_a_failed_middle_rung_as_csv_and_markdown(store, capsys, tmp_path):
    args = ("--output-dir", str(tmp_path), "--no-plots")
    out, err = report(capsys, store, "ladder-failed", "--format", "csv", *args)
    runs_csv, _, ladder_csv = out.partition("\n\n")
    assert len(list(csv.DictReader(io.StringIO(runs_csv)))) == 6
    rungs = list(csv.DictReader(io.StringIO(ladder_csv)))
    assert ladder_csv == (tmp_path / "ladder.csv").read_text()
    failed = rungs[2]
    assert (failed["rung"], failed["status"], failed["speed"]) == (
        "channels_last",
        "FAILED",
        "tf32+cl",
    )
    assert all(failed[k] == "" for k in ("samples_per_s", "gain_vs_previous", "gain_vs_fp32"))
    assert float(rungs[3]["gain_vs_previous"]) == pytest.approx(310 / 150)  # over tf32
    assert rungs[3]["previous_rung"] == "tf32"
    assert float(rungs[3]["gain_vs_fp32"]) == pytest.approx(3.1)
    assert float(rungs[4]["gain_vs_previous"]) == pytest.approx(340 / 310)
    assert "simple_cnn-channels_last" in err and "FAILED" in err

    out, _ = report(capsys, store, "ladder-failed", "--format", "markdown", *args)
    runs_md, heading, ladder_md = out.partition(
        "\n### Speed-up ladder: simple_cnn on synthetic\n\n"
    )
    assert heading and runs_md == (tmp_path / "summary.md").read_text()
    assert "| run | status | parallelism | workers | precision | speed | model |" in runs_md
    assert "| compile (s) |" in runs_md  # the compile rung logged compile_s
    # the switches of the rungs after the failed one differ from every measured fp32 run's
    assert (
        "- simple_cnn-amp: no like-for-like baseline: nearest (simple_cnn-tf32) differs in speed "
        "(tf32+cl vs tf32); no like-for-like fp32 run: nearest (simple_cnn-tf32) differs in speed "
        "(tf32+cl vs tf32)\n"
    ) in runs_md
    assert ladder_md == (tmp_path / "ladder.md").read_text()
    lines = ladder_md.splitlines()
    assert lines[0] == (
        "| # | rung | precision | speed | samples/s | vs previous rung | vs fp32 | compile (s) "
        "| best val acc | test acc | peak mem (MB) | status |"
    )
    assert len(lines) == 2 + 6
    assert lines[2].startswith("| 0 | fp32 | fp32 | eager | 100.0 |  | 1.00× |")
    assert lines[4].startswith("| 2 | channels_last | fp32 | tf32+cl |  |  |  |")
    assert lines[4].endswith("| **FAILED** |")
    assert "| 310.0 | 2.07× (vs tf32) | 3.10× |" in lines[5]
    assert "| 512.0 | 1.51× | 5.12× | 42.0 |" in lines[7]


def test_the_rich_table_follows_with_the_ladder(store, capsys, tmp_path):
    out, err = report(capsys, store, "ladder", "--output-dir", str(tmp_path), "--no-plots")
    runs_table, _, ladder_table = out.partition("Speed-up ladder: simple_cnn on synthetic")
    assert "simple_cnn-compile" in runs_table and "tf32+cl+compile:default" in runs_table
    assert all(text in ladder_table for text in ("channels_last", "5.12×", "3.10×", "1.51×"))
    assert "ladder.csv" in err and "ladder.md" in err


def test_the_ladder_plot_is_a_png_in_the_report_folder(store, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, err = report(capsys, store, "ladder-failed", "--format", "csv")
    folder = tmp_path / "outputs" / "reports" / "ladder-failed"
    assert {p.name for p in folder.iterdir()} >= LADDER_FILES
    assert (folder / "ladder.png").read_bytes()[:8] == PNG_MAGIC
    assert "ladder.png" in err
    assert not [line for line in err.splitlines() if "Skipped" in line and "ladder" in line]


def test_a_selection_without_a_ladder_keeps_the_plain_json_list_and_no_ladder_files(
    store, capsys, tmp_path
):
    (tmp_path / "ladder.md").write_text("an older report's ladder\n")
    (tmp_path / "ladder.png").write_bytes(PNG_MAGIC)
    out, err = report(capsys, store, "plain", "--format", "json", "--output-dir", str(tmp_path))
    rows = json.loads(out)
    assert isinstance(rows, list)
    assert [(r["run_name"], r["speed"]) for r in rows] == [
        ("old-fp32", "eager"),
        ("new-amp", "eager"),
        ("old-amp", "eager"),
    ]
    assert [r["amp_gain"] for r in rows] == pytest.approx([None, 2.5, 1.5])
    assert not LADDER_FILES & {p.name for p in tmp_path.iterdir()}
    assert "ladder" not in err

    out, _ = report(capsys, store, "plain", "--format", "markdown", "--output-dir", str(tmp_path))
    assert "ladder" not in out.lower()
    assert "compile (s)" not in out  # no run compiled: the column is left out


# --- the sweep's own report ---------------------------------------------------------------------
def test_write_sweep_report_logs_the_ladder_to_the_parent_run(store, tmp_path):
    paths = write_sweep_report(store["uri"], store["ladder"], tmp_path / "report")
    names = {p.name for p in paths}
    assert names >= LADDER_FILES
    assert {"summary.csv", "summary.md", "throughput.png"} <= names
    client = MlflowClient(tracking_uri=store["uri"])
    logged = {Path(f.path).name for f in client.list_artifacts(store["ladder"], "report")}
    assert logged == names
    rungs = list(csv.DictReader(io.StringIO((tmp_path / "report" / "ladder.csv").read_text())))
    assert [float(r["gain_vs_fp32"]) for r in rungs] == pytest.approx(GAIN_VS_FP32)
    assert (tmp_path / "report" / "ladder.png").read_bytes()[:8] == PNG_MAGIC


def test_write_sweep_report_of_a_plain_sweep_writes_no_ladder(store, tmp_path):
    paths = write_sweep_report(store["uri"], store["plain"], tmp_path)
    assert not LADDER_FILES & {p.name for p in paths}
