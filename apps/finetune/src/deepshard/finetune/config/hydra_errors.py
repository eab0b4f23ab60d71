"""Hydra's own refusals as the app's one ``error:`` line: what Hydra finds wrong before our code runs.

An override it cannot parse, a key or a config-group option that does not exist, a value its schema
refuses, a run directory it cannot create or write.  Hydra prints these as several lines (exit 1);
main.py has Hydra raise them instead (``HYDRA_FULL_ERROR=1`` until our task starts) and prints the
line :func:`error_line` makes, exit 2.  A value that came from ``+deepspeed=ds_config.json`` is named
by the file and its own key.
"""

from __future__ import annotations

import dataclasses
import difflib
import re

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from deepshard.finetune.config.ds_config import Translation


def _key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def _first(text: object) -> str:
    """The first line of a message, without Hydra's pointers (they follow on later lines)."""
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def _override(argv: list[str], key: str) -> str:
    """The command line's override of ``key`` (``train.lrr=3``), or the key when none sets it."""
    return next((a.lstrip("+~") for a in reversed(argv[1:]) if "=" in a and _key(a) == key), key)


def _no_such_key(cause: OmegaConfBaseException, argv: list[str]) -> str:
    full_key = str(cause.full_key)
    known = [f.name for f in dataclasses.fields(cause.object_type)] \
        if dataclasses.is_dataclass(cause.object_type) else []
    prefix = full_key.rsplit(".", 1)[0] + "." if "." in full_key else ""
    close = difflib.get_close_matches(full_key.rsplit(".", 1)[-1], known, n=1)
    if close:
        hint = f"did you mean {prefix}{close[0]}?"
    elif known:
        hint = f"valid keys{' in ' + prefix[:-1] if prefix else ''}: {', '.join(known)}"
    else:
        hint = "see AppSchema in apps/finetune/src/deepshard/finetune/config/settings.py"
    return f"{_override(argv, full_key)}: no such key; {hint}"


def _from_ds_config(full_key: str, reason: str, translation: Translation | None) -> str | None:
    """The ds_config key a failing override came from, named as the file names it."""
    if translation is None or full_key not in translation.origin:
        return None
    if not any(_key(o) == full_key for o in translation.overrides):
        return None  # the command line set it: the user's own override failed
    ds_key, value = translation.origin[full_key]
    return f"{translation.source}: {ds_key}={value!r}: {reason}"


def run_dir_line(err: OSError, argv: list[str]) -> str:
    """A run directory that cannot be created or written (read-only, full, under a file, no permission)."""
    given = next((a.split("=", 1)[1] for a in reversed(argv[1:]) if _key(a) == "hydra.run.dir" and "=" in a), None)
    where = f"hydra.run.dir={given}" if given else "hydra.run.dir (outputs/DATE/TIME under this directory)"
    what = f"{err.strerror or type(err).__name__}" + (f": {err.filename}" if err.filename else "")
    return f"{where}: cannot create or write the run directory ({what}); choose another with hydra.run.dir=DIR"


def error_line(err: BaseException, argv: list[str], translation: Translation | None = None) -> str | None:
    """The one line for an error Hydra raised before our task ran, or None for anything else (a bug:
    its traceback is worth more)."""
    if isinstance(err, OverrideParseException):
        return f"{err.override}: not a valid override ({_first(err.message)}; values with special characters " \
               f"need quotes: key='value')"
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, choice = err.missing_cfg_file.rsplit("/", 1)
        line = f"{group}={choice}: " + (f"valid values are {', '.join(err.options)}" if err.options
                                         else f"no config group {group!r}")
        return _from_ds_config(group, line, translation) or line
    if isinstance(err, OSError) and not isinstance(err, HydraException):
        return run_dir_line(err, argv)
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        full_key = str(cause.full_key)
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and str(cause).startswith("Key "):
            return _no_such_key(cause, argv)
        reason = _first(getattr(cause, "msg", None) or cause)
        return _from_ds_config(full_key, reason, translation) or f"{_override(argv, full_key)}: {reason}"
    append = re.match(r"Could not override '([\w.]+)'\. No match in the defaults list", str(err))
    if append:  # ``zero=stage3`` for a group the defaults list leaves out
        override = _override(argv, append.group(1))
        return f"{override}: {append.group(1)} is not in the defaults list; add it with +{override}"
    if isinstance(err, (HydraException, OmegaConfBaseException)):
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        return " ".join(line for line in lines if not line.startswith(("Config search path", "provider=")))
    return None
