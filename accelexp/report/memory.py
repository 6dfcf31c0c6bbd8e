"""Memory against speed: one `MemoryRow` per run, and the plot of the one against the other.

For the study `+experiment=memory_vs_speed` (ddp, fsdp, model and hybrid parallelism on a ViT and
a ResNet-50), or any selection: `accelexp-report --experiment memory_vs_speed --memory`. A row
gives what the run was (model, parallelism, workers, devices), its steady-state samples/s in all
and per device (`compare.measure`, the figure of the main table), and per device the peak memory
(`peak_mem_mb`, the highest of its epochs: CUDA's allocator peak on a GPU — the fullest of a
worker's devices —, the process's peak RSS on a CPU), the memory its training state holds
(`state_mem_mb`: the parameters, gradients and optimizer state a worker holds, divided evenly
among the worker's devices when it drives several: model, hybrid), the peak of live tensors over
one training step (`step_peak_mb`, measured on a CPU after training with `max_batch.search=true`:
what the process's RSS cannot show, since about a GiB of it is the libraries) and the largest
per-worker batch that fit (`max_batch`, searched on a GPU with `max_batch.search=true`). A figure
left blank has its reason in `note`.

`memory_vs_speed_figure` plots samples/s against memory per device (the step's tensor peak where
it was measured, else the peak memory), one panel per model,
one colour and marker per parallelism, both axes from 0. Pure: records in, rows out, rows in,
figure out; `write_memory_report` writes memory.csv, memory.md and memory_vs_speed.png.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from accelexp.record import (
    DATA,
    DEVICE,
    MAX_BATCH,
    MODEL,
    NUM_DEVICES,
    PARALLELISM,
    PEAK_MEM_MB,
    PRECISION,
    STATE_MEM_MB,
    STEP_PEAK_MB,
)
from accelexp.report.compare import PARALLELISM_ORDER, measure, peak_memory, setting, world_size
from accelexp.report.formats import Layout, to_csv, to_markdown
from accelexp.report.plots import (
    _legend_outside,
    _save,
    save_or_remove,
    series_styles,
    title_subject,
)
from accelexp.tracking.query import RunRecord

MEMORY_PLOT = "memory_vs_speed.png"
MEMORY_NAMES = ("memory.csv", "memory.md")
NOTE_SEPARATOR = "; "  # between the reasons of a row's note
NOT_SEARCHED = "max batch not searched (max_batch.search=false)"
PANEL_SIZE = (5.2, 4.6)  # inches, one model's panel
# rows and legend entries in this order: whole replicas, sharded, then split models


@dataclass
class MemoryRow:
    """One run's speed and memory per device; None where a figure is missing (`note` says why)."""

    run_name: str
    run_id: str
    status: str
    model: str
    parallelism: str
    world_size: int | None  # worker processes
    num_devices: int | None  # devices doing the work (model: its stages' devices)
    precision: str
    data: str
    device: str
    samples_per_s: float | None = None
    samples_per_s_per_device: float | None = None
    peak_mem_mb: float | None = None
    state_mem_mb: float | None = None
    step_peak_mb: float | None = None
    max_batch: int | None = None
    note: str = ""

    @property
    def label(self) -> str:
        """`vit_tiny ddp ×2`: what the run was, for its note under a table."""
        return f"{self.model} {self.parallelism} ×{self.world_size or '?'}"


MEMORY_COLUMNS = tuple(f.name for f in fields(MemoryRow))
MEMORY_DISPLAY = {
    "samples_per_s": "{:.1f}",
    "samples_per_s_per_device": "{:.1f}",
    "peak_mem_mb": "{:.0f}",
    "state_mem_mb": "{:.1f}",
    "step_peak_mb": "{:.1f}",
    "max_batch": "{:d}",
}


@dataclass(frozen=True)
class GroupedNotes(Layout):
    """A layout whose notes say each reason once, naming the rows it applies to ("every run"
    when all of several rows share it): the study's CPU runs all lack a max batch alike."""

    def notes(self, rows: Sequence[Any]) -> list[str]:
        if self.note is None:
            return []
        names: dict[str, list[str]] = {}
        for row in rows:
            for reason in filter(None, getattr(row, self.note).split(NOTE_SEPARATOR)):
                names.setdefault(reason, []).append(getattr(row, self.label))
        return [
            f"{'every run' if len(rows) > 1 and len(who) == len(rows) else ', '.join(who)}: {why}"
            for why, who in names.items()
        ]


MEMORY = GroupedNotes(
    row_type=MemoryRow,
    headers={
        "model": "model",
        "parallelism": "parallelism",
        "world_size": "workers",
        "num_devices": "devices",
        "samples_per_s": "samples/s",
        "samples_per_s_per_device": "samples/s per device",
        "peak_mem_mb": "peak mem per device (MiB)",
        "state_mem_mb": "state mem per device (MiB)",
        "step_peak_mb": "step peak per device (MiB)",
        "max_batch": "max batch per worker",
    },
    display=MEMORY_DISPLAY,
    plain_numbers=frozenset({"world_size", "num_devices"}),
    missing="—",
    fold=frozenset({"model", "parallelism"}),
    widths=dict.fromkeys(
        ["samples_per_s_per_device", "peak_mem_mb", "state_mem_mb", "step_peak_mb", "max_batch"],
        10,
    ),
    compact=True,
    note="note",
    label="label",
)


def _int(text: str | None) -> int | None:
    try:
        return int(text or "")
    except ValueError:
        return None


def memory_row(record: RunRecord) -> MemoryRow:
    """The run's row (its figures only when it FINISHED)."""
    row = MemoryRow(
        run_name=record.name,
        run_id=record.run_id,
        status=record.status,
        model=setting(record, MODEL) or "",
        parallelism=setting(record, PARALLELISM) or "",
        world_size=world_size(record),
        num_devices=_int(record.params.get(NUM_DEVICES)) or world_size(record),
        precision=setting(record, PRECISION) or "",
        data=setting(record, DATA) or "",
        device=record.tags.get(DEVICE, ""),
    )
    if record.status != "FINISHED":
        row.note = f"{record.status}: no figures"
        return row
    notes = []
    samples, why = measure(record)
    if samples is None:
        notes.append(why)
    else:
        row.samples_per_s = samples
        row.samples_per_s_per_device = samples / (row.num_devices or 1)
    row.peak_mem_mb = peak_memory(record)
    if row.peak_mem_mb is None:
        notes.append(f"no {PEAK_MEM_MB} logged")
    state = record.metrics.get(STATE_MEM_MB)  # what one worker holds, over all its devices
    if state is None:
        notes.append(f"no {STATE_MEM_MB} logged (a run from before it existed)")
    else:  # a worker over several devices (model, hybrid): split evenly among them
        row.state_mem_mb = state / max(1, (row.num_devices or 1) // (row.world_size or 1))
    step = record.metrics.get(STEP_PEAK_MB)  # on a CPU, measured after training
    if step is not None:
        row.step_peak_mb = step / max(1, (row.num_devices or 1) // (row.world_size or 1))
    searched = record.metrics.get(MAX_BATCH)
    if searched is not None:
        row.max_batch = int(searched)
    else:
        notes.append(f"max batch {record.tags[MAX_BATCH]}" if MAX_BATCH in record.tags
                     else NOT_SEARCHED)  # fmt: skip
    row.note = NOTE_SEPARATOR.join(notes)
    return row


def _sort_key(row: MemoryRow) -> tuple:
    order = PARALLELISM_ORDER.index(row.parallelism) if row.parallelism in PARALLELISM_ORDER else 99
    return (row.model, order, row.parallelism, row.world_size or 0, row.precision, row.run_name)


def memory_rows(records: Sequence[RunRecord]) -> list[MemoryRow]:
    """One row per run: by model, then parallelism (PARALLELISM_ORDER), workers, precision."""
    return sorted(map(memory_row, records), key=_sort_key)


def _series_label(rows: Sequence[MemoryRow]) -> Callable[[MemoryRow], str]:
    """A row's series: its parallelism, and its precision when the rows differ in it."""
    if len({row.precision for row in rows}) > 1:
        return lambda row: f"{row.parallelism} {row.precision}"
    return lambda row: row.parallelism


def _memory(row: MemoryRow) -> float | None:
    """What the plot places a run at: the step's tensor peak where measured (a CPU), else the
    peak memory (a GPU's allocator peak)."""
    return row.step_peak_mb if row.step_peak_mb is not None else row.peak_mem_mb


def memory_vs_speed_figure(rows: Sequence[MemoryRow]) -> Any | None:
    """samples/s against peak memory per device, a panel per model (each its own scales), a
    colour and marker per parallelism (and precision, when the runs differ in it; the same in
    every panel), each point labelled with its
    workers; both axes from 0. None when no row has both figures."""
    plotted = [r for r in rows if r.samples_per_s is not None and _memory(r) is not None]
    if not plotted:
        return None
    models = list(dict.fromkeys(row.model for row in plotted))
    label = _series_label(plotted)
    styles = series_styles(map(label, plotted))
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    size = (PANEL_SIZE[0] * len(models) + 1.6, PANEL_SIZE[1])  # + the legend's width
    figure = Figure(figsize=size, layout="constrained")
    panels = figure.subplots(1, len(models), squeeze=False)[0]
    handles: dict[str, Any] = {}
    for axes, model in zip(panels, models, strict=True):
        mine = [row for row in plotted if row.model == model]
        for row in mine:
            colour, marker = styles[label(row)]
            (point,) = axes.plot(
                _memory(row), row.samples_per_s, linestyle="none", color=colour,
                marker=marker, markersize=9, label=label(row),
            )  # fmt: skip
            handles.setdefault(label(row), point)
            axes.annotate(
                f"×{row.num_devices or '?'}", (_memory(row), row.samples_per_s),
                textcoords="offset points", xytext=(6, 4), fontsize="small",
            )  # fmt: skip
        axes.set_xlim(0, max(_memory(row) for row in mine) * 1.2)
        axes.set_ylim(0, max(row.samples_per_s for row in mine) * 1.15)
        axes.set_title(model)
        step = all(row.step_peak_mb is not None for row in mine)
        axes.set_xlabel(
            "peak tensor memory of a step per device (MiB)"
            if step
            else "peak memory per device (MiB)"
        )
        axes.set_ylabel("samples/s (steady-state median, all devices)")
        axes.grid(alpha=0.3)
        axes.set_axisbelow(True)
    subject = title_subject(
        [row.model for row in plotted], [row.data for row in plotted],
        [row.device for row in plotted],
    )  # fmt: skip
    figure.suptitle(f"Speed vs peak memory per device (labels: devices)\n{subject}")
    _legend_outside(figure, list((handle, label) for label, handle in handles.items()),
                    title="parallelism")  # fmt: skip
    return figure


def plot_memory_vs_speed(rows: Sequence[MemoryRow], path: Path) -> Path | None:
    """`memory_vs_speed_figure` saved to `path`; None (and no file) with nothing to plot."""
    return _save(memory_vs_speed_figure(rows), path)


def write_memory_report(rows: Sequence[MemoryRow], out_dir: Path, plots: bool = True) -> list[Path]:
    """memory.csv and memory.md, and MEMORY_PLOT when there is something to plot (else no
    file, nor an older report's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, markdown_path = (out_dir / name for name in MEMORY_NAMES)
    csv_path.write_text(to_csv(rows, MEMORY))
    markdown_path.write_text(to_markdown(rows, MEMORY))
    written = [csv_path, markdown_path]
    if plots:
        written += save_or_remove(memory_vs_speed_figure(rows), out_dir / MEMORY_PLOT)
    return written
