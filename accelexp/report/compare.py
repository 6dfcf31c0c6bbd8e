"""The comparison: one `Row` per run, with its throughput, speedup, scaling efficiency, AMP gain.

Throughput is the median `samples_per_s` of the epochs after the first (the first pays for
warm-up: allocator, cuDNN autotuning, process start); a one-epoch run uses its only epoch. Speedup
divides it by the baseline run's, preferring a baseline of the same model, data, speed switches and
parallelism; scaling efficiency is speedup per added worker; AMP gain divides a mixed-precision
row's throughput by the fp32 run of the same parallelism, world size, model, data and speed.

Pure: records in, rows out. A run from before a setting existed reads as that setting's default
(`SETTING_DEFAULTS`: no `speed` tag is `eager`).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from accelexp.errors import AccelexpError
from accelexp.tracking.query import RunRecord

DEFAULT_BASELINE = "world_size=1,precision=fp32"
BASELINE_KEYS = ("world_size", "precision", "parallelism", "model", "data", "speed")
CONFIG_KEYS = ("parallelism", "world_size", "precision", "speed", "model", "data")  # a run's name
PARALLELISM_ORDER = ("single", "dp", "ddp", "horovod", "model", "hybrid")
PRECISION_ORDER = ("fp32", "amp", "bf16")
SPEED_ORDER = ("eager",)  # then the others alphabetically
SETTING_DEFAULTS = {"speed": "eager"}  # what runs logged before the setting existed had


class BaselineError(AccelexpError):
    """The --baseline selector is malformed or matches no finished run."""


@dataclass
class Row:
    """One run compared with its baseline; None where a figure does not apply or is missing."""

    run_name: str
    run_id: str
    status: str
    parallelism: str
    world_size: int | None
    precision: str
    speed: str
    model: str
    data: str
    samples_per_s: float | None = None
    speedup: float | None = None
    scaling_efficiency: float | None = None
    amp_gain: float | None = None
    best_val_acc: float | None = None
    test_acc: float | None = None
    time_to_target_s: float | None = None
    compile_s: float | None = None
    peak_mem_mb: float | None = None
    baseline_run: str | None = None


COLUMNS = tuple(f.name for f in fields(Row))


# --- reading a run ------------------------------------------------------------------------------
def setting(record: RunRecord, key: str) -> str | None:
    """`record.setting(key)`, or the default of a setting older runs did not log."""
    return record.setting(key) or SETTING_DEFAULTS.get(key)


def matches(record: RunRecord, selector: Mapping[str, str]) -> bool:
    return all(setting(record, key) == value for key, value in selector.items())


def throughput(record: RunRecord) -> float | None:
    """Median samples/s over the epochs after the first; the only epoch if there is one."""
    values = [value for _, value in record.history("samples_per_s")]
    if not values:
        return None
    return statistics.median(values[1:] or values)


def peak_memory(record: RunRecord) -> float | None:
    """The highest per-epoch peak (MB), else the run's last logged peak."""
    peaks = [value for _, value in record.history("peak_mem_mb")]
    return max(peaks) if peaks else record.metrics.get("peak_mem_mb")


def world_size(record: RunRecord) -> int | None:
    try:
        return int(record.setting("world_size") or "")
    except ValueError:
        return None


def describe(record: RunRecord) -> str:
    """`parallelism=ddp world_size=2 precision=fp32 speed=eager ...`, and a status not FINISHED."""
    config = " ".join(f"{key}={setting(record, key) or '?'}" for key in CONFIG_KEYS)
    return f"{config} ({record.status})" if record.status != "FINISHED" else config


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


def compare(
    records: Sequence[RunRecord],
    baseline: str | Mapping[str, str] = DEFAULT_BASELINE,
    *,
    strict: bool = True,
) -> list[Row]:
    """One row per run, sorted by parallelism, world size, precision and speed switches.

    The baseline is a finished run matching every key of `baseline`; of several, the one sharing
    the row's model, data, speed and parallelism (in that order of importance), then the newest.
    With `strict`, no matching run is a `BaselineError` listing the configurations that exist;
    otherwise speedup and efficiency stay blank.
    """
    wanted = parse_baseline(baseline)
    speed = {r.run_id: throughput(r) for r in records if r.status == "FINISHED"}
    measured = [r for r in records if speed.get(r.run_id) is not None]
    candidates = [r for r in measured if matches(r, wanted)]
    if strict and not candidates:
        raise BaselineError(_no_baseline_message(records, wanted))

    rows = []
    for record in records:
        row = Row(
            run_name=record.name,
            run_id=record.run_id,
            status=record.status,
            parallelism=setting(record, "parallelism") or "",
            world_size=world_size(record),
            precision=setting(record, "precision") or "",
            speed=setting(record, "speed") or "",
            model=setting(record, "model") or "",
            data=setting(record, "data") or "",
        )
        samples = speed.get(record.run_id)
        if samples is not None:
            _fill(row, record, samples, candidates, measured, speed)
        rows.append(row)
    return sorted(rows, key=_sort_key)


def _fill(
    row: Row,
    record: RunRecord,
    samples: float,
    candidates: list[RunRecord],
    measured: list[RunRecord],
    speed: dict[str, float | None],
) -> None:
    row.samples_per_s = samples
    row.best_val_acc = record.metrics.get("best_val_acc")
    row.test_acc = record.metrics.get("test_acc")
    row.time_to_target_s = record.metrics.get("time_to_target_s")
    row.compile_s = record.metrics.get("compile_s")
    row.peak_mem_mb = peak_memory(record)

    if candidates:
        # Most alike first, by how much a difference moves throughput: model and data by orders
        # of magnitude, the speed switches by up to several times (so a tf32+cl row scales
        # against a tf32+cl baseline, not against eager), the parallelism at the baseline's
        # world size (single vs ddp vs horovod on one worker) by a few percent.
        base = max(
            candidates,
            key=lambda c: (
                setting(c, "model") == row.model,
                setting(c, "data") == row.data,
                setting(c, "speed") == row.speed,
                setting(c, "parallelism") == row.parallelism,
                c.start_time,
            ),
        )
        row.baseline_run = base.name
        row.speedup = samples / speed[base.run_id]
        base_world = world_size(base)
        if row.world_size and base_world:
            row.scaling_efficiency = row.speedup / (row.world_size / base_world)

    if row.precision != "fp32":
        like_for_like = {k: getattr(row, k) for k in ("parallelism", "model", "data", "speed")}
        same = [
            r
            for r in measured
            if setting(r, "precision") == "fp32"
            and matches(r, like_for_like)
            and world_size(r) == row.world_size
        ]
        if same:
            fp32 = max(same, key=lambda r: r.start_time)
            row.amp_gain = samples / speed[fp32.run_id]


def _no_baseline_message(records: Sequence[RunRecord], wanted: dict[str, str]) -> str:
    selector = ",".join(f"{k}={v}" for k, v in wanted.items())
    configs = sorted({describe(r) for r in records})
    unusable = [r.name for r in records if matches(r, wanted)]
    why = f" (matching, but not finished with a throughput: {', '.join(unusable)})"
    why = why if unusable else ""
    finished = [r for r in records if r.status == "FINISHED"]
    example = min(  # the likeliest baseline: fp32 with the fewest workers
        finished,
        key=lambda r: (r.setting("precision") != "fp32", world_size(r) or 0),
        default=None,
    )
    hint = (
        f'; e.g. --baseline "world_size={example.setting("world_size")},'
        f'precision={example.setting("precision")}"'
        if example is not None
        else ""
    )
    return (
        f"No finished run matches the baseline {selector}{why}. "
        f"Configurations in this selection: {'; '.join(configs)}. Pass --baseline with one of "
        f"them{hint}."
    )
