"""`python run.py --help`: every option of every config group with its keys, and the top-level keys.

`conf/config.yaml`'s help template holds `${accelexp_help:}`, a resolver `register_help` adds.
Hydra resolves it when it prints the help, with the config this command line composes: the text
is built from the config files (`catalog`) and that config, never written by hand, so it lists
every option there is, and this command line's choices (marked `*`) with the values it would run
with and each key's help (the schema's, `accelexp.keys`), as are the top-level keys. Test
hooks (`debug.*`) are left out.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from accelexp.config.catalog import HIDDEN_KEYS, Option, flatten, options, primary_groups
from accelexp.keys import helps
from accelexp.schema import Config

WIDTH = 100
ALIGNED = 24  # a longer KEY=VALUE has its help two spaces after it, out of the helps' column
RESOLVER = "accelexp_help"


def register_help() -> None:
    """Make `${accelexp_help:}` available to the help template (idempotent)."""
    OmegaConf.register_new_resolver(RESOLVER, _resolve, replace=True)


def _resolve(*, _root_: DictConfig) -> str:
    # Hydra feeds the template to string.Template: a literal `$` (in `${...}` values) doubles
    return render(_root_).replace("$", "$$")


def render(root: DictConfig) -> str:
    """The help's body for `root`, the composed config with its `hydra` node."""
    choices = OmegaConf.to_container(root.hydra.runtime.choices)
    primary = primary_groups()
    lines = [
        "Config groups: pick an option with GROUP=OPTION and change its keys with GROUP.KEY=VALUE.",
        "Each option is listed with its keys and defaults; * marks this command line's choice,",
        "shown with the values it would run with and what each key does.",
    ]
    by_group: dict[str, list[Option]] = {}
    for option in options():
        by_group.setdefault(option.group, []).append(option)
    for group, group_options in by_group.items():
        add_on = group not in primary and not group.startswith("hydra/")
        labels = [_label(option, add_on) for option in group_options]
        width = max(len(label) for label in labels)
        lines += ["", _heading(group, group_options, primary)]
        for option, label in zip(group_options, labels, strict=True):
            chosen = choices.get(group) == option.name
            label = ("*" if chosen else " ") + label.ljust(width)
            if add_on:
                lines += _add_on_lines(option, label)
                continue
            if chosen and group in primary:  # as this command line composes it
                keys = flatten(OmegaConf.to_container(root[group], resolve=False))
                keys.pop("name")
                lines += _described(label, keys, option.helps)
                continue
            lines += _wrapped(label, _pairs({k: v for k, v in option.keys.items() if k != "name"}))
    lines += ["", "Top-level keys (KEY=VALUE; a section's keys: SECTION.KEY=VALUE):"]
    lines += _top_level_lines(root, set(primary))
    return "\n".join(lines)


def _label(option: Option, add_on: bool) -> str:
    """How the option is typed: `data=synthetic`; an add-on's name alone, under its heading."""
    return option.name if add_on else f"{option.group}={option.name}"


def _heading(group: str, group_options: list[Option], primary: list[str]) -> str:
    if group in primary:
        return f"{group}:"
    if group.startswith("hydra/"):
        return f"{group}: Hydra's ({group}=OPTION, then {group.replace('/', '.')}.KEY=VALUE)"
    sweeps = "; a study that sweeps runs with -m" if any(o.sweeps for o in group_options) else ""
    return f"{group}: add one with +{group}=OPTION{sweeps}"


def _add_on_lines(option: Option, label: str) -> list[str]:
    """The option's summary, then the options it picks and the keys it sets, what it sweeps."""
    lines = _wrapped(label, [option.summary.rstrip(":;, —")])
    column = len(label) + 4  # under the summary
    lines += _wrapped("", ["sets", *_pairs(option.picks), *_pairs(option.keys)], column)
    if option.sweeps:
        lines += _wrapped("", ["sweeps", *_pairs(option.sweeps)], column)
    return lines


def _top_level_lines(root: DictConfig, groups: set[str]) -> list[str]:
    """`seed=42  help` a line, then each section's keys: `mlflow.  tracking_uri=...  help`."""
    values = OmegaConf.to_container(root, resolve=False)
    shown = {k: v for k, v in values.items() if k not in groups | HIDDEN_KEYS | {"hydra"}}
    sections = {k: v for k, v in shown.items() if isinstance(v, dict)}
    key_helps = helps(Config)
    lines = _described("", {k: v for k, v in shown.items() if k not in sections}, key_helps)
    width = max(map(len, sections), default=0) + 1
    for section, section_values in sections.items():
        section_helps = {k.removeprefix(f"{section}."): h for k, h in key_helps.items()}
        lines += _described(f"{section}.".ljust(width), flatten(section_values), section_helps)
    return lines


def _described(label: str, values: Mapping[str, Any], key_helps: Mapping[str, str]) -> list[str]:
    """`label` then one `key=value  help` a line, the helps in one column (wrapped in it)."""
    prefix = "  " + (f"{label}  " if label else "")
    if not values:  # an option without keys of its own (precision=fp32): its label alone
        return [prefix.rstrip()]
    pairs = dict(zip(values, _pairs(values), strict=True))
    column = len(prefix) + min(ALIGNED, max(map(len, pairs.values()))) + 2
    lines = []
    for key, pair in pairs.items():
        lead = (prefix if not lines else " " * len(prefix)) + pair
        first = lead.ljust(column) if len(lead) + 2 <= column else f"{lead}  "
        text = key_helps.get(key, "")
        lines += _filled(text, first, len(first)) if text else [lead]
    return lines


def _wrapped(label: str, words: list[str], indent: int = 2) -> list[str]:
    """`label` then `words` filled to WIDTH columns, continuation lines under the first word."""
    prefix = " " * indent + (f"{label}  " if label else "")
    if not words:  # an option without keys of its own (precision=fp32): its label alone
        return [prefix.rstrip()]
    return _filled(" ".join(words), prefix, len(prefix))


def _filled(text: str, first: str, indent: int) -> list[str]:
    """`first`, then `text` filled to WIDTH columns, continuation lines `indent` deep."""
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=first,
        subsequent_indent=" " * indent,
        break_long_words=False,
        break_on_hyphens=False,
    )


def _pairs(values: Mapping[str, Any]) -> list[str]:
    return [f"{key}={_typed(value)}" for key, value in values.items()]


def _typed(value: Any) -> str:
    """A value as it is typed on the command line: null, true, [32,64], {}, 'a b'."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_typed(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_typed(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and (not value or " " in value or _reads_as_other_type(value)):
        return repr(value)
    return str(value)


def _reads_as_other_type(text: str) -> bool:
    """ "3", "1e-4", "true", "null": typed bare, Hydra would read them as a number, bool, None."""
    try:
        float(text)
    except ValueError:
        return text.lower() in ("true", "false", "null")
    return True
