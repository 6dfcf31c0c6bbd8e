"""Memory against speed: one `MemoryRow` per run, and the plot of the one against the other.

For the study `+experiment=memory_vs_speed` (ddp, fsdp, model and hybrid parallelism on a ViT and
a ResNet-50, each with and without activation checkpointing), or any selection:
`accelexp-report --experiment memory_vs_speed --memory`. A row gives what the run was (model,
parallelism, activation checkpointing, workers, devices), its steady-state samples/s in all
and per device (`compare.measure`, the figure of the main table), and per device the peak memory
(`peak_mem_mb`, the highest of its epochs: CUDA's allocator peak on a GPU — the fullest of a
worker's devices —, the process's peak RSS on a CPU), the memory its training state holds
(`state_mem_mb`: the parameters, gradients and optimizer state a worker holds, divided evenly
among the worker's devices when it drives several: model, hybrid), the peak of live tensors over
one training step (`step_peak_mb`, measured on a CPU after training with `max_batch.search=true`:
what the process's RSS cannot show, since about a GiB of it is the libraries) and the largest
per-worker batch that fit (`max_batch`, searched on a GPU with `max_batch.search=true`). A figure
left blank has its reason in `note`.

A pipeline across ranks (`parallelism=pipeline`: its preset's `per_rank`)
is in the table with its speed and its peak (`peak_mem_mb`: the fullest rank's), but not its
state or step peak per device: each rank holds other stages, and rank 0 logs its own only, so
`state_mem_mb` is not the fullest device's (`stage<r>_peak_mem_mb` gives each rank's peak). It
pulls no lever of `LEVERS` (activation checkpointing and the largest-batch search are refused
under it); what its schedules save — 1F1B's activations against GPipe's — is measured per rank by
`benchmarks/pipeline_ranks.py`, not by the study.

`levers` weighs each memory lever a run pulled against the same run without it: `fsdp` against
`ddp`, activation checkpointing against none, FSDP's `cpu_offload` against its shards on the
device (`LEVERS`). "The same run" is like for like as the main report reads it
(`compare.comparable_settings`: model, data, precision, batch, workers, every other key), only the
lever's own keys differing; of several, the newest. A `LeverRow` gives the memory per device
with and without (the step's tensor peak where both measured it, else the peak memory) and the
samples/s per device with and without, and their relative changes (read as, e.g., `ac:full vs
none: -38 % memory, -27 % speed`).

`memory_vs_speed_figure` plots samples/s against memory per device (the step's tensor peak where
it was measured, else the peak memory), one panel per model,
one colour and marker per parallelism (and checkpointing, when the runs differ in it), both
axes from 0. Pure: records in, rows out, rows in, figure out; `write_memory_report` writes
memory.csv, memory.md (the lever table its second section), memory_levers.csv and
memory_vs_speed.png.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from accelexp.parallel import STRATEGIES, shards
from accelexp.record import (
    ACTIVATION_CHECKPOINTING,
    DATA,
    DEVICE,
    FINISHED,
    MAX_BATCH,
    MODEL,
    NUM_DEVICES,
    PARALLELISM,
    PEAK_MEM_MB,
    PRECISION,
    STATE_MEM_MB,
    STEP_PEAK_MB,
)
from accelexp.report.compare import (
    PARALLELISM_ORDER,
    comparable_settings,
    differ_text,
    differences,
    measure,
    peak_memory,
    setting,
    world_size,
)
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
LEVERS_CSV = "memory_levers.csv"
LEVERS_HEADING = "## Memory saved against speed lost, per lever"
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
    checkpointing: str = "none"  # activation checkpointing: none | full | every<k> | op
    samples_per_s: float | None = None
    samples_per_s_per_device: float | None = None
    peak_mem_mb: float | None = None
    state_mem_mb: float | None = None
    step_peak_mb: float | None = None
    max_batch: int | None = None
    note: str = ""

    @property
    def label(self) -> str:
        """`vit_tiny ddp ×2` (`ac:full` added when checkpointed): what the run was, for its note
        under a table."""
        ac = f" ac:{self.checkpointing}" if self.checkpointing != "none" else ""
        return f"{self.model} {self.parallelism} ×{self.world_size or '?'}{ac}"


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
        "checkpointing": "AC",  # activation checkpointing: none, full, every<k>, op
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
    fold=frozenset({"model", "parallelism", "checkpointing"}),
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
        checkpointing=setting(record, ACTIVATION_CHECKPOINTING) or "none",
    )
    if record.status != FINISHED:
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
    preset = STRATEGIES.get(row.parallelism)
    partial = preset.per_rank if preset else None
    if partial:
        notes.append(partial)
    elif state is None:
        notes.append(f"no {STATE_MEM_MB} logged (a run from before it existed)")
    else:  # a worker over several devices (model, hybrid): split evenly among them
        row.state_mem_mb = state / max(1, (row.num_devices or 1) // (row.world_size or 1))
    step = record.metrics.get(STEP_PEAK_MB)  # on a CPU, measured after training
    if step is not None and not partial:
        row.step_peak_mb = step / max(1, (row.num_devices or 1) // (row.world_size or 1))
    searched = record.metrics.get(MAX_BATCH)
    if searched is not None:
        row.max_batch = int(searched)
    else:
        notes.append(f"max batch {record.tags[MAX_BATCH]}" if MAX_BATCH in record.tags
                     else NOT_SEARCHED)  # fmt: skip
    row.note = NOTE_SEPARATOR.join(notes)
    return row


def _parallelism_order(parallelism: str) -> int:
    return PARALLELISM_ORDER.index(parallelism) if parallelism in PARALLELISM_ORDER else 99


def _sort_key(row: MemoryRow) -> tuple:
    return (
        row.model, _parallelism_order(row.parallelism), row.parallelism, row.world_size or 0,
        row.precision, row.checkpointing != "none", row.checkpointing, row.run_name,
    )  # fmt: skip


def memory_rows(records: Sequence[RunRecord]) -> list[MemoryRow]:
    """One row per run: by model, then parallelism (PARALLELISM_ORDER), workers, precision,
    checkpointing (none first)."""
    return sorted(map(memory_row, records), key=_sort_key)


# --- the levers: memory saved against speed lost ------------------------------------------------
@dataclass(frozen=True)
class Lever:
    """A way to need less memory per device: which runs pulled it (`on`), which runs are the same
    without it (`off`), and the keys the two may differ in (`varies`, as `compare.differences`
    reads it: the lever's own, and what follows from them)."""

    name: str  # its words in the table: `fsdp vs ddp`
    on: Callable[[MemoryRow, RunRecord], bool]
    off: Callable[[MemoryRow, RunRecord], bool]
    varies: re.Pattern[str]


def _offloaded(record: RunRecord) -> bool:
    return (record.params.get("parallelism.cpu_offload") or "").lower() == "true"


def _checkpointing_lever(mode: str) -> Lever:
    return Lever(
        f"ac:{mode} vs none",
        lambda row, _: row.checkpointing == mode,
        lambda row, _: row.checkpointing == "none",
        # the switch, its option, and the `speed` tag that sums the switches up (the others are
        # their own params, compared)
        re.compile(r"speed|speed\.(activation_checkpointing|selective_ac_option)"),
    )


# the levers a memory report weighs, in its order; activation checkpointing's per mode it has
# (`accelexp.speed.SpeedSwitches.checkpointing`), added by `levers` as the runs have them
def _sharding_lever(sharded: str, unsharded: str) -> Lever:
    """Parameters, gradients and optimizer state sharded (preset `sharded`, its shards on the
    device) against replicated (`unsharded`, the strategy table's twin); the same workers."""
    return Lever(
        f"{sharded} vs {unsharded}",
        lambda row, record: row.parallelism == sharded and not _offloaded(record),
        lambda row, _: row.parallelism == unsharded,
        # the option and its sync; every key only one of them has (fsdp's granularity,
        # ddp's buckets) is not compared
        re.compile(r"parallelism(\.(name|sync))?"),
    )


LEVERS = (
    *(
        _sharding_lever(name, preset.unsharded)
        for name, preset in STRATEGIES.items()
        if preset.unsharded is not None
    ),
    Lever(  # a sharding preset's shards in host memory, against on the device
        "cpu_offload vs none",
        lambda row, record: shards(row.parallelism) and _offloaded(record),
        lambda row, record: shards(row.parallelism) and not _offloaded(record),
        re.compile(r"parallelism\.cpu_offload"),
    ),
)


@dataclass
class LeverRow:
    """One lever on one run against the same run without it; None where a figure is missing on
    either side (`note` says why). Changes are relative: -0.38 is 38 % less."""

    model: str
    lever: str
    parallelism: str  # the run's with the lever (fsdp's, for `fsdp vs ddp`)
    world_size: int | None
    precision: str
    checkpointing: str  # the run's with the lever
    run_name: str
    baseline_run: str  # the same run without it
    memory: str = ""  # which figure: `step peak` (tensors, a CPU's) or `peak mem`
    memory_mb: float | None = None  # per device, with the lever
    baseline_memory_mb: float | None = None  # per device, without
    memory_change: float | None = None
    samples_per_s_per_device: float | None = None
    baseline_samples_per_s_per_device: float | None = None
    speed_change: float | None = None
    note: str = ""

    @property
    def status(self) -> str:
        """What the tables style a row by: a lever is weighed on finished runs only."""
        return FINISHED

    @property
    def label(self) -> str:
        """`vit_tiny ac:full vs none (ddp ×2)`: the lever and the run, for its note."""
        shown = self.checkpointing != "none" and not self.lever.startswith("ac:")
        ac = f" ac:{self.checkpointing}" if shown else ""
        return f"{self.model} {self.lever} ({self.parallelism} ×{self.world_size or '?'}{ac})"


LEVERS_TABLE = GroupedNotes(  # the readable tables leave the figures without it to memory.md's
    row_type=LeverRow,
    headers={
        "model": "model",
        "lever": "lever",
        "parallelism": "parallelism",
        "world_size": "workers",
        "precision": "precision",
        "checkpointing": "AC",
        "memory": "memory per device",
        "memory_mb": "MiB with it",
        "memory_change": "memory Δ",
        "samples_per_s_per_device": "samples/s per device with it",
        "speed_change": "speed Δ",
    },
    display={
        "memory_mb": "{:.1f}",
        "baseline_memory_mb": "{:.1f}",
        "memory_change": "{:+.0%}",
        "samples_per_s_per_device": "{:.1f}",
        "baseline_samples_per_s_per_device": "{:.1f}",
        "speed_change": "{:+.0%}",
    },
    plain_numbers=frozenset({"world_size"}),
    missing="—",
    fold=frozenset({"model", "lever", "parallelism", "checkpointing", "memory"}),
    widths={"lever": 15, "memory": 9, "samples_per_s_per_device": 10},
    compact=True,
    note="note",
    label="label",
)


def _change(value: float | None, baseline: float | None) -> float | None:
    return None if value is None or not baseline else value / baseline - 1


def _same_memory(row: MemoryRow, base: MemoryRow) -> tuple[str, float | None, float | None]:
    """(which, with, without): the step's tensor peak where both measured it, else the peak."""
    if row.step_peak_mb is not None and base.step_peak_mb is not None:
        return "step peak", row.step_peak_mb, base.step_peak_mb
    return "peak mem", row.peak_mem_mb, base.peak_mem_mb


def lever_row(
    lever: Lever, mine: tuple[MemoryRow, RunRecord], others: Sequence[tuple[MemoryRow, RunRecord]]
) -> LeverRow:
    """`lever` on `mine` against the newest like-for-like of `others` (finished runs without it,
    of the same model); blank figures and why when none is alike, or a figure is missing."""
    row, record = mine
    result = LeverRow(
        model=row.model, lever=lever.name, parallelism=row.parallelism,
        world_size=row.world_size, precision=row.precision, checkpointing=row.checkpointing,
        run_name=row.run_name, baseline_run="",
    )  # fmt: skip
    settings = comparable_settings(record)
    diffs = [differences(settings, comparable_settings(other), lever.varies) for _, other in others]
    alike = [pair for pair, diff in zip(others, diffs, strict=True) if not diff]
    if not alike:
        (nearest, _), diff = min(zip(others, diffs, strict=True),
                                 key=lambda o: (len(o[1]), -o[0][1].start_time))  # fmt: skip
        result.note = (
            f"no like-for-like run without it: nearest ({nearest.run_name}) differs in "
            f"{differ_text(diff)}"
        )
        return result
    base, _ = max(alike, key=lambda pair: pair[1].start_time)
    result.baseline_run = base.run_name
    result.memory, result.memory_mb, result.baseline_memory_mb = _same_memory(row, base)
    result.memory_change = _change(result.memory_mb, result.baseline_memory_mb)
    result.samples_per_s_per_device = row.samples_per_s_per_device
    result.baseline_samples_per_s_per_device = base.samples_per_s_per_device
    result.speed_change = _change(row.samples_per_s_per_device, base.samples_per_s_per_device)
    missing = [
        f"{what} {side}" for what, side, value in (
            (f"no {result.memory}", "with it", result.memory_mb),
            (f"no {result.memory}", f"without it ({base.run_name})", result.baseline_memory_mb),
            ("no samples/s", "with it", row.samples_per_s),
            ("no samples/s", f"without it ({base.run_name})", base.samples_per_s),
        ) if value is None
    ]  # fmt: skip
    if missing:
        result.note = NOTE_SEPARATOR.join(missing) + " (the memory table says why)"
    return result


def levers(records: Sequence[RunRecord]) -> list[LeverRow]:
    """Each lever (`LEVERS`, and activation checkpointing in each mode the runs have) on each
    finished run that pulled it, against the same run without it: by model, lever, parallelism,
    workers, precision, checkpointing (none first)."""
    runs = [(memory_row(r), r) for r in records if r.status == FINISHED]
    modes = sorted({row.checkpointing for row, _ in runs} - {"none"})
    rows = []
    for lever in (*LEVERS[:1], *map(_checkpointing_lever, modes), *LEVERS[1:]):
        for row, record in runs:
            if not lever.on(row, record):
                continue
            others = [o for o in runs if o[0].model == row.model and lever.off(*o)]
            if others:  # a lever with nothing to weigh it against is no row
                rows.append(lever_row(lever, (row, record), others))
    order = {name: i for i, name in enumerate(dict.fromkeys(row.lever for row in rows))}
    return sorted(rows, key=lambda r: (
        r.model, order[r.lever], _parallelism_order(r.parallelism), r.world_size or 0,
        r.precision, r.checkpointing != "none", r.checkpointing, r.run_name,
    ))  # fmt: skip


def _series_label(rows: Sequence[MemoryRow]) -> Callable[[MemoryRow], str]:
    """A row's series: its parallelism, and its precision and its checkpointing (`ac:full`,
    `ac:none`) when the rows differ in them."""
    precisions = len({row.precision for row in rows}) > 1
    checkpointing = len({row.checkpointing for row in rows}) > 1

    def label(row: MemoryRow) -> str:
        parts = [row.parallelism, row.precision if precisions else ""]
        parts.append(f"ac:{row.checkpointing}" if checkpointing else "")
        return " ".join(filter(None, parts))

    return label


def _memory(row: MemoryRow) -> float | None:
    """What the plot places a run at: the step's tensor peak where measured (a CPU), else the
    peak memory (a GPU's allocator peak)."""
    return row.step_peak_mb if row.step_peak_mb is not None else row.peak_mem_mb


def memory_vs_speed_figure(rows: Sequence[MemoryRow]) -> Any | None:
    """samples/s against peak memory per device, a panel per model (each its own scales), a
    colour and marker per parallelism (and precision and checkpointing, when the runs differ in
    them; the same in every panel), each point labelled with its workers; both axes from 0. None
    when no row has both figures."""
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
    several = len({row.checkpointing for row in plotted}) > 1
    title = "parallelism, checkpointing" if several else "parallelism"
    _legend_outside(figure, [(handle, label) for label, handle in handles.items()], title=title)
    return figure


def plot_memory_vs_speed(rows: Sequence[MemoryRow], path: Path) -> Path | None:
    """`memory_vs_speed_figure` saved to `path`; None (and no file) with nothing to plot."""
    return _save(memory_vs_speed_figure(rows), path)


def memory_markdown(rows: Sequence[MemoryRow], lever_rows: Sequence[LeverRow] = ()) -> str:
    """The memory table, then (when a run pulled a lever) the lever table under its heading."""
    text = to_markdown(rows, MEMORY)
    if lever_rows:
        text += f"\n{LEVERS_HEADING}\n\n{to_markdown(lever_rows, LEVERS_TABLE)}"
    return text


def write_memory_report(
    rows: Sequence[MemoryRow],
    out_dir: Path,
    plots: bool = True,
    lever_rows: Sequence[LeverRow] = (),
) -> list[Path]:
    """memory.csv and memory.md (with the lever table), LEVERS_CSV when a run pulled a lever,
    and MEMORY_PLOT when there is something to plot (else no file, nor an older report's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, markdown_path = (out_dir / name for name in MEMORY_NAMES)
    csv_path.write_text(to_csv(rows, MEMORY))
    markdown_path.write_text(memory_markdown(rows, lever_rows))
    written = [csv_path, markdown_path]
    levers_path = out_dir / LEVERS_CSV
    if lever_rows:
        levers_path.write_text(to_csv(lever_rows, LEVERS_TABLE))
        written.append(levers_path)
    else:
        levers_path.unlink(missing_ok=True)
    if plots:
        written += save_or_remove(memory_vs_speed_figure(rows), out_dir / MEMORY_PLOT)
    return written
