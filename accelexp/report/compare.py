"""The comparison: one `Row` per run, with its throughput, speedup, scaling efficiency, AMP gain.

Throughput is steady-state only. The engine leaves the warm-up steps of a run's first trained
epoch out of its timing and logs per epoch how many steps it timed (`timed_steps`); a run's
throughput is the median `samples_per_s` of its epochs after the first (those pay no warm-up at
all), else its only epoch's. Below `MIN_STEADY_STEPS` timed steps in the epochs used there is no
figure but a note saying so: under ten steps, one-off costs still inside the timing (an epoch's
first batch, its final synchronisation, one stray slow step) move the figure by 10 % or more,
enough to fake a gain. A run logged before `timed_steps` existed keeps the rule of its time when
it has several epochs; its only epoch, warm-up included, gets no figure.

Comparisons are like for like. Speedup divides a row's throughput by its baseline's: a finished
run matching `--baseline` that differs from the row only in what scaling varies — the
parallelism, the world's shape and the precision (`SPEEDUP_VARIES`), and what `--baseline` names
(`speed=eager` makes speedup the gain of the speed switches too); of several, the one of the
same parallelism, then the newest. Scaling efficiency is speedup per added worker. AMP gain divides
a mixed-precision row's throughput by an fp32 run that differs from it in the precision only
(`AMP_VARIES`). "Differs" is read from everything a run logs about itself: its params (the whole
resolved config, the world's shape, the torch version, where the data lives), its config tags and
its `device` tag — except the keys that cannot change speed
(`accelexp.config.identity.ignored_for_speed`: tracking, seed, progress output, evaluation-only
sizes, facts derived from the model and data).
A key only one of two runs logged is not compared (it did not exist yet). When no like-for-like run
exists the figure stays blank and `Row.note` says why, naming the nearest run and how it differs.

Repeats and intervals (`accelexp.stats`, docs/statistics.md). The runs of one configuration in
a sweep with `repeats` > 1 (same `config_id`, same parent run: `group_key`) are one row: its
samples/s the mean of the repeats with a t interval, a single run's its own batch-means interval
(`throughput_low/high`); speedup and AMP gain are ratios of configurations, paired by
`repeat_index` where both ran interleaved in one sweep, bootstrapped otherwise; accuracy is the
mean ± sd over repeats, time to target MLPerf's olympic mean. A run tagged `noise=contended` is
set aside: it is never behind a ratio or a baseline, a contended repeat is named in the note, a
configuration with only contended runs is shown, marked (`Row.noise`), and compared with nothing.
When every run of the selection was contended, `everything_set_aside` is one line saying so and
what to do, and the rows' notes leave the contention out.

A run that did not finish is a row with its status and no figures; one still RUNNING (on another
host, or alive here: the query failed this host's runs whose process is gone) says so in its
note, as does a run failed that way (`status_note`).

Pure: records in, rows out. A run from before a setting existed reads as that setting's default
(`SETTING_DEFAULTS`: no `speed` tag is `eager`, no `activation_checkpointing` tag `none`).
"""

from __future__ import annotations

import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from accelexp import stats
from accelexp.config.identity import ignored_for_speed
from accelexp.errors import AccelexpError
from accelexp.parallel import STRATEGIES
from accelexp.precision import NAMES, Name
from accelexp.record import (
    ACTIVATION_CHECKPOINTING,
    BEST_VAL_ACC,
    COMPARE,
    COMPARE_LOCKSTEP,
    COMPILE_S,
    CONFIG_ID,
    DATA,
    DEVICE,
    ENDED,
    FINISHED,
    FSDP_UNITS,
    HOST,
    LOCKSTEP_CONTENDED,
    LOCKSTEP_INCARNATION,
    LOCKSTEP_PROCESS,
    LOCKSTEP_SAMPLES_PER_S,
    MODEL,
    NOISE,
    NOISE_CONTENDED,
    NOISE_EVIDENCE,
    PARALLELISM,
    PARENT_RUN,
    PEAK_MEM_MB,
    PRECISION,
    PROCESS_SHARED,
    REPEAT_INDEX,
    REPEATS,
    RUNNING,
    SAMPLES_PER_S,
    SPEED,
    STAGE_FACT,
    TEST_ACC,
    THROUGHPUT,
    THROUGHPUT_HIGH,
    THROUGHPUT_LOW,
    THROUGHPUT_STEPS,
    TIME_TO_TARGET_S,
    TIMED_STEPS,
    WORLD_SHAPE,
    WORLD_SIZE,
)
from accelexp.stats import Estimate
from accelexp.tracking.query import RunRecord

DEFAULT_BASELINE = "world_size=1,precision=fp32"
BASELINE_KEYS = (WORLD_SIZE, PRECISION, PARALLELISM, MODEL, DATA, SPEED)
CONFIG_KEYS = (PARALLELISM, WORLD_SIZE, PRECISION, SPEED, MODEL, DATA)  # a run's name
PARALLELISM_ORDER = tuple(STRATEGIES)  # single, dp, ddp, horovod, fsdp, model, hybrid
PRECISION_ORDER = NAMES  # the precision package's order
SPEED_ORDER = ("eager",)  # then the others alphabetically
# what runs logged before the setting existed had
SETTING_DEFAULTS = {SPEED: "eager", ACTIVATION_CHECKPOINTING: "none"}
MIN_STEADY_STEPS = 10  # timed steps a throughput needs, over the epochs it uses (module doc)

# --- what "like for like" compares --------------------------------------------------------------
# not compared: the params that cannot change speed (accelexp.config.identity.ignored_for_speed)
# params that repeat a config tag (compared as the tag)
TAGGED_PARAMS = {*(f"{tag}.name" for tag in (MODEL, DATA, PARALLELISM, PRECISION)), WORLD_SIZE}
COMPARED_TAGS = (*CONFIG_KEYS, DEVICE)  # "device": the tag only, e.g. "NVIDIA H200"
# the world's shape: what scaling changes (besides parallelism.*), from Strategy.describe(), and
# how a CPU's cores are split among its workers (`threads`: left unset, the launcher gives each
# of N workers 1/N of the cores, so 1 and 2 workers differ in it)
WORLD_FACTS = re.compile(f"({'|'.join([*WORLD_SHAPE, STAGE_FACT.pattern, FSDP_UNITS, 'threads'])})")
PRECISION_KEYS = re.compile(r"precision(\..+)?")
SPEEDUP_VARIES = re.compile(rf"parallelism(\..+)?|{PRECISION_KEYS.pattern}|{WORLD_FACTS.pattern}")
AMP_VARIES = PRECISION_KEYS
SHOWN_DIFFERENCES = 4  # differences a note names, then "and N more"
# a ratio with a single run on a side: its interval knows that run's own noise only, and a
# shared machine drifts between runs by more (benchmarks/noise.py: ±12 % A/A on 5 pairs)
WITHIN_RUN = "interval from noise within single runs only: repeats=3 measures run-to-run drift"


class BaselineError(AccelexpError):
    """The --baseline selector is malformed or matches no finished run."""


@dataclass
class Row:
    """One configuration — one run, or the repeats of one (`repeats`) — compared with its
    baseline; None where a figure does not apply or is missing. A figure with an interval has
    its 95 % bounds in `<figure>_low` / `<figure>_high` (`accelexp.stats`)."""

    run_name: str
    run_id: str  # the run's, or the first repeat's
    status: str
    parallelism: str
    world_size: int | None
    precision: str
    speed: str
    model: str
    data: str
    device: str = ""  # the run's `device` tag, e.g. "cpu", "NVIDIA H200"; blank when absent
    repeats: int = 1  # the runs behind the figures (FINISHED, measured, not contended)
    samples_per_s: float | None = None
    samples_per_s_low: float | None = None
    samples_per_s_high: float | None = None
    speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    scaling_efficiency: float | None = None
    scaling_efficiency_low: float | None = None
    scaling_efficiency_high: float | None = None
    amp_gain: float | None = None
    amp_gain_low: float | None = None
    amp_gain_high: float | None = None
    best_val_acc: float | None = None
    test_acc: float | None = None  # the mean over the repeats
    test_acc_sd: float | None = None  # its standard deviation over the repeats (their seeds)
    time_to_target_s: float | None = None  # MLPerf's rule over repeats (stats.olympic_mean)
    compile_s: float | None = None
    peak_mem_mb: float | None = None
    baseline_run: str | None = None
    noise: str = ""  # "contended" when other work shared the machine (tag `noise`)
    paired: str = ""  # how the speedup's interval was made (`Estimate.method`): lockstep...
    note: str = ""  # why a figure is blank: too short to measure, no like-for-like run, contended

    @property
    def label(self) -> str:
        """The run's name, with its status when it did not finish, and how many repeats (a
        contended row is marked in the `noise` column, which no column width cuts)."""
        name = self.run_name if self.status == FINISHED else f"{self.run_name} ({self.status})"
        return f"{name} ×{self.repeats}" if self.repeats > 1 else name

    def estimate(self, figure: str) -> Estimate | None:
        value = getattr(self, figure)
        if value is None:
            return None
        low, high = getattr(self, f"{figure}_low", None), getattr(self, f"{figure}_high", None)
        return Estimate(value, low, high, self.repeats)

    def set(self, figure: str, estimate: Estimate) -> None:
        setattr(self, figure, estimate.value)
        setattr(self, f"{figure}_low", estimate.low)
        setattr(self, f"{figure}_high", estimate.high)


COLUMNS = tuple(f.name for f in fields(Row))


# --- reading a run ------------------------------------------------------------------------------
def setting(record: RunRecord, key: str) -> str | None:
    """`record.setting(key)`, or the default of a setting older runs did not log."""
    return record.setting(key) or SETTING_DEFAULTS.get(key)


def sweep_baseline(records: Sequence[RunRecord]) -> dict[str, str]:
    """What a sweep's own ratios are taken against: its first run's settings over the keys a
    baseline can name that vary within the sweep (`-m speed.channels_last=false,true`: its
    speed), or its world size and precision where none varies (the same for every run).
    Whichever side is the baseline, a ratio's relative half-width on the log scale is the same."""
    if not records:
        return parse_baseline(DEFAULT_BASELINE)
    first = min(records, key=lambda r: (r.tags.get(REPEAT_INDEX) != "0", r.start_time))
    varying = [k for k in BASELINE_KEYS if len({setting(r, k) for r in records}) > 1]
    keys = varying or [WORLD_SIZE, PRECISION]
    return {k: value for k in keys if (value := setting(first, k)) is not None}


def matches(record: RunRecord, selector: Mapping[str, str]) -> bool:
    return all(setting(record, key) == value for key, value in selector.items())


def measure(record: RunRecord) -> tuple[float | None, str]:
    """(steady-state samples/s, "") or (None, why there is none); see the module doc."""
    estimate, why = measure_estimate(record)
    return (estimate.value if estimate is not None else None), why


def measure_estimate(record: RunRecord) -> tuple[Estimate | None, str]:
    """(steady-state samples/s with its 95 % interval, "") or (None, why there is none).

    A run that logged `throughput` (the engine's figure over the timed steps of its epochs after
    the first, with the batch-means interval of their step times) is read as that; an older one
    by the rule of its time (the median of those epochs' `samples_per_s`), without an interval.
    """
    values = [value for _, value in record.history(SAMPLES_PER_S)]
    if not values:
        return None, f"no {SAMPLES_PER_S} logged"
    used = values[1:] or values
    # the last epoch's timed steps: an epoch after the first times all its steps, so every one
    # of `used` timed as many (a one-epoch run: the steps after warm-up)
    timed = record.metrics.get(TIMED_STEPS)
    if timed is None and len(values) == 1:
        return None, (
            f"its only epoch includes warm-up (logged before {TIMED_STEPS} existed); "
            "train 2 epochs or more"
        )
    steady = int(timed) * len(used) if timed is not None else None
    if steady is not None and steady < MIN_STEADY_STEPS:
        return None, (
            f"too short to measure: {steady} steady steps, need ≥ {MIN_STEADY_STEPS} "
            f"(raise max_steps_per_epoch or epochs)"
        )
    metrics = record.metrics
    if (value := metrics.get(THROUGHPUT)) is not None:
        low, high = metrics.get(THROUGHPUT_LOW), metrics.get(THROUGHPUT_HIGH)
        steps = int(metrics.get(THROUGHPUT_STEPS) or steady or 1)
        return Estimate(value, low, high, steps, "batch means" if low is not None else ""), ""
    return Estimate(statistics.median(used)), ""


def throughput(record: RunRecord) -> float | None:
    """Steady-state samples/s: the median of the epochs after the first, else the only epoch's
    (warm-up left out); None when the run is too short to measure (`measure` says why)."""
    return measure(record)[0]


def peak_memory(record: RunRecord) -> float | None:
    """The highest per-epoch peak (MB), else the run's last logged peak."""
    peaks = [value for _, value in record.history(PEAK_MEM_MB)]
    return max(peaks) if peaks else record.metrics.get(PEAK_MEM_MB)


def world_size(record: RunRecord) -> int | None:
    try:
        return int(record.setting(WORLD_SIZE) or "")
    except ValueError:
        return None


def comparable_settings(record: RunRecord) -> dict[str, str]:
    """What a run was, for like-for-like checks: params and config tags, less the params that
    cannot change speed (`accelexp.config.identity.ignored_for_speed`)."""
    params = {
        key: value
        for key, value in record.params.items()
        if not ignored_for_speed(key) and key not in TAGGED_PARAMS
    }
    tags = {key: value for key in CONFIG_KEYS if (value := setting(record, key))}
    if device := record.tags.get(DEVICE):
        tags[DEVICE] = device
    return tags | params


def differences(
    a: Mapping[str, str], b: Mapping[str, str], varies: re.Pattern[str]
) -> list[tuple[str, str, str]]:
    """(key, a's value, b's value) of the keys both logged that differ and may not vary; the
    config tags first, then the params alphabetically."""
    keys = [k for k in a.keys() & b.keys() if a[k] != b[k] and not varies.fullmatch(k)]
    return [(k, a[k], b[k]) for k in sorted(keys, key=lambda k: (k not in COMPARED_TAGS, k))]


def differ_text(diffs: Sequence[tuple[str, str, str]]) -> str:
    """`epochs (1 vs 3), data.batch_size (64 vs 128)`, at most SHOWN_DIFFERENCES of them."""
    shown = ", ".join(f"{k} ({a} vs {b})" for k, a, b in diffs[:SHOWN_DIFFERENCES])
    more = len(diffs) - SHOWN_DIFFERENCES
    return shown + (f" and {more} more" if more > 0 else "")


def describe(record: RunRecord) -> str:
    """`parallelism=ddp world_size=2 precision=fp32 speed=eager ...`, and a status not FINISHED."""
    config = " ".join(f"{key}={setting(record, key) or '?'}" for key in CONFIG_KEYS)
    return f"{config} ({record.status})" if record.status != FINISHED else config


# --- the comparison -----------------------------------------------------------------------------
def parse_baseline(text: str | Mapping[str, str]) -> dict[str, str]:
    """Parse a selector: 'world_size=1,precision=fp32' -> {'world_size': '1', ...}."""
    if isinstance(text, Mapping):
        pairs = {str(k): str(v) for k, v in text.items()}
    else:
        pairs = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or not key.strip() or not value.strip():
                raise BaselineError(
                    f"--baseline {text!r}: {part!r} is not key=value; use key=value pairs over "
                    f'{", ".join(BASELINE_KEYS)}, e.g. --baseline "{DEFAULT_BASELINE}"'
                )
            pairs[key.strip()] = value.strip()
    unknown = sorted(set(pairs) - set(BASELINE_KEYS))
    if unknown or not pairs:
        raise BaselineError(
            f"--baseline {text!r}: use key=value pairs over {', '.join(BASELINE_KEYS)}"
            + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        )
    return pairs


def _order(value: str | None, known: Sequence[str]) -> tuple[int, str]:
    value = value or ""
    return (known.index(value) if value in known else len(known), value)


def _sort_key(row: Row) -> tuple:
    return (
        _order(row.parallelism, PARALLELISM_ORDER),
        row.world_size if row.world_size is not None else sys.maxsize,
        _order(row.precision, PRECISION_ORDER),
        _order(row.speed, SPEED_ORDER),
        row.model,
        row.data,
        row.run_name,
    )


def group_key(record: RunRecord) -> str:
    """The runs that are repeats of one configuration share this: the sweep they ran in and
    their `config_id` (accelexp.train), where they were run with `repeats` > 1; any other run is
    a configuration of its own."""
    try:
        repeats = int(record.tags.get(REPEATS) or 1)
    except ValueError:
        repeats = 1
    config = record.tags.get(CONFIG_ID)
    if repeats <= 1 or not config:
        return record.run_id
    return f"{record.tags.get(PARENT_RUN, '')}/{config}"


def contention(record: RunRecord) -> str:
    """Why a run's speed is set aside ("" when it is not): the evidence of its `noise` tag. A
    lockstep run is judged slice by slice instead: its slices no neighbour shared still pair
    (`lockstep_slices`), so it is set aside only when it has none."""
    if record.tags.get(NOISE) != NOISE_CONTENDED:
        return ""
    if record.tags.get(COMPARE) == COMPARE_LOCKSTEP and lockstep_slices(record):
        return ""
    return record.tags.get(NOISE_EVIDENCE) or "other work shared the machine"


def everything_set_aside(records: Sequence[RunRecord]) -> str:
    """One line when every finished run of the selection was contended (so no ratio could be
    taken): how many, one run's evidence, and what to do; else "". The rows' notes then leave
    the contention out (`compare`), so the evidence is not repeated per repeat."""
    finished = [r for r in records if r.status == FINISHED]
    if not finished or not all(contention(r) for r in finished):
        return ""
    example = finished[0]
    runs = "the 1 run" if len(finished) == 1 else f"all {len(finished)} runs"
    return (
        f"Every run was set aside: {runs} were timed while other work shared the machine "
        f"(e.g. {example.name}: {contention(example)}), so no speedup or gain is shown. "
        f"Measure again on a quiet machine, or with compare=lockstep (the configurations take "
        f"turns, and a neighbour costs the slices it shared, not the runs)."
    )


def status_note(record: RunRecord) -> str:
    """Why a run that did not finish has no figures, where its status alone does not say it:
    still running (and where), or gone without a word (how that was found); else ""."""
    if record.status == RUNNING:
        host = record.tags.get(HOST)
        return f"still running{f' on {host}' if host else ''}: no figures until it ends"
    return record.tags.get(ENDED, "")


def repeat_label(record: RunRecord) -> str:
    index = record.tags.get(REPEAT_INDEX)
    return f"r{int(index) + 1}" if index not in (None, "") and index.isdigit() else record.name


@dataclass
class Group:
    """The runs of one configuration in the selection (its repeats), and those its figures come
    from: FINISHED, measured and not contended (`usable`), else the FINISHED ones measured."""

    key: str
    records: list[RunRecord]
    measured: dict[str, tuple[Estimate | None, str]]

    @property
    def finished(self) -> list[RunRecord]:
        return [r for r in self.records if r.status == FINISHED]

    @property
    def usable(self) -> list[RunRecord]:
        return [r for r in self.finished if self.measured[r.run_id][0] and not contention(r)]

    @property
    def shown(self) -> list[RunRecord]:
        """The runs its speed is shown from: the usable ones, else the measured contended ones."""
        return self.usable or [r for r in self.finished if self.measured[r.run_id][0]]

    @property
    def first(self) -> RunRecord:
        return (self.usable or self.finished or self.records)[0]

    @property
    def start_time(self) -> int:
        return max(r.start_time for r in self.records)

    @property
    def contended(self) -> bool:
        """Every finished run of it was timed while other work shared the machine."""
        return bool(self.finished) and all(contention(r) for r in self.finished)

    def samples(self) -> list[Estimate]:
        return [self.measured[r.run_id][0] for r in self.shown]  # type: ignore[misc]

    def throughput(self) -> Estimate | None:
        """One run's figure (with its own interval), or the repeats' geometric mean with the t
        interval of the logs (never below 0)."""
        samples = self.samples()
        if not samples:
            return None
        if len(samples) == 1:
            return samples[0]
        return stats.across_repeats_log([e.value for e in samples])

    def by_repeat(self) -> dict[str, Estimate]:
        """The usable runs' throughputs by repeat index (the key ratios pair them by)."""
        runs = self.usable
        return {r.tags.get(REPEAT_INDEX, r.run_id): self.measured[r.run_id][0] for r in runs}  # type: ignore[misc]

    def by_incarnation(self) -> dict[str, RunRecord]:
        """Its finished lockstep runs by repeat index (each repeat fresh processes, and each
        run's processes: `lockstep_pairs`); whether a neighbour shared the machine is judged
        slice by slice (`lockstep_slices`)."""
        return {
            r.tags.get(REPEAT_INDEX, r.run_id): r
            for r in self.finished
            if r.tags.get(COMPARE) == COMPARE_LOCKSTEP
        }

    @property
    def sweep(self) -> str | None:
        return self.first.tags.get(PARENT_RUN)

    def name(self) -> str:
        name = self.first.name
        # a repeat's name starts with `r2 ` (stores written before: ends in ` r2`)
        return re.sub(r"^r\d+ | r\d+$", "", name) if len(self.records) > 1 else name


def ratio(row: Group, base: Group) -> Estimate:
    """`row`'s throughput over `base`'s with a 95 % interval: paired by round where both took
    turns in one lockstep sweep (`accelexp.lockstep`), by repeat index where both ran their
    repeats interleaved in one sweep (`accelexp.sweeper`), else from independent repeats
    (bootstrap) or, for single runs, from each run's own interval."""
    if row is base:
        return Estimate(1.0)
    if (lockstep := lockstep_ratio(row, base)) is not None:
        return lockstep
    mine, theirs = row.by_repeat(), base.by_repeat()
    common = sorted(mine.keys() & theirs.keys())
    if row.sweep and row.sweep == base.sweep and len(common) >= 2:
        return stats.ratio([mine[i] for i in common], [theirs[i] for i in common], paired=True)
    return stats.ratio(row.samples(), base.samples(), paired=False)


def lockstep_slices(record: RunRecord) -> dict[int, tuple[float, int]]:
    """A lockstep run's steady slices that no neighbour shared: (samples/s, the process that
    ran it) by round."""
    contended = dict(record.history(LOCKSTEP_CONTENDED))
    process = dict(record.history(LOCKSTEP_INCARNATION))
    return {
        r: (v, int(process.get(r, 0)))
        for r, v in record.history(LOCKSTEP_SAMPLES_PER_S)
        if not contended.get(r)
    }


def lockstep_pairs(num: RunRecord, den: RunRecord) -> list[list[tuple[float, float]]]:
    """Two lockstep runs of one repeat: their rates round by round, one list per pair of
    processes that ran them (each an incarnation: `stats.lockstep_ratio`)."""
    a, b = lockstep_slices(num), lockstep_slices(den)
    by_processes: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for r in sorted(a.keys() & b.keys()):
        by_processes.setdefault((a[r][1], b[r][1]), []).append((a[r][0], b[r][0]))
    return list(by_processes.values())


def lockstep_ratio(row: Group, base: Group) -> Estimate | None:
    """`row` over `base` from the slices their runs of one lockstep sweep ran round by round,
    incarnation by incarnation (`stats.lockstep_ratio`); None when they did not take turns."""
    if not (row.sweep and row.sweep == base.sweep):
        return None
    mine, theirs = row.by_incarnation(), base.by_incarnation()
    incarnations = [
        pairs
        for index in sorted(mine.keys() & theirs.keys())
        for pairs in lockstep_pairs(mine[index], theirs[index])
    ]
    if not any(incarnations):
        return None
    runs = [*mine.values(), *theirs.values()]  # both sides in one process, every incarnation
    shared = all(r.tags.get(LOCKSTEP_PROCESS) == PROCESS_SHARED for r in runs)
    return stats.lockstep_ratio(incarnations, shared=shared)


def group(records: Sequence[RunRecord]) -> list[Group]:
    """The selection's runs by configuration (`group_key`), in the order they first appear."""
    measured = {r.run_id: measure_estimate(r) for r in records if r.status == FINISHED}
    groups: dict[str, list[RunRecord]] = {}
    for record in records:
        groups.setdefault(group_key(record), []).append(record)
    return [Group(key, runs, measured) for key, runs in groups.items()]


def compare(
    records: Sequence[RunRecord],
    baseline: str | Mapping[str, str] = DEFAULT_BASELINE,
    *,
    strict: bool = True,
) -> list[Row]:
    """One row per configuration (a run, or its repeats), sorted by parallelism, world size,
    precision and speed switches.

    The baseline is a measured, uncontended configuration matching every key of `baseline` and
    like for like with the row (module doc). With `strict`, no finished run matching `baseline`
    is a `BaselineError` listing the configurations that exist (a selector that names nothing);
    otherwise speedup and efficiency stay blank. Every figure left blank for want of a
    measurement or of a like-for-like run has its reason in `Row.note`; so has every run set
    aside (contended, or not finished, among repeats).
    """
    wanted = parse_baseline(baseline)
    groups = group(records)
    if strict and not any(r.status == FINISHED and matches(r, wanted) for r in records):
        raise BaselineError(_no_baseline_message(records, wanted))
    finished = [g for g in groups if g.finished]
    candidates = [g for g in finished if matches(g.first, wanted)]
    # every run contended: `everything_set_aside` says so once, not each row per repeat
    contended = bool(everything_set_aside(records))
    comparison = _Comparison(wanted, candidates, finished, contended)

    rows = []
    for grouped in groups:
        record = grouped.first
        row = Row(
            run_name=grouped.name(),
            run_id=record.run_id,
            status=record.status,
            parallelism=setting(record, PARALLELISM) or "",
            world_size=world_size(record),
            precision=setting(record, PRECISION) or "",
            speed=setting(record, SPEED) or "",
            model=setting(record, MODEL) or "",
            data=setting(record, DATA) or "",
            device=record.tags.get(DEVICE, ""),
        )
        if grouped.finished:
            comparison.fill(row, grouped)
        else:
            row.note = status_note(record)
        rows.append(row)
    return sorted(rows, key=_sort_key)


@dataclass
class _Comparison:
    """What every row is compared against: the baseline candidates and the finished
    configurations (for an fp32 one)."""

    wanted: dict[str, str]
    candidates: list[Group]
    finished: list[Group]
    everything_contended: bool = False  # notes leave contention to `everything_set_aside`

    @property
    def speedup_varies(self) -> re.Pattern[str]:
        """SPEEDUP_VARIES and the keys the baseline selector names (with their `key.*`)."""
        named = "|".join(re.escape(key) for key in self.wanted)
        return re.compile(rf"{SPEEDUP_VARIES.pattern}|({named})(\..+)?")

    def fill(self, row: Row, grouped: Group) -> None:
        finished, shown = grouped.finished, grouped.shown
        row.status = FINISHED
        accuracy = [r.metrics[TEST_ACC] for r in shown or finished if TEST_ACC in r.metrics]
        if accuracy:
            row.test_acc, row.test_acc_sd = stats.mean_sd(accuracy)
        best = [r.metrics[BEST_VAL_ACC] for r in shown or finished if BEST_VAL_ACC in r.metrics]
        row.best_val_acc = statistics.fmean(best) if best else None
        targets = [r.metrics[TIME_TO_TARGET_S] for r in shown if TIME_TO_TARGET_S in r.metrics]
        row.time_to_target_s = stats.olympic_mean(targets) if targets else None
        compiles = [r.metrics[COMPILE_S] for r in shown if COMPILE_S in r.metrics]
        row.compile_s = statistics.median(compiles) if compiles else None
        peaks = [p for r in shown or finished if (p := peak_memory(r)) is not None]
        row.peak_mem_mb = max(peaks) if peaks else None
        notes = self.set_aside(grouped, contention_said=self.everything_contended)
        row.noise = NOISE_CONTENDED if grouped.contended else ""
        samples = grouped.throughput()
        if samples is None:
            row.note = "; ".join([*notes, self_why(grouped)])
            return
        row.set("samples_per_s", samples)
        row.repeats = len(shown)
        if grouped.contended:
            left_out = [] if self.everything_contended else ["its speed is left out of every ratio"]
            row.note = "; ".join([*notes, *left_out])
            return
        mine = comparable_settings(grouped.first)
        selector = ",".join(f"{k}={v}" for k, v in self.wanted.items())
        base, note = self.like_for_like(
            grouped, mine, self.candidates, self.speedup_varies, "baseline",
            f"no finished run matches the baseline {selector}",
        )  # fmt: skip
        if base is not None:
            row.baseline_run = base.name()
            speedup = ratio(grouped, base)
            row.set("speedup", speedup)
            row.paired = speedup.method
            if speedup.method == "delta (log)":
                notes.append(WITHIN_RUN)
            base_world = world_size(base.first)
            if row.world_size and base_world:
                efficiency = stats.efficiency(speedup, row.world_size / base_world)
                row.set("scaling_efficiency", efficiency)
        else:
            notes.append(note)
        if row.precision != Name.FP32:
            fp32_runs = [g for g in self.finished if setting(g.first, PRECISION) == Name.FP32]
            fp32, note = self.like_for_like(
                grouped, mine, fp32_runs, AMP_VARIES, "fp32 run",
                "no finished fp32 run to take an AMP gain over",
            )  # fmt: skip
            if fp32 is not None:
                gain = ratio(grouped, fp32)
                row.set("amp_gain", gain)
                if gain.method == "delta (log)" and WITHIN_RUN not in notes:
                    notes.append(WITHIN_RUN)
            else:
                notes.append(note)
        row.note = "; ".join(notes)

    @staticmethod
    def set_aside(grouped: Group, contention_said: bool = False) -> list[str]:
        """Why some of a configuration's runs are not behind its figures; with
        `contention_said` (every run contended, said once under the table), the unfinished
        ones only."""
        if len(grouped.records) == 1:
            why = contention(grouped.records[0])
            return [f"contended ({why})"] if why and not contention_said else []
        notes = []
        for record in grouped.records:
            if record.status != FINISHED:
                notes.append(f"{repeat_label(record)} {record.status}")
            elif (why := contention(record)) and not contention_said:
                notes.append(f"{repeat_label(record)} set aside: contended ({why})")
        return notes

    def like_for_like(
        self,
        grouped: Group,
        mine: dict[str, str],
        others: list[Group],
        varies: re.Pattern[str],
        what: str,
        none: str,
    ) -> tuple[Group | None, str]:
        """The configuration of `others` to compare with (same parallelism first, then the
        newest), or (None, why not: `none` when there are no others, else none alike)."""
        if not others:
            return None, none
        diffs = {g.key: differences(mine, comparable_settings(g.first), varies) for g in others}
        alike = [g for g in others if not diffs[g.key]]
        usable = [g for g in alike if g.usable]
        parallelism = setting(grouped.first, PARALLELISM)
        if usable:
            return max(usable, key=lambda g: (setting(g.first, PARALLELISM) == parallelism,
                                              g.start_time)), ""  # fmt: skip
        if alike:
            other = max(alike, key=lambda g: g.start_time)
            why = "contended" if other.contended else self_why(other)
            return None, f"the like-for-like {what}, {other.name()}, has no throughput: {why}"
        nearest = min(
            others,
            key=lambda g: (len(diffs[g.key]), setting(g.first, PARALLELISM) != parallelism,
                           -g.start_time),
        )  # fmt: skip
        return None, (
            f"no like-for-like {what}: nearest ({nearest.name()}) differs in "
            f"{differ_text(diffs[nearest.key])}"
        )


def self_why(grouped: Group) -> str:
    """Why a finished configuration has no throughput (its newest finished run's reason)."""
    newest = max(grouped.finished, key=lambda r: r.start_time)
    return grouped.measured[newest.run_id][1]


def _no_baseline_message(records: Sequence[RunRecord], wanted: dict[str, str]) -> str:
    selector = ",".join(f"{k}={v}" for k, v in wanted.items())
    configs = sorted({describe(r) for r in records})
    unusable = [r.name for r in records if matches(r, wanted)]
    why = f" (matching, but not finished with a throughput: {', '.join(unusable)})"
    why = why if unusable else ""
    finished = [r for r in records if r.status == FINISHED]
    example = min(  # the likeliest baseline: fp32 with the fewest workers
        finished,
        key=lambda r: (r.setting(PRECISION) != Name.FP32, world_size(r) or 0),
        default=None,
    )
    hint = (
        f'; e.g. --baseline "world_size={example.setting(WORLD_SIZE)},'
        f'precision={example.setting(PRECISION)}"'
        if example is not None
        else ""
    )
    return (
        f"No finished run matches the baseline {selector}{why}. "
        f"Configurations in this selection: {'; '.join(configs)}. Pass --baseline with one of "
        f"them{hint}."
    )
