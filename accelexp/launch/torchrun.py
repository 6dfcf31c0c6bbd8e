"""`python -m accelexp.launch.torchrun SPEC TORCHRUN_ARGS...`: torchrun, keeping its exit records.

This is torch's elastic launcher itself (`torch.distributed.run`, what the `torchrun` command
runs) with one addition: when workers fail, the agent's `ChildFailedError` — each failed rank's
exit code or signal, the ranks that failed before it stopped the others first — is written to
`SPEC/exits.json` (`accelexp.launch.exits`) instead of printed as a traceback, and the process
exits 1, as torchrun does.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from accelexp.launch import exits


def main(spec: Path, args: list[str]) -> int:
    try:
        run(parse_args(args))
    except ChildFailedError as failed:
        exits.write(
            spec,
            [
                exits.WorkerExit.of_status(rank, failure.exitcode, failure.pid)
                for rank, failure in failed.failures.items()  # in the order the agent saw them
            ],
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
