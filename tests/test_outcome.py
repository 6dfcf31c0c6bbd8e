"""How a job ends (`accelexp.outcome`): statuses, exit codes, credentials, a run_main's sweep."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from omegaconf import OmegaConf

from accelexp import outcome
from accelexp.errors import ConfigError
from accelexp.signals import Interrupted


def test_a_signal_or_a_requeue_is_killed_any_other_error_failed():
    assert outcome.status_of(None) == "FINISHED"
    assert outcome.status_of(Interrupted(signal.SIGTERM)) == "KILLED"
    assert outcome.status_of(SystemExit(0)) == "KILLED"  # submitit's requeue
    assert outcome.status_of(RuntimeError("bug")) == "FAILED"


def test_exit_codes():
    assert outcome.exit_code(Interrupted(signal.SIGINT)) == 130
    assert outcome.exit_code(Interrupted(signal.SIGTERM)) == 143
    assert outcome.exit_code(KeyboardInterrupt()) == 130  # Python's own Ctrl-C
    assert outcome.exit_code(ConfigError("bad")) == outcome.EXIT_BAD_INPUT == 2
    assert outcome.exit_code(PermissionError(13, "denied")) == 2
    assert outcome.exit_code(RuntimeError("bug")) == outcome.EXIT_FAILED == 1


def test_credentials_leave_the_uri_and_every_override(monkeypatch):
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(name, raising=False)  # and back to unset afterwards
    mlflow_cfg = OmegaConf.create({"tracking_uri": "http://alice:s3cret@host:5000"})
    typed = ["mlflow.tracking_uri=http://alice:s3cret@host:5000", "precision=amp"]
    kept = outcome.keep_credentials_out(mlflow_cfg, typed)
    assert kept == ["mlflow.tracking_uri=http://host:5000", "precision=amp"]
    assert mlflow_cfg.tracking_uri == "http://host:5000"

    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "s3cret"


class FakeSweep:
    def __init__(self) -> None:
        self.closed: list[str] = []

    def abort(self, status: str) -> None:
        self.closed.append(status)


def test_each_run_main_has_its_own_sweep_state_and_a_sweep_is_closed_once():
    assert outcome.current_sweep_state() is not outcome.current_sweep_state()  # none current
    sweep = FakeSweep()
    with outcome.sweep_state() as state:
        assert outcome.current_sweep_state() is state
        state.started(sweep)
        state.abort("KILLED")
        state.abort("FAILED")  # already closed: nothing more
        state.ended(failed=2)
        assert state.exit_code == 1
    assert sweep.closed == ["KILLED"]
    with outcome.sweep_state() as fresh:  # a later run_main in the same process starts clean
        assert fresh.exit_code == 0 and fresh.running is None


def test_a_signal_while_a_process_hands_its_run_on_stops_it_instead(tmp_path):
    """A lockstep job's process that ends its epochs becomes a fresh one (`EXIT_REINCARNATE`);
    a SIGTERM met while it tears down (here: in an exit handler, which Python's atexit would
    swallow) stops it with 143 instead, never a fresh incarnation training on until its sweeper
    kills it."""
    script, starts = tmp_path / "job.py", tmp_path / "starts"
    script.write_text(
        "import atexit, os, signal, time\n"
        "from accelexp import outcome, signals\n"
        f"open({str(starts)!r}, 'a').write('x')\n"
        "signals.install()\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(5)))\n"
        "outcome.exit_now(outcome.EXIT_REINCARNATE)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert starts.read_text() == "x", "one process: no incarnation after the signal"
