"""A DeepSpeed training script on ``deepshard.compat.deepspeed``, as DeepSpeed users write one for
``deepspeed train.py``: argparse with ``--local_rank``, ``deepspeed.initialize``, ``load_checkpoint``
of ``latest`` at start (``(None, None)`` on the first run), a save every ``--save_every`` steps.

ZeRO-3 in fp32 on a small MLP whose blocks sit in a ModuleList; the batch of a step is a function of
(step, rank) alone, so a resumed run sees the data an uninterrupted one does.  Each rank appends one
JSON line per step to ``--out`` (the loss as ``float.hex``: compared bit for bit).  ``--die_at R:S``:
rank R SIGKILLs itself before step S, once (a marker file beside ``--out`` remembers it).
``main(argv)`` also runs on the ranks of the session's gloo pool (tests/launch/conftest.py's reference).
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
from torch import nn

import deepshard.compat.deepspeed as deepspeed

DS_CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
             "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
             "zero_optimization": {"stage": 3}}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save_every", type=int, default=4)
    parser.add_argument("--ckpt_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--die_at", default="")
    args = parser.parse_args(argv)
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = Net()
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), config=DS_CONFIG)
    engine.load_checkpoint(args.ckpt_dir)  # latest; nothing on the first run
    rank, attempt = engine.global_rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    die_rank, _, die_step = args.die_at.partition(":")
    marker = f"{args.out}.died"
    for step in range(engine.global_steps + 1, args.steps + 1):
        if args.die_at and rank == int(die_rank) and step == int(die_step) and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, rank)
        x, y = x.to(engine.device), y.to(engine.device)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        row = {"rank": rank, "attempt": attempt, "step": step, "loss": loss.item().hex(),
               "server": os.environ.get("SSH_CONNECTION", "").split()[2:3],  # the ssh host that ran it
               "env_file": os.environ.get("FROM_ENV_FILE")}
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        if step % args.save_every == 0:
            engine.save_checkpoint(args.ckpt_dir)


def on_pool_rank(work: str) -> None:
    """``main`` on a rank of the session's gloo pool, with the arguments the launcher gives a worker."""
    main([f"--local_rank={os.environ['LOCAL_RANK']}", "--ckpt_dir", f"{work}/ckpt", "--out", f"{work}/losses.jsonl"])


if __name__ == "__main__":
    main()
