"""`python -m accelexp.launch.horovodrun SPEC HOROVODRUN_ARGS...`: horovodrun, keeping its record
of the first worker to fail.

This is Horovod's launcher itself (`horovod.runner.launch.run_commandline`, what the `horovodrun`
command runs) with one addition: when a worker exits non-zero, Horovod raises "... The first
process to do so was: Process name: <rank> Exit code: <status>" (by the time each ended; the
status of a worker killed by a signal is 128 + its number, as a shell says it); that worker's
end is written to `SPEC/exits.json` (`accelexp.launch.exits`) instead of a traceback, and the
process exits 1.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from horovod.runner.launch import run_commandline

from accelexp.launch import exits

FIRST_FAILURE = re.compile(r"Process name: (\d+)\s+Exit code: (-?\d+)")


def main(spec: Path, args: list[str]) -> int:
    sys.argv = ["horovodrun", *args]
    try:
        run_commandline()
    except RuntimeError as error:
        first = FIRST_FAILURE.search(str(error))
        if first is None:  # not a worker's exit: Horovod's own failure, said as it says it
            raise
        exits.write(spec, [exits.WorkerExit.of_shell_status(int(first[1]), int(first[2]))])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
