"""A Trainer script as users write it (issue 26): arguments through ``HfArgumentParser`` (so the
``--local_rank=N`` that ``deepshard`` and the old ``torch.distributed.launch`` pass is taken, as in
transformers' example scripts), ``deepspeed=`` a ds_config path, one import changed.  Started by
``torchrun --nproc_per_node 2`` or ``deepshard --num_gpus 2``; rank 0 writes what Trainer logged to
``--logs_out``.  The model, rows and collator are the other Trainer tests' (hf_trainer_harness.py)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
from transformers import HfArgumentParser

from deepshard.compat.transformers import Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path: the repo root, for tests.*
from tests.compat.hf_trainer_harness import collate, logged, rows, tiny_llama  # noqa: E402


@dataclass
class ScriptArguments:
    logs_out: str = field(metadata={"help": "rank 0 writes the logged losses here (JSON)"})


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=rows(), data_collator=collate)
    trainer.train()
    if args.process_index == 0:
        with open(script.logs_out, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "local_rank_arg": args.local_rank,
                       "logs": logged(trainer)}, f)


if __name__ == "__main__":
    main()
