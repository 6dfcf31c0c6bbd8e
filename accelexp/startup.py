"""What goes wrong around the Hydra job, said in one line: `python run.py` runs `main` here.

Hydra prints errors raised before the job function runs — a run folder it cannot make, an
interpolation of its own it cannot resolve — with a traceback. `run_main` has Hydra raise them
(`HYDRA_FULL_ERROR=1`) and says each in one line with a non-zero exit; a user who sets
`HYDRA_FULL_ERROR=1` still gets the whole traceback. A key typed by its old name is refused
before Hydra composes, with the override to type instead (`validate.renamed_key`), exit 2.
SIGINT/SIGTERM between a sweep's jobs, or while Hydra composes, end like a signal during a job
(`accelexp.signals`): the sweep's parent run KILLED, one line, exit 130/143.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from accelexp import outcome, signals


def run_main(main: Callable[[], object]) -> int:
    """Run Hydra's `main`; the process's exit code (`accelexp.outcome`)."""
    signals.install()
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    refused = _empty_run_dir(sys.argv[1:]) or _renamed_key(sys.argv[1:])
    if refused:
        print(f"Error: {refused}", file=sys.stderr)
        return outcome.EXIT_BAD_INPUT
    with outcome.sweep_state() as sweep:
        try:
            main()
        except KeyboardInterrupt as error:
            sweep.abort(outcome.KILLED)
            print(f"Stopped by {signals.interruption(error).name}.", file=sys.stderr)
            return outcome.exit_code(error)
        except Exception as error:
            sweep.abort(outcome.FAILED)  # a sweep that got as far as its parent run
            if full_error:
                raise
            say(error)
            return outcome.exit_code(error)
        return sweep.exit_code


def say(error: Exception) -> None:
    """`error`, which ended `run.py` outside its job, in a line or two on stderr."""
    from hydra.errors import CompactHydraException
    from omegaconf.errors import InterpolationResolutionError

    from accelexp.config.validate import misplaced_key, unresolved_reason

    if isinstance(error, CompactHydraException):  # Hydra's own message, printed as it does
        key = getattr(error.__cause__, "full_key", None)  # unless the key is in a sibling
        hint = misplaced_key(key) if key else ""  # option: "+key" would not help then
        parts = (hint,) if hint else (error, error.__cause__)
        print(*(part for part in parts if part), sep="\n", file=sys.stderr)
        return
    if isinstance(error, OSError):
        message = (
            f"{error.strerror or error}: {error.filename}. If it is the run's folder, set "
            f"hydra.run.dir=PATH (hydra.sweep.dir=PATH with -m) to a folder you can write."
        )
    elif isinstance(error, InterpolationResolutionError):
        key = error.full_key or "the key"  # none: an override read as a string
        message = f"{error.full_key or 'An override'}: {unresolved_reason(error, key)}"
    else:
        message = f"{type(error).__name__}: {error}"
    print(f"Error: {message}\n(HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)


def _renamed_key(args: list[str]) -> str | None:
    """A key typed by its old name (`validate.RENAMED_KEYS`), said with the override to type
    instead; Hydra would refuse it as unknown without the value."""
    from accelexp.config.validate import renamed_key

    for arg in args:
        key, _, value = arg.lstrip("+~").partition("=")
        hint = renamed_key(key, value or None)
        if hint:
            return hint
    return None


def _empty_run_dir(args: list[str]) -> str | None:
    """An empty `hydra.run.dir=` would make the run write into the current folder."""
    for arg in args:
        key, _, value = arg.lstrip("+").partition("=")
        if key in ("hydra.run.dir", "hydra.sweep.dir") and not value.strip("'\" "):
            return (
                f"{key} is empty: the run would write into the current folder. Give a "
                f"folder, e.g. {key}=outputs/mine, or leave it out for a new dated one."
            )
    return None
