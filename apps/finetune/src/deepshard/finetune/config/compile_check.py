"""``compile=true``: the layouts per-block ``torch.compile`` cannot run, refused before any worker starts.

Each refusal names the key and why (what was tried: ``tests/app/test_compile.py``).  Everything
else composes: ZeRO 0-3, TP (a static graph per sequence length: :func:`check_tp_lengths`), CPU offload of the optimizer state and of the parameters, AC and AC
offload, sp (Ulysses' all-to-alls as functional collectives inside the block's graph), LoRA,
bf16/fp16 with the loss scaler, ZeRO-3's tiled embedding and head (outside the blocks, left eager).
"""

from __future__ import annotations

import math
from typing import Any

from deepshard.core.compile import RECOMPILE_LIMIT

# ``settings``: the app's ``config.settings.Settings``, not imported (it imports this module: no circle)
Settings = Any


def check_compile(settings: Settings) -> None:
    """ValueError, one line naming the key, for each layout ``compile=true`` does not run with."""
    s, par = settings, settings.parallel
    if par.pp > 1:
        raise ValueError(f"compile=true with parallel.pp={par.pp}: compiled pipeline stages are not built "
                         "yet (the schedules re-enter the stage's blocks per micro-batch); use compile=false")
    if par.tp > 1:
        check_tp_lengths(settings)
    if getattr(s.model, "num_experts", 0):
        raise ValueError("compile=true with an MoE model: the router's data-dependent expert dispatch breaks "
                         "the block's graph (fullgraph); use compile=false")
    if s.model.mlp_tiles > 1:
        raise ValueError(f"compile=true with model.mlp_tiles={s.model.mlp_tiles}: the tiled MLP's own "
                         "recompute (an autograd.Function over the block's parameters) breaks the block's "
                         "graph; use model.mlp_tiles=1")
    if s.offload.params == "nvme":
        raise ValueError("compile=true with offload.params=nvme: the parameter swap is not tried with compiled "
                         "blocks yet; use offload.params=cpu or compile=false")


def check_tp_lengths(settings: Settings) -> None:
    """Under tp, blocks compile one static graph per sequence length and grad mode (torch 2.13 cannot
    compile the symbolic graph over DTensor: ``deepshard.core.compile``), so the lengths the run can
    see (``data.seq_len`` cut into ``data.pad_to_multiple_of`` buckets), times training and eval, times
    LoRA's two input kinds, must fit ``RECOMPILE_LIMIT`` graphs per block code."""
    d = settings.data
    buckets = math.ceil(d.seq_len / d.pad_to_multiple_of) if d.pad_to_multiple_of else 1
    kinds = 2 * (2 if settings.peft is not None else 1)  # train + eval (no grad); LoRA: first block's input
    if buckets * kinds > RECOMPILE_LIMIT:
        raise ValueError(
            f"compile=true with parallel.tp={settings.parallel.tp} and data.pad_to_multiple_of={d.pad_to_multiple_of}: "
            f"tp blocks compile a static graph per length (torch 2.13 fails to compile the symbolic one over "
            f"DTensor), and data.seq_len={d.seq_len} in buckets of {d.pad_to_multiple_of} is {buckets} lengths x "
            f"{kinds} graph kinds > the recompile limit {RECOMPILE_LIMIT}; use data.pad_to_multiple_of >= "
            f"{math.ceil(d.seq_len / (RECOMPILE_LIMIT // kinds))}, null, or compile=false")
