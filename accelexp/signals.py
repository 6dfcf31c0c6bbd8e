"""How a job stops on SIGINT (Ctrl-C) or SIGTERM (Slurm, Kubernetes, `kill`).

`install()` makes both signals raise `Interrupted` in the main thread, a `KeyboardInterrupt`, so
`except Exception` never swallows it and every layer unwinds as on Ctrl-C: the training run is
closed KILLED with what it logged so far, a launcher's workers are stopped (`accelexp.launch`),
a sweep's parent run is closed KILLED, and the process exits 128 + the signal's number (130 for
SIGINT, 143 for SIGTERM), with one line and no traceback.

A second signal while the job is already stopping is logged and ignored, so the clean-up (closing
the MLflow run, stopping workers, each bounded in time) is never cut short half-way. A signal that
arrives inside `deferred()` (a checkpoint being written) is acted on when that block ends, so the
file is never left half-written and the stop is never mistaken for a storage error.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The job received SIGINT or SIGTERM."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(self.name)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def interruption(error: BaseException) -> Interrupted:
    """An `Interrupted` for any interrupt: Python's own KeyboardInterrupt is a SIGINT."""
    return error if isinstance(error, Interrupted) else Interrupted(signal.SIGINT)


@dataclass
class _State:
    """Where this process is in stopping: what a signal received now does."""

    stopping: bool = False  # `Interrupted` raised: a further signal is logged and ignored
    ending: bool = False  # recording an error (`ending()`): a signal is logged and ignored
    deferring: int = 0  # `deferred()` blocks open: a signal waits for the last to end
    pending: int | None = None  # the signal that waits
    stopped_by: int | None = None  # the signal that stopped the job


_state = _State()


def _raise_interrupted(signum: int, frame: object) -> None:
    if _state.ending:  # the launcher stopping the survivors of an error this process records
        log.debug("%s received while recording an error: ignored.", signal.Signals(signum).name)
        return
    if _state.stopping or _state.pending is not None:
        log.warning("%s received while stopping: still stopping.", signal.Signals(signum).name)
        return
    if _state.deferring:
        _state.pending = signum
        log.info("%s received: stopping once the write is done.", signal.Signals(signum).name)
        return
    _stop(signum)


def _stop(signum: int) -> None:
    _state.stopping, _state.stopped_by = True, signum
    raise Interrupted(signum)


def stopped_by() -> Interrupted | None:
    """The signal that stopped this process, if one did (even where its `Interrupted` was
    swallowed, as an exit handler's is)."""
    return None if _state.stopped_by is None else Interrupted(_state.stopped_by)


def ending() -> None:
    """The process is ending on an error it is recording: from now on a signal (the launcher's
    SIGTERM to the survivors, say) is logged and ignored, as while stopping, so the record is
    made whole and the error stays the cause."""
    _state.ending = True


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Run a block that must not be cut half-way; a signal received inside stops the job at its
    end (also when the block fails: the stop wins over the block's own error)."""
    _state.deferring += 1
    try:
        yield
    finally:
        _state.deferring -= 1
        if not _state.deferring and _state.pending is not None:
            signum, _state.pending = _state.pending, None
            _stop(signum)


def install() -> None:
    """SIGINT and SIGTERM raise `Interrupted` (call once, in the main thread)."""
    for signum in HANDLED:
        signal.signal(signum, _raise_interrupted)
