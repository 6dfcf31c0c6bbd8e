"""One worker of a multi-process job: `python -m accelexp.worker SPEC_DIR`.

Started by a launcher (see `accelexp.launch`); reads the resolved config that the Hydra job saved
in SPEC_DIR, trains as its rank, and on failure records its error in SPEC_DIR/errors/rank<N>.txt
for the job to show (a bug's traceback goes to the workers' output file, not the console). Rank 0
writes the final metrics to SPEC_DIR/result.json. SIGINT/SIGTERM stop the worker
(`accelexp.signals`): rank 0 closes its run KILLED; exit 128 + the signal.

Its log records are the lines the job's console shows (`accelexp.launch.output`): one format,
`[time][rank N][logger][LEVEL] - message`, a message's further lines indented.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from omegaconf import OmegaConf

from accelexp import outcome, signals
from accelexp.errors import AccelexpError
from accelexp.launch.failures import first_line
from accelexp.parallel.world import current_world
from accelexp.tracking import credentials


class _Indented(logging.Formatter):
    """A record's further lines (a traceback, a table) indented: they belong to it."""

    def format(self, record: logging.LogRecord) -> str:
        first, *rest = super().format(record).split("\n")
        return "\n".join([first, *(line if line[:1].isspace() else f"  {line}" for line in rest)])


def main(spec: Path) -> int:
    """Train as this process's rank; the exit code."""
    world = current_world()
    console = logging.StreamHandler()
    console.setFormatter(
        _Indented(f"[%(asctime)s][rank {world.rank}][%(name)s][%(levelname)s] - %(message)s")
    )
    logging.basicConfig(
        level=logging.INFO if world.rank == 0 else logging.WARNING, handlers=[console]
    )
    credentials.secrets_from_file()
    cfg = OmegaConf.load(spec / "config.yaml")
    job = json.loads((spec / "job.json").read_text())
    signals.install()
    try:
        from accelexp.train import run

        metrics = run(cfg, job["output_dir"], job["overrides"])
    except BaseException as error:
        signals.ending()
        # a message for the user, not a bug: no traceback
        ours = isinstance(error, AccelexpError | KeyboardInterrupt)
        record = spec / "errors" / f"rank{world.rank}.txt"
        record.write_text(
            f"{type(error).__name__}: {error}\n"
            + ("" if ours else "".join(traceback.format_exception(error)[-3:]))
        )
        failed_at = getattr(error, "failed_at_ns", None) or time.time_ns()
        os.utime(record, ns=(failed_at, failed_at))  # the launcher orders failures by this
        stop = signals.interruption(error) if isinstance(error, KeyboardInterrupt) else None
        cause = f"{type(error).__name__}: {first_line(str(error))}"
        said = f"Stopped by {stop.name}" if stop else cause
        log = logging.getLogger("accelexp")
        if restart := _restart_to_come():  # the run goes on: not the job's end
            log.warning(
                "%s; torchrun restarts the world (restart %s), which continues the run from its "
                "last checkpoint.",
                said,
                restart,
            )
        elif stop:
            log.warning("%s.", said)
        if stop:
            return outcome.exit_code(stop)
        if ours:
            return outcome.EXIT_FAILED  # the launcher's job says it, and exits 2
        traceback.print_exc()  # into the workers' output file, which the job's message names
        return 1
    if world.rank == 0:
        (spec / "result.json").write_text(json.dumps(metrics))
    return outcome.EXIT_OK


def _restart_to_come() -> str | None:
    """Which restart torchrun makes after this failure ("1 of 2": `--max-restarts`), if any."""
    done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    most = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    return f"{done + 1} of {most}" if done < most else None


if __name__ == "__main__":
    outcome.exit_now(main(Path(sys.argv[1])))
