"""``python -m deepshard.finetune.tools.export CKPT OUT_DIR``: a checkpoint as a HF model folder
(``hf_export``), or for a LoRA checkpoint a PEFT adapter folder or the merged model (``adapter_export``)."""

from __future__ import annotations

import json
import sys

from deepshard.finetune.tools.cli import ArgumentParser

DTYPE_NAMES = ("bf16", "fp16", "fp32")  # hf_export.DTYPES' keys: --help and a bad argument need no torch


def parse_size(text: str) -> int:
    """``2GB``, ``500MB``, ``1e9``: bytes."""
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit):
            return int(float(t[:-len(unit)]) * factor)
    return int(float(t))


def main(argv: list[str] | None = None, *, prog: str = "python -m deepshard.finetune.tools.export") -> int:
    parser = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a step-NNNNNNNN checkpoint directory")
    parser.add_argument("out_dir", help="where to write the HF model folder")
    parser.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES)
    parser.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (e.g. 500MB, 2GB)")
    lora = parser.add_mutually_exclusive_group()  # +peft=lora checkpoints (adapter_export.py)
    lora.add_argument("--adapter", action="store_true", help="write a PEFT adapter folder (PeftModel.from_pretrained)")
    lora.add_argument("--merge", action="store_true", help="write the base with the adapters merged, a full HF model")
    parser.add_argument("--base", default=None, help="--merge: the base's HF folder (default: the one trained on)")
    args = parser.parse_args(argv)
    try:
        from deepshard.finetune.tools import adapter_export as ax
        from deepshard.finetune.tools.hf_export import export_checkpoint

        if args.adapter:
            summary = ax.export_adapter(args.checkpoint, args.out_dir, dtype=args.dtype)
        elif args.merge:
            summary = ax.export_merged(args.checkpoint, args.out_dir, dtype=args.dtype, base_dir=args.base,
                                       max_shard_bytes=parse_size(args.max_shard_size))
        elif ax.is_lora_checkpoint(args.checkpoint):
            raise ValueError(f"checkpoint {args.checkpoint!r} holds LoRA adapters only (+peft=lora): pass --adapter "
                             f"(a PEFT adapter folder) or --merge (the base with the adapters merged)")
        else:
            summary = export_checkpoint(args.checkpoint, args.out_dir, dtype=args.dtype,
                                        max_shard_bytes=parse_size(args.max_shard_size))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
