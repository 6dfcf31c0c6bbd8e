"""`parallelism=single`: one process on one device (the CPU or this process's GPU).

The base `Placement` (one device) × the base `Sync` (no other replicas); this module names it,
so that each `parallelism` option has a module, as the others do.
"""

from accelexp.parallel.base import Strategy


class SingleDevice(Strategy):
    name = "single"
