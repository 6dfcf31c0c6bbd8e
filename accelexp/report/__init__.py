"""Put the runs of a sweep or an experiment side by side: speedup, scaling efficiency, AMP gain,
and for the speed-up ladder study each rung's gain over the last — honestly: throughput from
steady-state steps only (a run too short to measure says so), comparisons like for like only (a
refused one says why, under the table).

    accelexp-report --experiment scaling
    accelexp-report --experiment scaling --wide
    accelexp-report --sweep latest --format markdown
    accelexp-report --sweep <parent run id> --baseline "world_size=1,precision=fp32,parallelism=ddp"
    accelexp-report --experiment speedups --sweep latest
    accelexp-report --sweep latest --diagnose
    accelexp-report --experiment memory_vs_speed --memory

- `compare` — one `Row` per run: steady-state throughput, speedup against a like-for-like
  baseline, efficiency, AMP gain over a like-for-like fp32 run; `Row.note` says why a figure is
  blank.
- `ladder` — one `LadderRow` per rung of `+experiment=speedups`: gain over the last, over fp32.
- `diagnose` — one `DiagnosisRow` per run: its step time's shares, its bound, the next override.
- `memory` — one row per run of `+experiment=memory_vs_speed`: speed, memory per device, the
  largest batch that fit; `memory_vs_speed.png`; one `LeverRow` per memory lever a run pulled
  (fsdp, activation checkpointing, cpu_offload): memory saved against speed lost.
- `pareto` — the Pareto front of a sweep with two objectives (`objective=[a,b]`): the trials no
  other beats on both, a table and `pareto.png` (every trial, the front marked).
- `formats` — CSV, JSON, markdown and rich tables of any of them (the rich ones at a glance in
  100 columns, or `--wide`); summary/ladder/diagnosis files.
- `plots` — the PNGs: throughput (vs workers, or a bar per configuration at one worker count),
  efficiency (only where workers vary), accuracy vs time (repeats as a mean with intervals), the
  ladder's bars, time breakdown.
- `cli` — `main` (the `accelexp-report` command) and `write_sweep_report` (a sweep's own report).

`compare`, `ladder` and `diagnose` are pure (records in, rows out); the rest are thin layers on
them. MLflow is read and written only through `accelexp.tracking.query`.
"""

from accelexp.report.cli import (
    DEFAULT_TRACKING_URI,
    FORMATS,
    build_parser,
    main,
    write_sweep_report,
)
from accelexp.report.compare import (
    BASELINE_KEYS,
    COLUMNS,
    CONFIG_KEYS,
    DEFAULT_BASELINE,
    MIN_STEADY_STEPS,
    BaselineError,
    Row,
    compare,
    measure,
    parse_baseline,
    throughput,
)
from accelexp.report.diagnose import DIAGNOSIS_COLUMNS, SEGMENTS, DiagnosisRow, diagnose
from accelexp.report.formats import (
    BRIEF_WIDTH,
    DIAGNOSIS,
    LADDER,
    LADDER_BRIEF,
    RUNS,
    RUNS_BRIEF,
    Layout,
    render_table,
    to_csv,
    to_json,
    to_markdown,
    write_tables,
)
from accelexp.report.ladder import LADDER_COLUMNS, RUNG_NAMES, LadderRow, ladder
from accelexp.report.pareto import PARETO_PLOT, Front, pareto
from accelexp.report.plots import (
    LADDER_PLOT,
    PLOT_NAMES,
    TIME_PLOT,
    plot_ladder,
    plot_time_breakdown,
    write_plots,
)

__all__ = [
    "BASELINE_KEYS",
    "BRIEF_WIDTH",
    "COLUMNS",
    "CONFIG_KEYS",
    "DEFAULT_BASELINE",
    "DEFAULT_TRACKING_URI",
    "DIAGNOSIS",
    "DIAGNOSIS_COLUMNS",
    "FORMATS",
    "LADDER",
    "LADDER_BRIEF",
    "LADDER_COLUMNS",
    "LADDER_PLOT",
    "MIN_STEADY_STEPS",
    "PARETO_PLOT",
    "PLOT_NAMES",
    "RUNG_NAMES",
    "RUNS",
    "RUNS_BRIEF",
    "SEGMENTS",
    "TIME_PLOT",
    "BaselineError",
    "DiagnosisRow",
    "Front",
    "LadderRow",
    "Layout",
    "Row",
    "build_parser",
    "compare",
    "diagnose",
    "ladder",
    "main",
    "measure",
    "pareto",
    "parse_baseline",
    "plot_ladder",
    "plot_time_breakdown",
    "render_table",
    "throughput",
    "to_csv",
    "to_json",
    "to_markdown",
    "write_plots",
    "write_sweep_report",
    "write_tables",
]
