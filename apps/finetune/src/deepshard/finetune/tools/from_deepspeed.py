"""``python -m deepshard.finetune.tools.from_deepspeed DS_CHECKPOINT_DIR [--tag TAG] OUT_DIR``

A DeepSpeed ZeRO-1/2/3 checkpoint (any data-parallel world size) as one of our checkpoints,
``OUT_DIR/step-NNNNNNNN``: fp32 master weights, both Adam moments, the update count, the loss scaler
and DeepSpeed's counters.  It resumes like any checkpoint of ours: ``engine.load_checkpoint(OUT_DIR)``
(deepshard.compat.deepspeed), core's ``load_checkpoint``, or this app's ``checkpoint.resume=OUT_DIR``
(whose model family maps HF parameter names to ours).  The conversion is
``deepshard.compat.deepspeed.ds_import``; this is its command line.

Whatever is wrong with the files (refused, truncated, a key missing, a partition of the wrong size)
is one ``error:`` line naming the file, exit 2; no partial ``step-N.tmp-import`` stays, and a
leftover of a killed import is removed (one whose importer still runs is named, exit 2).
"""

from __future__ import annotations

import sys

from deepshard.compat.deepspeed.ds_import import import_checkpoint
from deepshard.finetune.tools.cli import ArgumentParser

__all__ = ["import_checkpoint", "main"]


def main(argv: list[str] | None = None, *, prog: str = "python -m deepshard.finetune.tools.from_deepspeed") -> int:
    """The command line: exit 0 and the new checkpoint's path, or 2 and one ``error:`` line."""
    ap = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[1])
    ap.add_argument("ds_checkpoint_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--tag", default=None, help="the checkpoint tag (default: the one in DS_CHECKPOINT_DIR/latest)")
    args = ap.parse_args(argv)
    try:
        path = import_checkpoint(args.ds_checkpoint_dir, args.out_dir, tag=args.tag)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # OUT_DIR read-only or full
        print(f"error: {err.filename or args.out_dir}: cannot write the import ({err.strerror or err})", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
