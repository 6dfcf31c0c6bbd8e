"""The report's plots, read back from the real matplotlib figures the builders return.

Rows are built directly (`Row(...)`) so each test says exactly what is plotted; the last tests go
from plain `RunRecord`s through `compare` and `write_plots` to PNG files. What is checked is what a
reader relies on: axes from 0, titles naming model, data and device, a distinct colour and marker
per series, a legend that lists exactly the drawn series (ideal lines in their own colours), equal
points kept apart, and the AMP-gain bars at the rows' gains.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from matplotlib.colors import to_hex
from matplotlib.container import BarContainer, ErrorbarContainer
from matplotlib.lines import Line2D
from scipy import stats as scipy_stats

from accelexp.report import compare
from accelexp.report.compare import Row
from accelexp.report.plots import (
    AMP_GAIN_PLOT,
    IDEAL_LABEL,
    LADDER_PLOT,
    MIN_ACCURACY_SPAN,
    PLOT_NAMES,
    accuracy_vs_time_figure,
    amp_gain_figure,
    efficiency_figure,
    ladder_figure,
    series_styles,
    throughput_figure,
    title_subject,
    write_plots,
)
from accelexp.tracking.query import RunRecord

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GAINS = {  # (parallelism, workers, precision) -> AMP gain; amp and bf16 equal at one worker
    ("ddp", 1, "amp"): 1.6,
    ("ddp", 1, "bf16"): 1.6,
    ("ddp", 2, "amp"): 1.7,
    ("ddp", 2, "bf16"): 1.4,
    ("horovod", 2, "amp"): 1.5,
}


def make_row(parallelism: str, workers: int, precision: str, samples: float | None, **more) -> Row:
    """A finished simple_cnn/fashion_mnist row on `cpu` (or `device=`), speedup over 100/s."""
    fields = {
        "device": "cpu",
        "model": "simple_cnn",
        "data": "fashion_mnist",
        "speed": "eager",
        "status": "FINISHED",
        "run_name": f"{parallelism}{workers}-{precision}",
        "run_id": f"id-{parallelism}{workers}-{precision}",
    } | more
    return Row(
        parallelism=parallelism,
        world_size=workers,
        precision=precision,
        samples_per_s=samples,
        speedup=None if samples is None else samples / 100,
        scaling_efficiency=None if samples is None else samples / 100 / workers,
        amp_gain=GAINS.get((parallelism, workers, precision)),
        **fields,
    )


def amp_study() -> list[Row]:
    """ddp at 1 and 2 workers and horovod at 2, in fp32, amp and bf16 (amp = bf16 at one)."""
    fp32 = {("ddp", 1): 100.0, ("ddp", 2): 180.0, ("horovod", 2): 170.0}
    return [
        make_row(par, w, precision, base * GAINS.get((par, w, precision), 1.0))
        for (par, w), base in fp32.items()
        for precision in ("fp32", "amp", "bf16")
        if precision == "fp32" or (par, w, precision) in GAINS
    ]


def series_lines(axes) -> list[Line2D]:
    """The drawn series: labelled lines (matplotlib labels unlabelled ones `_child…`)."""
    return [line for line in axes.lines if not line.get_label().startswith("_")]


def legend_texts(figure) -> list[str]:
    (legend,) = figure.legends
    return [text.get_text() for text in legend.get_texts()]


def interval_bars(axes) -> list:
    """(low, high) of each error bar drawn, rounded to compare with figures made by hand."""
    return [
        [pytest.approx(y) for y in segment[:, 1]]
        for container in axes.containers
        if isinstance(container, ErrorbarContainer)
        for segment in container.lines[2][0].get_segments()
    ]


def assert_distinct_styles(lines: Sequence[Line2D]) -> None:
    styles = [(to_hex(line.get_color()), line.get_marker()) for line in lines]
    assert len(set(styles)) == len(styles), styles
    assert len({colour for colour, _ in styles}) == min(len(styles), 10)


def assert_legend_outside(figure) -> None:
    """The legend's box lies right of the axes' box, not on the data."""
    figure.draw_without_rendering()  # lays the figure out
    (legend,) = figure.legends
    (axes,) = figure.axes
    assert legend.get_window_extent().x0 >= axes.get_window_extent().x1


# --- pieces -------------------------------------------------------------------------------------
def test_series_styles_differ_for_sixty_series_and_start_with_ten_colours():
    styles = series_styles(f"series {i}" for i in range(60))
    assert len(set(styles.values())) == 60
    first_twelve = list(styles.values())[:12]
    assert len({marker for _, marker in first_twelve}) == 12
    assert len({colour for colour, _ in first_twelve}) == 10


@pytest.mark.parametrize(
    ("models", "data", "devices", "expected"),
    [
        (["cnn"] * 3, ["fashion_mnist"], ["cpu", "cpu"], "cnn on fashion_mnist, cpu"),
        (["cnn", "resnet18"], ["synthetic"], ["", None], "cnn / resnet18 on synthetic"),
        (["a", "b", "c"], ["x", "y", "z", "x"], ["H200"], "3 models on 3 data sets, H200"),
        ([None], [""], ["cpu", "NVIDIA H200", "cuda"], "? on ?, 3 devices"),
    ],
)  # fmt: skip
def test_subject_names_a_few_and_counts_many(models, data, devices, expected):
    assert title_subject(models, data, devices) == expected


# --- throughput and efficiency ------------------------------------------------------------------
def test_throughput_from_zero_titled_with_model_data_and_device():
    figure = throughput_figure(amp_study())
    (axes,) = figure.axes
    assert axes.get_ylim()[0] == 0
    assert "simple_cnn on fashion_mnist, cpu" in axes.get_title()
    assert "Throughput" in axes.get_title()


def test_throughput_series_have_distinct_styles_and_the_legend_lists_exactly_them():
    figure = throughput_figure(amp_study())
    (axes,) = figure.axes
    lines = series_lines(axes)
    labels = ["ddp fp32", "ddp amp", "ddp bf16", "horovod fp32", "horovod amp"]
    assert [line.get_label() for line in lines] == labels
    assert_distinct_styles(lines)
    assert legend_texts(figure) == [
        *labels,
        IDEAL_LABEL,
    ]
    (legend,) = figure.legends
    for handle, line in zip(legend.legend_handles[:-1], lines, strict=True):
        assert (handle.get_color(), handle.get_marker()) == (line.get_color(), line.get_marker())
    assert_legend_outside(figure)


def test_ideal_lines_are_dashed_in_their_series_colour_and_so_is_their_legend_entry():
    figure = throughput_figure(amp_study())
    (axes,) = figure.axes
    ideals = [line for line in axes.lines if line.get_linestyle() == "--"]
    with_two_worker_counts = {"ddp fp32", "ddp amp", "ddp bf16"}  # horovod ran at 2 only
    colours = {to_hex(line.get_color()) for line in series_lines(axes)
               if line.get_label() in with_two_worker_counts}  # fmt: skip
    assert sorted(to_hex(line.get_color()) for line in ideals) == sorted(colours)
    ddp_fp32 = next(line for line in series_lines(axes) if line.get_label() == "ddp fp32")
    ideal = next(line for line in ideals if line.get_color() == ddp_fp32.get_color())
    assert list(ideal.get_ydata()) == [100.0, 200.0]  # linear from the one-worker point
    (legend,) = figure.legends
    dashes = [a for a in legend.findobj(Line2D) if a.get_linestyle() == "--"]
    assert sorted(to_hex(a.get_color()) for a in dashes) == sorted(colours)


def test_equal_points_stay_visible_side_by_side():
    figure = throughput_figure(amp_study())
    (axes,) = figure.axes
    at_one = {
        line.get_label(): (line.get_xdata()[0], line.get_ydata()[0])
        for line in series_lines(axes)
        if line.get_label() in ("ddp amp", "ddp bf16")
    }
    assert at_one["ddp amp"][1] == at_one["ddp bf16"][1] == 160.0  # the same throughput
    assert at_one["ddp amp"][0] != at_one["ddp bf16"][0]  # drawn apart
    assert all(abs(x - 1) < 0.5 for x, _ in at_one.values())  # still read as one worker


def test_a_run_without_a_throughput_is_counted_under_the_plot_not_drawn():
    rows = [*amp_study(), make_row("ddp", 4, "fp32", None)]
    (axes,) = throughput_figure(rows).axes
    assert "not plotted: 1 run without a throughput" in axes.get_xlabel()
    assert 4 not in axes.get_xticks()
    assert throughput_figure([make_row("ddp", 1, "fp32", None)]) is None


def test_twelve_series_of_two_models_keep_distinct_styles_and_name_what_differs():
    rows = [
        make_row(par, w, precision, 100.0 * w, model=model, speed=speed, device=device)
        for par in ("ddp", "horovod")
        for precision in ("fp32", "amp", "bf16")
        for model, speed, device in (("simple_cnn", "eager", "cpu"), ("resnet18", "tf32", "H200"))
        for w in (1, 2)
    ]
    figure = throughput_figure(rows)
    (axes,) = figure.axes
    lines = series_lines(axes)
    assert len(lines) == 12
    assert_distinct_styles(lines)
    assert "ddp amp tf32 resnet18 H200" in legend_texts(figure)
    assert "simple_cnn / resnet18 on fashion_mnist, cpu / H200" in axes.get_title()


def test_the_same_configuration_on_two_devices_is_two_series():
    rows = [make_row("ddp", 1, "fp32", 100.0, device=d, run_id=d) for d in ("cpu", "H200")]
    figure = throughput_figure(rows)
    assert legend_texts(figure) == ["ddp fp32 cpu", "ddp fp32 H200"]
    assert figure.axes[0].get_title().endswith("on fashion_mnist, cpu / H200")


def test_efficiency_from_zero_with_one_reference_line_matching_its_legend():
    figure = efficiency_figure(amp_study())
    (axes,) = figure.axes
    assert axes.get_ylim()[0] == 0
    assert axes.get_ylim()[1] > 1.6  # the highest point (ddp amp at one worker) fits
    assert "simple_cnn on fashion_mnist, cpu" in axes.get_title()
    lines = series_lines(axes)
    reference = next(line for line in lines if line.get_label().startswith("ideal"))
    assert list(reference.get_ydata()) == [1.0, 1.0]
    series = [line for line in lines if line is not reference]
    assert_distinct_styles(series)
    assert legend_texts(figure) == [line.get_label() for line in lines]
    # the same series keeps its colour and marker from the throughput plot
    throughput = {
        line.get_label(): line for line in series_lines(throughput_figure(amp_study()).axes[0])
    }
    for line in series:
        twin = throughput[line.get_label()]
        assert (line.get_color(), line.get_marker()) == (twin.get_color(), twin.get_marker())
    assert_legend_outside(figure)


def test_runs_all_of_one_worker_count_draw_no_efficiency_and_throughput_as_bars():
    rows = [make_row("single", 1, p, v) for p, v in (("fp32", 100.0), ("amp", 104.0))]
    rows[1].samples_per_s_low, rows[1].samples_per_s_high = 95.0, 113.0
    rows[0].noise = "contended"
    assert efficiency_figure(rows) is None  # nothing scaled: only the speedup again
    figure = throughput_figure(rows)
    (axes,) = figure.axes
    assert "vs workers" not in axes.get_title() and "1 worker each" in axes.get_title()
    bars = [bar for c in axes.containers if isinstance(c, BarContainer) for bar in c]
    assert [bar.get_height() for bar in bars] == [100.0, 104.0]
    assert axes.get_ylim()[0] == 0
    assert [95.0, 113.0] in interval_bars(axes)  # the row's 95 % interval
    assert bars[0].get_hatch() and not bars[1].get_hatch()  # the contended one hatched
    assert "(contended)" in axes.get_xticklabels()[0].get_text()
    assert legend_texts(figure) == ["single fp32", "single amp"]


# --- AMP gain -----------------------------------------------------------------------------------
def test_amp_gain_bars_stand_at_the_rows_gains_side_by_side_with_their_values():
    rows = amp_study()
    figure = amp_gain_figure(rows)
    (axes,) = figure.axes
    bars = {c.get_label(): c for c in axes.containers if isinstance(c, BarContainer)}
    assert list(bars) == ["amp", "bf16"]
    groups = [t.get_text() for t in axes.get_xticklabels()]
    assert groups == ["ddp\n×1", "ddp\n×2", "horovod\n×2"]
    for precision, container in bars.items():
        expected = {
            f"{row.parallelism}\n×{row.world_size}": row.amp_gain
            for row in rows
            if row.precision == precision
        }
        drawn = {
            groups[round(bar.get_x() + bar.get_width() / 2)]: bar.get_height() for bar in container
        }
        assert drawn == pytest.approx(expected)
    amp, bf16 = (bars[p][0] for p in ("amp", "bf16"))  # 1.6× both at one worker: apart
    assert amp.get_height() == bf16.get_height() and amp.get_x() + amp.get_width() <= bf16.get_x()
    texts = {t.get_text() for t in axes.texts}
    assert {"1.60×", "1.70×", "1.40×", "1.50×"} <= texts
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in axes.lines)
    assert axes.get_ylim()[0] == 0
    assert "AMP gain" in axes.get_title() and "simple_cnn on fashion_mnist, cpu" in axes.get_title()
    assert legend_texts(figure) == ["fp32 (1.0×)", "amp", "bf16"]
    assert_legend_outside(figure)


def test_no_amp_gain_plot_without_a_gain():
    assert amp_gain_figure([make_row("ddp", 1, "fp32", 100.0)]) is None


# --- accuracy against time ----------------------------------------------------------------------
def record_for(row: Row, seconds_per_epoch: float) -> RunRecord:
    return RunRecord(
        run_id=row.run_id,
        name=row.run_name,
        status=row.status,
        histories={
            "val_acc": [(1, 0.6), (2, 0.7), (3, 0.75)],
            "elapsed_s": [(e, 20 + seconds_per_epoch * e) for e in (1, 2, 3)],
        },
    )


def test_accuracy_vs_time_from_zero_one_distinct_line_per_run():
    rows = amp_study()
    rows[-1].status = "KILLED"
    records = [record_for(row, 5.0 + i) for i, row in enumerate(rows)]
    figure = accuracy_vs_time_figure(rows, records[1:])  # the first run has no history
    (axes,) = figure.axes
    assert axes.get_xlim()[0] == 0
    assert "simple_cnn on fashion_mnist, cpu" in axes.get_title()
    lines = series_lines(axes)
    assert len(lines) == len(rows) - 1
    assert_distinct_styles(lines)
    assert legend_texts(figure)[0] == "ddp ×1 amp"
    assert legend_texts(figure)[-1] == "horovod ×2 amp (KILLED)"
    assert_legend_outside(figure)


def test_identical_runs_are_not_drawn_apart_on_a_hairline_accuracy_axis():
    rows = [make_row("single", 1, p, 100.0) for p in ("amp", "bf16")]
    records = [record_for(row, 5.0) for row in rows]
    records[1].histories["val_acc"] = [
        (e, acc + 0.0007) for e, acc in records[0].history("val_acc")
    ]
    (axes,) = accuracy_vs_time_figure(rows, records).axes
    low, high = axes.get_ylim()
    assert high - low >= MIN_ACCURACY_SPAN and low >= 0 and high <= 1
    records = [record_for(row, 5.0) for row in rows]
    for record in records:  # all at one accuracy: still a span, centred on it
        record.histories["val_acc"] = [(e, 0.75) for e in (1, 2, 3)]
    low, high = accuracy_vs_time_figure(rows, records).axes[0].get_ylim()
    assert high - low >= MIN_ACCURACY_SPAN and low < 0.75 < high


def repeat_record(precision: str, index: int, accuracy: list[float]) -> RunRecord:
    """Repeat `index` of `precision` in one sweep with repeats=3: its val_acc per epoch."""
    return RunRecord(
        run_id=f"{precision}{index}",
        name=f"r{index + 1} {precision} simple_cnn-single",
        status="FINISHED",
        start_time=index,
        tags={"parallelism": "single", "world_size": "1", "precision": precision,
              "model": "simple_cnn", "data": "fashion_mnist", "repeats": "3",
              "repeat_index": str(index), "config_id": precision,
              "mlflow.parentRunId": "sweep"},
        metrics={"timed_steps": 20},
        histories={
            "samples_per_s": [(1, 50.0), (2, 100.0)],
            "val_acc": list(enumerate(accuracy, 1)),
            "elapsed_s": [(1, 10.0 + index), (2, 20.0 + index)],
        },
    )  # fmt: skip


def test_repeats_draw_their_mean_accuracy_with_its_interval():
    accuracy = {"fp32": [[0.60, 0.70], [0.62, 0.74], [0.61, 0.72]], "amp": [[0.6, 0.7]] * 3}
    records = [repeat_record(p, i, acc) for p, runs in accuracy.items()
               for i, acc in enumerate(runs)]  # fmt: skip
    rows = compare(records)
    figure = accuracy_vs_time_figure(rows, records)
    (axes,) = figure.axes
    lines = {line.get_label(): line for line in series_lines(axes)}
    assert set(lines) == {"single ×1 fp32 (mean of 3)", "single ×1 amp (mean of 3)"}
    fp32 = lines["single ×1 fp32 (mean of 3)"]
    assert list(fp32.get_xdata()) == pytest.approx([11.0, 21.0])  # the mean elapsed time
    assert list(fp32.get_ydata()) == pytest.approx([0.61, 0.72])
    # each point's bar: the t interval of the repeats' accuracies, computed here by hand
    second = [0.70, 0.74, 0.72]
    half = scipy_stats.t.ppf(0.975, 2) * np.std(second, ddof=1) / np.sqrt(3)
    assert [0.72 - half, 0.72 + half] in interval_bars(axes)
    assert "95 % interval over repeats" in axes.get_ylabel()


# --- the ladder keeps working ---------------------------------------------------------------------
def test_ladder_bars_from_zero_titled_with_its_model_and_data():
    from accelexp.report.ladder import LadderRow

    rungs = [
        LadderRow(0, "fp32", "FINISHED", model="simple_cnn", data="synthetic", samples_per_s=100),
        LadderRow(1, "tf32", "FAILED", model="simple_cnn", data="synthetic"),
    ]
    (axes,) = ladder_figure(rungs).axes
    assert axes.get_ylim()[0] == 0
    assert "simple_cnn on synthetic" in axes.get_title()
    assert "FAILED" in {t.get_text() for t in axes.texts}


# --- end to end: records -> compare -> PNG files ------------------------------------------------
def run_record(
    name: str, parallelism: str, workers: int, precision: str, samples: float
) -> RunRecord:
    """A finished run as `accelexp.tracking.query` reads it back: tags and per-epoch histories
    (the first epoch is warm-up, slower)."""
    return RunRecord(
        run_id=name,
        name=name,
        status="FINISHED",
        start_time=1,
        tags={
            "parallelism": parallelism,
            "world_size": str(workers),
            "precision": precision,
            "model": "simple_cnn",
            "data": "fashion_mnist",
            "device": "cpu",
        },
        metrics={"timed_steps": 20},
        histories={
            "samples_per_s": [(1, samples / 3), (2, samples), (3, samples)],
            "val_acc": [(1, 0.5), (2, 0.6), (3, 0.7)],
            "elapsed_s": [(1, 10.0), (2, 20.0), (3, 30.0)],
        },
    )


def test_write_plots_writes_pngs_with_the_amp_gain_only_when_there_is_one(tmp_path):
    records = [
        run_record("ddp1-fp32", "ddp", 1, "fp32", 100),
        run_record("ddp1-amp", "ddp", 1, "amp", 160),
        run_record("ddp1-bf16", "ddp", 1, "bf16", 160),
        run_record("ddp2-fp32", "ddp", 2, "fp32", 180),
        run_record("ddp2-amp", "ddp", 2, "amp", 300),
    ]
    rows = compare(records)
    assert AMP_GAIN_PLOT in PLOT_NAMES
    paths = write_plots(rows, records, tmp_path)
    assert {p.name for p in paths} == set(PLOT_NAMES)
    assert "simple_cnn on fashion_mnist, cpu" in throughput_figure(rows).axes[0].get_title()
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC, path.name

    fp32_only = [r for r in records if r.setting("precision") == "fp32"]
    (tmp_path / LADDER_PLOT).write_bytes(PNG_MAGIC)  # an older report's plots
    paths = write_plots(compare(fp32_only), fp32_only, tmp_path)
    assert {p.name for p in paths} == set(PLOT_NAMES) - {AMP_GAIN_PLOT}
    assert {p.name for p in tmp_path.iterdir()} == set(PLOT_NAMES) - {AMP_GAIN_PLOT}
