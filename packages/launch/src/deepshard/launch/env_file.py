"""The environment a job's workers get beyond the launcher's own: DeepSpeed's ``.deepspeed_env``.

As in DeepSpeed, the file is named by ``DS_ENV_FILE`` (default ``.deepspeed_env``; an absolute path
is used as is) and read from the home directory, then the current directory (a later file wins);
each line is ``NAME=VALUE``, blank lines and ``#`` comments are skipped.  Its variables reach every
worker on every node, as do this environment's variables with DeepSpeed's forwarded prefixes (over
ssh a remote shell would not have them).  Only shell variable names (``[A-Za-z_][A-Za-z0-9_]*``) are
forwarded: over ssh each becomes ``export NAME=VALUE`` in a remote shell, where any other name is
shell syntax (``PYTHON_X$(cmd)`` would run ``cmd``; ``PYTHON.CACHE`` fails every node's shell).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ENV_FILE_VAR = "DS_ENV_FILE"
DEFAULT_NAME = ".deepspeed_env"
# forwarded to remote nodes from the launcher's environment (DeepSpeed's EXPORT_ENVS, with its
# accelerator's NCCL, and deepshard's own)
EXPORT_PREFIXES = ("NCCL", "PYTHON", "MLFLOW", "MV2", "UCX", "DEEPSHARD", "OMP_NUM_THREADS")

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def shell_name(name: str) -> bool:
    """Whether ``name`` can be exported by a POSIX shell as it is (quoting cannot make another name one)."""
    return _NAME.fullmatch(name) is not None


def env_files(environ: dict[str, str] | None = None) -> list[Path]:
    """The env files that exist, in the order they apply."""
    environ = os.environ if environ is None else environ
    name = environ.get(ENV_FILE_VAR, DEFAULT_NAME)
    candidates = [Path(name)] if os.path.isabs(name) else [Path.home() / name, Path.cwd() / name]
    if environ.get(ENV_FILE_VAR) and not any(p.is_file() for p in candidates):
        raise ValueError(f"{ENV_FILE_VAR}={name}: no such file (looked in {', '.join(map(str, candidates))})")
    seen, out = set(), []
    for path in candidates:
        if path.is_file() and path.resolve() not in seen:
            seen.add(path.resolve())
            out.append(path)
    return out


def read_env_file(path: Path) -> dict[str, str]:
    """``NAME=VALUE`` lines of one file (ValueError naming file:line for anything else)."""
    out: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.removeprefix("export ").strip()
        if not sep or not shell_name(name):
            raise ValueError(f"{path}:{number}: {line!r} is not a NAME=VALUE line")
        out[name] = value
    return out


def unforwardable(environ: dict[str, str] | None = None) -> list[str]:
    """This environment's variables with a forwarded prefix that :func:`job_env` leaves out: their
    names are not shell variable names (the launcher names them in one warning)."""
    environ = os.environ if environ is None else environ
    return sorted(k for k in environ if k.startswith(EXPORT_PREFIXES) and not shell_name(k))


def job_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """What every worker gets on top of its node's environment: the forwarded prefixes (shell variable
    names only, see :func:`unforwardable`), then the env files."""
    environ = dict(os.environ if environ is None else environ)
    out = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES) and shell_name(k)}
    for path in env_files(environ):
        out.update(read_env_file(path))
    return out
