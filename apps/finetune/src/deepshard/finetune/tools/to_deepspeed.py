"""``python -m deepshard.finetune.tools.to_deepspeed CKPT OUT_DIR [--stage N] [--world W] [--tag TAG]``

One of our checkpoints (a ``step-*`` directory, or a folder of them: the newest good one) as a
DeepSpeed ZeRO-1/2/3 checkpoint that DeepSpeed's ``engine.load_checkpoint(OUT_DIR)`` resumes at
data-parallel size W (default: the size it was saved at); a ``deepspeed.moe`` model's checkpoint becomes
DeepSpeed's expert files (``layer_N_expert_M_...``, ``expp_rank_R_...``; ``--ep-size``, stage 0).  The conversion (DeepSpeed's flat ZeRO
layouts, parameter groups, counters) is ``deepshard.compat.deepspeed.ds_export``; this is its
command line.
"""

from __future__ import annotations

import argparse
import sys

from deepshard.compat.deepspeed.ds_export import DS_SUB_GROUP_SIZE, export_checkpoint
from deepshard.finetune.tools.cli import ArgumentParser

__all__ = ["export_checkpoint", "main"]


def main(argv: list[str] | None = None, *, prog: str = "python -m deepshard.finetune.tools.to_deepspeed") -> int:
    """The command line: exit 0 and the written tag's path, or 2 and one ``error:`` line."""
    ap = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[1])
    ap.add_argument("ckpt")
    ap.add_argument("out_dir")
    ap.add_argument("--stage", type=int, default=None, help="ZeRO stage of the DeepSpeed run that resumes (1, 2 or 3; "
                    "default 2; a deepspeed.moe model's expert files: 0, the default there)")
    ap.add_argument("--ep-size", type=int, default=None, help="deepspeed.moe: the experts' ep_size (default: as saved)")
    ap.add_argument("--sub-group-size", type=int, default=DS_SUB_GROUP_SIZE,
                    help="ZeRO-3: the resuming run's zero_optimization.stage3_sub_group_size (DeepSpeed's default)")
    ap.add_argument("--world", type=int, default=None, help="its data-parallel size (default: as saved)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--groups", type=int, default=None, choices=[1, 2],
                    help="the resuming script's parameter groups: 1 (model.parameters()) or 2 (decayed matrices, "
                         "then the rest); default: an imported run's own, else 2")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="DeepSpeed's bf16 file names (bf16_zero_pp_rank_*); default: as an imported run's")
    ap.add_argument("--parameter-alignment", action=argparse.BooleanOptionalAction, default=None,
                    help="ZeRO-1/2: the resuming run sets zero_optimization.parameter_alignment (default: as an "
                         "imported run's)")
    ap.add_argument("--fp16", action="store_true", help="the resuming run trains in fp16 (alignment in 2-byte units)")
    args = ap.parse_args(argv)
    try:
        print(export_checkpoint(args.ckpt, args.out_dir, stage=args.stage, world=args.world, tag=args.tag,
                                sub_group_size=args.sub_group_size, num_groups=args.groups, bf16=args.bf16,
                                parameter_alignment=args.parameter_alignment, fp16=args.fp16, ep_size=args.ep_size))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
