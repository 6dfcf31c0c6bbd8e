"""A job's worker output: all of it in a file, the workers' log records on the console.

The launcher's and its workers' stdout and stderr go to `<run folder>/workers/output.log`, a
file, so they write on even after this process is gone. `WorkerOutput` follows that file and
copies to the console only what the workers' logging wrote (`accelexp.worker`: lines
`[time][rank N][logger][LEVEL] - ...` and their indented continuation lines, also behind
horovodrun's `[N]<stderr>:` prefix): rank 0's progress and results, every rank's warnings and
errors. Tracebacks, the launchers' own reports and native libraries' messages stay in the file,
which the failure message names (`accelexp.launch.failures`).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import BinaryIO, TextIO

OUTPUT_FILE = "output.log"
RECORD = re.compile(r"\[[^\]]*\]\[rank \d+\]\[")  # accelexp.worker's log format
LAUNCHER_PREFIX = re.compile(r"^\[\d+\]<std(?:out|err)>:")  # horovodrun's, on every line
FOLLOW_EVERY_S = 0.1
JOIN_S = 5.0  # for the last lines once the job is over; a reader never holds the job up longer


class ConsoleFilter:
    """Which lines of the workers' output the console shows (the log records), one at a time."""

    def __init__(self) -> None:
        self.showing = False  # the line before was shown: its continuation lines are too

    def __call__(self, line: str) -> str | None:
        """`line` as the console shows it (without a launcher's prefix), or None."""
        line = LAUNCHER_PREFIX.sub("", line, count=1)
        if RECORD.match(line):
            self.showing = True
        elif not (self.showing and (not line.strip() or line[0].isspace())):
            self.showing = False
        return line if self.showing else None


class WorkerOutput:
    """`with WorkerOutput(spec, console) as output: Popen(..., stdout=output.file, ...)`."""

    def __init__(self, spec: Path, console: TextIO) -> None:
        self.path = spec / OUTPUT_FILE
        self.console = console
        self.done = threading.Event()
        self.file: BinaryIO | None = None
        self._start = 0
        self._thread = threading.Thread(target=self._follow, name="worker-output", daemon=True)

    def __enter__(self) -> WorkerOutput:
        # appended to: a run folder's earlier jobs (a resumed one's) keep theirs
        self.file = open(self.path, "ab")
        self._start = self.path.stat().st_size
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self._thread.join(JOIN_S)
        if self.file is not None:
            self.file.close()

    def _follow(self) -> None:
        show, partial = ConsoleFilter(), b""
        with open(self.path, "rb") as reader:
            reader.seek(self._start)  # this job's lines: after the earlier jobs'
            while True:
                finished = self.done.is_set()  # before the read: nothing written is missed
                *lines, partial = (partial + reader.read()).split(b"\n")
                if finished and partial:
                    lines, partial = [*lines, partial], b""
                for raw in lines:
                    shown = show(raw.decode(errors="replace").rstrip("\r"))
                    if shown is not None:
                        print(shown, file=self.console, flush=True)
                if finished:
                    return
                self.done.wait(FOLLOW_EVERY_S)
