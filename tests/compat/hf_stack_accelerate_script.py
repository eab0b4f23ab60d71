"""A plain accelerate training loop as users write it (issue 41): ``Accelerator()``, ``prepare``,
``accelerator.backward``, ``clip_grad_norm_``, ``optimizer.step()`` under ``accelerator.accumulate``.  No deepshard import and
nothing DeepSpeed-specific: the layout comes from how it is started.

- ``DEEPSHARD_DEEPSPEED=1 accelerate launch --config_file ds.yaml hf_stack_accelerate_script.py ...``:
  accelerate's own DeepSpeed path (``DeepSpeedPlugin`` from the yaml's ``deepspeed_config``, the model by path
  under ``zero.Init`` with ``zero3_init_flag``, ``DeepSpeedCPUAdam`` for the script's AdamW with optimizer
  offload) on deepshard's engine;
- ``ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 ...``: accelerate's MULTI_CPU path (DDP over gloo),
  what bench/record_hf_stack_ds.py records as the reference.

No scheduler: accelerate steps a prepared scheduler ``num_processes`` times per update on its plain path
and DeepSpeed's engine steps it once, so the two paths differ there by accelerate's design, not by engine.
Rank 0 writes each micro-batch's loss (averaged over ranks) to ``--result``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path: the repo root, for tests.*
from tests.compat.hf_trainer_harness import collate, rows  # noqa: E402

MICRO_BATCHES = 8  # 4 updates at gradient_accumulation_steps=2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--result", required=True)
    opts, _ = ap.parse_known_args()
    accelerator = Accelerator()  # accumulation steps from the yaml's deepspeed_config (or ACCELERATE_GRADIENT_...)
    model = AutoModelForCausalLM.from_pretrained(opts.model, dtype=torch.float32)
    loader = DataLoader(rows(2 * 2 * MICRO_BATCHES), batch_size=2, shuffle=False, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:  # under DeepSpeed the engine clips (accelerate fills gradient_clipping 1.0)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
        if len(losses) == MICRO_BATCHES:
            break
    if accelerator.is_main_process:
        state = accelerator.state
        Path(opts.result).write_text(json.dumps({
            "losses": losses, "distributed_type": state.distributed_type.value, "num_processes": state.num_processes,
            "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
            "engine": f"{type(model).__module__}.{type(model).__name__}",
            "zero_stage": state.deepspeed_plugin.zero_stage if state.deepspeed_plugin else None}))


if __name__ == "__main__":
    main()
