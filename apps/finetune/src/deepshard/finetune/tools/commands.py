"""The tools under names users type, as DeepSpeed ships ``ds_report`` and ``ds_to_universal``.

``deepshard-export``, ``deepshard-estimate`` and ``deepshard-convert`` are console scripts of this app
(``deepshard-report`` is compat's, ``deepshard.compat.report``).  Each runs the same ``main`` as its
``python -m deepshard.finetune.tools.*`` form, which keeps working, under its own name.
"""

from __future__ import annotations

import sys

DIRECTIONS = {"from-deepspeed": "deepshard.finetune.tools.from_deepspeed",
              "to-deepspeed": "deepshard.finetune.tools.to_deepspeed"}

CONVERT_HELP = """\
usage: deepshard-convert {from-deepspeed,to-deepspeed} ... [-h]

Convert checkpoints between DeepSpeed and deepshard.

  deepshard-convert from-deepspeed DS_CHECKPOINT_DIR OUT_DIR [--tag TAG]
      a DeepSpeed ZeRO-1/2/3 checkpoint as one of ours (OUT_DIR/step-NNNNNNNN), resumable by
      engine.load_checkpoint, core's load_checkpoint or the app's checkpoint.resume
  deepshard-convert to-deepspeed CKPT OUT_DIR [--stage N] [--world W] [--tag TAG] ...
      one of our checkpoints as a DeepSpeed ZeRO-1/2/3 checkpoint that DeepSpeed's
      engine.load_checkpoint(OUT_DIR) resumes

deepshard-convert DIRECTION --help lists each direction's options.
"""


def export_main() -> int:
    """``deepshard-export CKPT OUT_DIR``: a checkpoint as a HF model folder or a PEFT adapter."""
    from deepshard.finetune.tools import export

    return export.main(sys.argv[1:], prog="deepshard-export")


def estimate_main() -> int:
    """``deepshard-estimate [overrides]``: per-rank memory of a run before it starts."""
    from deepshard.finetune.tools import estimate

    return estimate.main(sys.argv[1:], prog="deepshard-estimate")


def convert_main(argv: list[str] | None = None) -> int:
    """``deepshard-convert {from-deepspeed,to-deepspeed} ...``: checkpoints between DeepSpeed and us."""
    import importlib

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(CONVERT_HELP, end="")
        return 0
    if not args or args[0] not in DIRECTIONS:
        got = f"{args[0]!r} is not a direction" if args else "a direction is required"
        print(f"deepshard-convert: error: {got}; choose from-deepspeed or to-deepspeed (see deepshard-convert --help)",
              file=sys.stderr)
        return 2
    tool = importlib.import_module(DIRECTIONS[args[0]])
    return tool.main(args[1:], prog=f"deepshard-convert {args[0]}")
