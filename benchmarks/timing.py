"""What the benchmarks share: one side's wall and process CPU time, measured together."""

from __future__ import annotations

import time
from collections.abc import Callable


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) that `fn()` took."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu
