"""``+deepspeed=ds_config.json`` on the app's command line: the file's settings as Hydra overrides.

The translation is ``deepshard.compat.ds_config``'s (the same one ``deepshard.compat.deepspeed``
uses); here its entries become overrides placed before the command line's own, so anything given on
the command line wins; keys the app does not support are named in one warning (an error with
``deepspeed.strict=true``), and one whose absence would change the results (another optimizer, gradient
pre-scaling...) stops the run, naming the file and the key.  ``python -m deepshard.finetune.config.ds_config FILE`` prints the overrides.

The batch triple (``train_batch_size`` = micro batch x accumulation x data-parallel size) can only be
checked once the world size is known, after Hydra: :func:`resolve_batch_as_given` says a contradiction
in the file's own keys, with the file's name and the one change that fixes it at this world size.
"""

from __future__ import annotations

import shlex
import sys

from deepshard.compat.ds_config import Translation, read, translate
from deepshard.compat.resolve import APP_BATCH_KEYS, resolve_batch

__all__ = ["Translation", "main", "merge_argv", "read", "resolve_batch_as_given", "translate"]

_GIVEN: Translation | None = None  # this process's +deepspeed= file (merge_argv), for errors found after Hydra


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
    global _GIVEN
    tr = read(path)
    tr.drop({_key(a) for a in rest if "=" in a and not a.startswith("-")})
    _GIVEN = tr
    if tr.unsupported:
        from deepshard.compat.deepspeed.result_keys import RESULT_CHANGING

        changing = [k for k in tr.unsupported if k.startswith(RESULT_CHANGING)]
        if changing:  # ignoring these would change the numbers: stop before Hydra, before any worker
            raise ValueError(f"deepspeed={path}: {changing[0]}: not supported by deepshard, and ignoring it would "
                             f"change the results; remove it")
        message = f"deepspeed={path}: not supported, ignored: {', '.join(tr.unsupported)}"
        if strict:
            raise ValueError(message + " (deepspeed.strict=true)")
        print(f"warning: {message}", file=sys.stderr)
    return rest[:1] + tr.overrides + rest[1:], tr


def resolve_batch_as_given(train: dict, dp: int, *, microbatches: int = 1) -> None:
    """:func:`~deepshard.compat.resolve.resolve_batch` (``train`` resolved in place), its contradiction said
    in the keys the user wrote: a ``+deepspeed=`` file's own (``ds_config.json: train_batch_size=16 !=
    train_micro_batch_size_per_gpu=4 x ...``) with the values that would agree at this data-parallel size;
    a key given on the command line keeps its ``train.*`` name."""
    try:
        resolve_batch(train, dp, microbatches=microbatches)
    except ValueError as err:
        tr = _GIVEN
        from_file = [k in tr.origin and k in tr.entries for k in APP_BATCH_KEYS] if tr is not None else []
        if not any(from_file):
            raise
        keys = tuple(tr.origin[k][0] if mine else k for k, mine in zip(APP_BATCH_KEYS, from_file))
        try:
            resolve_batch(dict(train), dp, keys=keys, microbatches=microbatches)
        except ValueError as named:
            raise ValueError(f"{tr.source}: {named}{_batch_fix(train, dp, microbatches, keys)}") from None
        raise err from None


def _batch_fix(train: dict, dp: int, microbatches: int, keys: tuple[str, ...]) -> str:
    """`` (at data-parallel size 2: set train_batch_size=32 or ...)``: each one change that makes the triple agree."""
    g, m, a = train.get("global_batch_size", 0), train["micro_batch_size"], train["grad_accum"]
    width = dp * microbatches
    size = f"data-parallel size {dp}" + (f" x pipeline.microbatches={microbatches}" if microbatches > 1 else "")
    kg, km, ka = keys
    fixes = [f"{kg}={m * a * width}"] if m and a else []
    if m and g and g % (m * width) == 0:
        fixes.append(f"{ka}={g // (m * width)}")
    if a and g and g % (a * width) == 0:
        fixes.append(f"{km}={g // (a * width)}")
    return f" (at {size}: set {' or '.join(fixes)})" if fixes else ""


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
