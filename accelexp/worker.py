"""One worker of a multi-process job: `python -m accelexp.worker SPEC_DIR`.

Started by a launcher (see `accelexp.launch`); reads the resolved config that the Hydra job saved
in SPEC_DIR, trains as its rank, and on failure records its error in SPEC_DIR/errors/rank<N>.txt
for the job to show. Rank 0 writes the final metrics to SPEC_DIR/result.json. SIGINT/SIGTERM
stop the worker (`accelexp.signals`): rank 0 closes its run KILLED; exit 128 + the signal.
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
from accelexp.parallel.world import current_world


def main(spec: Path) -> int:
    """Train as this process's rank; the exit code."""
    world = current_world()
    logging.basicConfig(
        level=logging.INFO if world.rank == 0 else logging.WARNING,
        format=f"[%(asctime)s][rank {world.rank}][%(name)s][%(levelname)s] - %(message)s",
    )
    cfg = OmegaConf.load(spec / "config.yaml")
    job = json.loads((spec / "job.json").read_text())
    signals.install()
    try:
        from accelexp.train import run

        metrics = run(cfg, job["output_dir"], job["overrides"])
    except BaseException as error:
        # a message for the user, not a bug: no traceback
        ours = isinstance(error, AccelexpError | KeyboardInterrupt)
        record = spec / "errors" / f"rank{world.rank}.txt"
        record.write_text(
            f"{type(error).__name__}: {error}\n"
            + ("" if ours else "".join(traceback.format_exception(error)[-3:]))
        )
        failed_at = getattr(error, "failed_at_ns", None) or time.time_ns()
        os.utime(record, ns=(failed_at, failed_at))  # the launcher orders failures by this
        if isinstance(error, KeyboardInterrupt):
            stop = signals.interruption(error)
            logging.getLogger("accelexp").warning("Stopped by %s.", stop.name)
            return outcome.exit_code(stop)
        if ours:
            logging.getLogger("accelexp").error("%s", error)
            return outcome.EXIT_FAILED  # the launcher's job says it, and exits 2
        traceback.print_exc()
        return 1
    if world.rank == 0:
        (spec / "result.json").write_text(json.dumps(metrics))
    return outcome.EXIT_OK


if __name__ == "__main__":
    outcome.exit_now(main(Path(sys.argv[1])))
