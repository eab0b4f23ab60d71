"""``+deepspeed=ds_config.json`` on the app's command line: the file's settings as Hydra overrides.

The translation is ``deepshard.compat.ds_config``'s (the same one ``deepshard.compat.deepspeed``
uses); here its entries become overrides placed before the command line's own, so anything given on
the command line wins; keys the app does not support are named in one warning (an error with
``deepspeed.strict=true``).  ``python -m deepshard.finetune.config.ds_config FILE`` prints the overrides.
"""

from __future__ import annotations

import shlex
import sys

from deepshard.compat.ds_config import Translation, read, translate

__all__ = ["Translation", "main", "merge_argv", "read", "translate"]


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merge_argv(argv: list[str]) -> tuple[list[str], Translation | None]:
    """``argv`` with ``+deepspeed=FILE`` replaced by its overrides, ahead of the user's own.

    A key or group the user sets is dropped from the translation (the user wins).
    """
    rest, path, strict = [], None, False
    for arg in argv:
        key = _key(arg)
        if key == "deepspeed" and "=" in arg:
            path = arg.split("=", 1)[1]
        elif key == "deepspeed.strict" and "=" in arg:
            strict = arg.split("=", 1)[1].lower() in ("true", "1", "yes")
        else:
            rest.append(arg)
    if path is None:
        return argv, None
    tr = read(path)
    tr.drop({_key(a) for a in rest if "=" in a and not a.startswith("-")})
    if tr.unsupported:
        message = f"deepspeed={path}: not supported, ignored: {', '.join(tr.unsupported)}"
        if strict:
            raise ValueError(message + " (deepspeed.strict=true)")
        print(f"warning: {message}", file=sys.stderr)
    return rest[:1] + tr.overrides + rest[1:], tr


def main(argv: list[str] | None = None) -> int:
    """``python -m deepshard.finetune.config.ds_config FILE``: the equivalent command-line overrides."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m deepshard.finetune.config.ds_config ds_config.json", file=sys.stderr)
        return 2
    try:
        tr = read(args[0])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(" ".join(shlex.quote(o) for o in tr.overrides))
    for note in tr.notes:
        print(f"# built in: {note}", file=sys.stderr)
    if tr.unsupported:
        print(f"# not supported, ignored: {', '.join(tr.unsupported)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
