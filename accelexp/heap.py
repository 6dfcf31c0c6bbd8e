"""The host heap's thresholds (`speed.heap`): a CPU run's speed must not depend on its history.

glibc's malloc serves a block of at least its *mmap threshold* with fresh pages from the kernel
(returned on free), and gives the top of its heap back (trims it) once more than its *trim
threshold* is free there. Both thresholds move: each time a mapped block is freed, the mmap
threshold rises to its size (up to 32 MiB) and the trim threshold to twice that. So which of a
training step's tensors come back as fresh, zeroed pages every step — a page fault per 4 KiB —
depends on which sizes the process happened to free before: two processes of the same job, or
the same process before and after its first evaluation, run at different speeds.

Measured on the 2-core VM (simple_cnn on Fashion-MNIST, fp32 and bf16 as lockstep jobs of one
process, `docs/statistics.md`): fp32 ran at ~2,900 samples/s in one process for 4 epochs and at
~4,100 in another from its second epoch on; bf16 jumped from ~4,000 to ~5,300 at an epoch's
end; the bf16 / fp32 ratio of 10 processes read 1.24-1.63. With the thresholds pinned, 5
processes read 1.23-1.29 (1.26, +-2.0 %), each side at its fast speed from the first step, and
the sweep's system CPU time (the faults) fell from 161 s to 19 s.

`pinned` fixes them (`mallopt`, as `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` would
before the process starts): blocks up to 32 MiB come from the heap and are reused, and the heap
keeps up to 1 GiB free at its top instead of giving it back. Fixing them also turns glibc's
adjustment off (Eigen's GEMM hit the same per-call faults: its issue 3201). The cost: a CPU
run's process holds on to what it freed, up to the trim threshold. `auto` pins on a CPU, where
every tensor of a step goes through malloc; on CUDA the caching allocator holds the device's
memory and the host allocates little per step, so `auto` leaves glibc as it is there (and a GPU
run stays comparable with a plain loop). Where the C library is not glibc, nothing is pinned
and the run says so (`heap` tag `dynamic`).

The heap is the process's: jobs of a lockstep sweep that share one process must agree on it
(`accelexp.lockstep.together.why_not`).
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

PINNED, DYNAMIC = "pinned", "dynamic"
# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit hosts)
TRIM_THRESHOLD = 2**30


@functools.cache
def _mallopt():
    try:
        return ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: no mallopt to call
        return None


def resolve(choice: str, device_type: str) -> str:
    """`speed.heap` decided: `auto` pins on a CPU (see the module doc); `pinned` where the C
    library cannot be told (not glibc) is `dynamic`, said once."""
    heap = choice if choice != "auto" else PINNED if device_type == "cpu" else DYNAMIC
    if heap == PINNED and _mallopt() is None:
        log.warning(
            "speed.heap: this C library has no mallopt (not glibc), so the heap's thresholds "
            "stay as they are and a CPU run's speed may depend on its history"
        )
        return DYNAMIC
    return heap


def pin() -> bool:
    """Fix glibc's mmap and trim thresholds for the rest of this process; False where they
    could not be (not glibc, or a value it refused)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    mapped = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    return mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and mapped
