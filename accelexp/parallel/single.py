"""`parallelism=single`: one process on one device (the CPU or this process's GPU).

The base `Strategy` already behaves as a world of one; this module names it, so that each
`parallelism` option has its own module as the others do.
"""

from accelexp.parallel.base import Strategy


class SingleDevice(Strategy):
    name = "single"
