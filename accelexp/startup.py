"""What goes wrong around the Hydra job, said in one line: `python run.py` runs `main` here.

Hydra prints errors raised before the job function runs — a run folder it cannot make, an
interpolation of its own it cannot resolve — with a traceback. `run_main` has Hydra raise them
(`HYDRA_FULL_ERROR=1`) and says each in one line with a non-zero exit; a user who sets
`HYDRA_FULL_ERROR=1` still gets the whole traceback. A key typed by its old name is refused
before Hydra composes, with the override to type instead (`validate.renamed_key`), exit 2; so
are a flag Hydra's parser refuses (without its usage text) and an override with no key. What
Hydra refuses while it composes (an option or a key that does not exist, a value of the wrong
type, an override its grammar cannot read) is said in one line with what to type instead
(`composition_message`), not in Hydra's text.
SIGINT/SIGTERM between a sweep's jobs, or while Hydra composes, end like a signal during a job
(`accelexp.signals`): the sweep's parent run KILLED, one line, exit 130/143.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable

from accelexp import outcome, signals
from accelexp.lockstep.gate import Reincarnation


def run_main(main: Callable[[], object]) -> int:
    """Run Hydra's `main`; the process's exit code (`accelexp.outcome`)."""
    signals.install()
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    args = sys.argv[1:]
    refused = _bad_flags(args) or _no_key(args) or _empty_run_dir(args) or _renamed_key(args)
    if refused:
        print(f"Error: {refused}", file=sys.stderr)
        return outcome.EXIT_BAD_INPUT
    with outcome.sweep_state() as sweep:
        try:
            main()
        except Reincarnation:  # a lockstep job's run goes on in a fresh process
            return outcome.EXIT_REINCARNATE
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

    from accelexp.config.validate import unresolved_reason

    if isinstance(error, CompactHydraException):  # Hydra's own message, made one line
        print(f"Error: {composition_message(error)}", file=sys.stderr)
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


GRAMMAR = "https://hydra.cc/docs/1.2/advanced/override_grammar/basic"


def composition_message(error: Exception) -> str:
    """One line for an error Hydra raised composing the config (`CompactHydraException`):
    what is wrong with which override, and what to type instead. Hydra's own text (its first
    line) where accelexp has nothing better to say."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = error.__cause__
    if isinstance(error, MissingConfigException):
        return _missing_config(error)
    if isinstance(error, OverrideParseException):
        return _unreadable_override(error.override, error.message)
    if isinstance(cause, ConfigKeyError | ConfigAttributeError) and cause.full_key:
        return _unknown_key(cause)
    text = str(error)
    merging = re.match(r"Error merging override (.+)", text)
    if merging and cause is not None:
        return _bad_value(merging.group(1), cause)
    unmatched = re.match(r"Could not override '([^']+)'\. No match in the defaults list", text)
    if unmatched:
        return _add_on_group(unmatched.group(1))
    several = re.match(r"Ambiguous value for argument '([^']+)'", text)
    if several:
        return (
            f"{several.group(1)} gives several values: add -m to run a job for each (`python "
            f"run.py -m {several.group(1)}`); a list is written KEY=[A,B], a string with a comma "
            f"quoted: KEY='A,B'."
        )
    chosen = re.match(r"Multiple values for ([\w/]+)\.", text)
    if chosen:
        return _chosen_already(chosen.group(1))
    return text.split("\nConfig search path:")[0].strip().replace("\n", " ")


def _missing_config(error: Exception) -> str:
    """`parallelism=ddpp`, `data=`, `hydra/launcher=nope`, `--config-name nope`: the option
    that is not there, the one it resembles, and the available ones."""
    from accelexp.config.catalog import options

    missing = error.missing_cfg_file or ""
    group, _, name = missing.rpartition("/")
    if not group and not str(error).startswith("Cannot find primary config"):
        return " ".join(str(error).split("\nConfig search path:")[0].split())  # --config-path
    if not group:  # the primary config: --config-name
        return (
            f"There is no config {missing!r} in conf/: run.py's is conf/config.yaml, so leave "
            f"out --config-name; a study is picked with +experiment=NAME (`python run.py "
            f"--help` lists them)."
        )
    available = list(error.options or [o.name for o in options() if o.group == group])
    close = difflib.get_close_matches(name, available, n=1, cutoff=0.6)
    guess = f" Did you mean {group}={close[0]}?" if close else ""
    what = f"{group}= is empty" if not name else f"{group}={name}: no such option"
    return (
        f"{what}.{guess} Available options: {', '.join(available)} (`python run.py --help` "
        f"lists them with their keys)."
    )


def _unreadable_override(override: str, message: str) -> str:
    """An override Hydra's grammar cannot read (`epochs==2`, `epochs=[1,2`, `fp32,`)."""
    lines = [
        line.strip()
        for line in message.splitlines()
        if line.strip()
        and not line.startswith(("See https://", "Error parsing override"))
        and line.strip() != "^"
    ]
    reason = re.sub(r"\s*expecting \{.*\}$", "", lines[0] if lines else message)
    reason = re.sub(
        r"^(LexerNoViableAltException|\w+Error while evaluating '[^']*'): ?", "", reason
    )
    reason = "" if reason in ("", override) else f" ({reason})"
    key, _, value = override.partition("=")
    if "while evaluating" in message:
        hint = "give the function values, e.g. with -m epochs=choice(1,2) or epochs=range(1,4)"
    elif value.startswith("="):
        hint = f"one = between key and value: {key}={value.lstrip('=')}"
    elif value.rstrip().endswith(","):
        hint = (
            f"a list of values has no trailing comma: {key}={value.rstrip(' ,')} (with -m, "
            f"{key}=A,B runs a job for each)"
        )
    elif any(value.count(a) != value.count(b) for a, b in ("[]", "{}", "()")):
        hint = "close the bracket, e.g. epochs=[1,2] or epochs=range(1,4)"
    elif key.endswith(".") or not re.fullmatch(r"[+~]{0,2}[\w./@-]+", key):
        hint = f"{key!r} is not a key: write KEY=VALUE, e.g. epochs=3"
    else:
        hint = (
            "write KEY=VALUE and quote a value with spaces or special characters, e.g. "
            "'data.root=\"my data\"'"
        )
    return f"Cannot read the override {override!r}{reason}: {hint}. The grammar: {GRAMMAR}"


def _unknown_key(cause: Exception) -> str:
    """`modle=resnet18`, `data.batchsize=3`, `hydra.foo=1`: a key no schema declares."""
    import dataclasses

    from accelexp.config.validate import unknown_key

    schema = getattr(cause, "object_type", None)
    known = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []
    typed = next((a for a in sys.argv[1:] if a.lstrip("+~").startswith(f"{cause.full_key}=")), "")
    return unknown_key(cause.full_key, known, typed.partition("=")[2] or None)


def _bad_value(override: str, cause: Exception) -> str:
    """`epochs=abc`, `epochs=null`, `hydra.mode=FOO`: a value of the wrong type."""
    key = getattr(cause, "full_key", None) or override.partition("=")[0].lstrip("+~")
    if override.startswith("~"):
        return (
            f"{key} cannot be removed: every key of its schema has a value. Set the one you "
            f"want instead, e.g. `python run.py {key}=...`."
        )
    reason = str(getattr(cause, "msg", None) or cause).splitlines()[0]
    reason = re.sub(r"^field '([^']+)' is not Optional$", r"\1 cannot be null", reason)
    return (
        f"{override} is not allowed: {reason.rstrip('.')}. Give {key} a value of its type, e.g. "
        f"`python run.py {key}=...` (`python run.py --help` shows each key's default)."
    )


def _add_on_group(group: str) -> str:
    """`experiment=scaling` without `+`: a group no default picks is added, not overridden."""
    from accelexp.config.catalog import options

    typed = next((a for a in sys.argv[1:] if a.startswith(f"{group}=")), f"{group}=")
    value = typed.partition("=")[2]
    available = [o.name for o in options() if o.group == group]
    if not available:
        return f"{group} is not a config group: `python run.py --help` lists them."
    if value in available:
        return f"{group} is added to the config, not overridden: type +{group}={value}."
    close = difflib.get_close_matches(value, available, n=1, cutoff=0.6)
    return (
        f"{group} is added to the config with +: type +{group}="
        f"{close[0] if close else 'NAME'}, NAME one of {', '.join(available)}."
    )


def _chosen_already(group: str) -> str:
    """`+model=resnet18`: every run picks a model already; it is chosen without `+`."""
    typed = next((a for a in sys.argv[1:] if a.lstrip("+").startswith(f"{group}=")), "")
    value = typed.partition("=")[2] or "OPTION"
    return f"{group} has an option chosen already: pick another with {group}={value}, without +."


class _FlagError(Exception):
    pass


def _bad_flags(args: list[str]) -> str | None:
    """A flag Hydra's parser refuses (`--foo`, `--cfg jobb`), in one line, not its usage text."""
    from hydra._internal.utils import get_args_parser

    if "--version" in args:  # printed and done, whatever follows
        return None
    parser = get_args_parser()

    def refuse(message: str) -> None:
        raise _FlagError(message)

    parser.error = refuse  # type: ignore[method-assign]
    try:
        parser.parse_args(args)
    except _FlagError as error:
        return (
            f"{error}. `python run.py --hydra-help` lists Hydra's flags, `python run.py "
            f"--help` the config groups and keys."
        )
    return None


def _no_key(args: list[str]) -> str | None:
    """`=3`: an override without its key (Hydra takes it for a config group)."""
    for arg in args:
        if not arg.startswith("-") and arg.lstrip("+~").startswith("="):
            return f"{arg!r} has no key: write KEY=VALUE, e.g. epochs{arg.lstrip('+~')}."
    return None
