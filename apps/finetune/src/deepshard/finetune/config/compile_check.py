"""``compile=true``: the layouts per-block ``torch.compile`` cannot run, refused before any worker starts.

Each refusal names the key and why (what was tried: ``tests/app/test_compile.py``).  Everything
else composes: ZeRO 0-3, CPU offload of the optimizer state and of the parameters, AC and AC
offload, sp (Ulysses' all-to-alls as functional collectives inside the block's graph), LoRA,
bf16/fp16 with the loss scaler, ZeRO-3's tiled embedding and head (outside the blocks, left eager).
"""

from __future__ import annotations

from typing import Any

# ``settings``: the app's ``config.settings.Settings``, not imported (it imports this module: no circle)
Settings = Any


def check_compile(settings: Settings) -> None:
    """ValueError, one line naming the key, for each layout ``compile=true`` does not run with."""
    s, par = settings, settings.parallel
    if par.pp > 1:
        raise ValueError(f"compile=true with parallel.pp={par.pp}: compiled pipeline stages are not built "
                         "yet (the schedules re-enter the stage's blocks per micro-batch); use compile=false")
    if par.tp > 1:
        raise ValueError(f"compile=true with parallel.tp={par.tp}: a compiled block with DTensor weights trains "
                         "at one sequence length but fails to recompile for another on torch 2.13 (dynamo's "
                         "dynamic shapes over DTensor: BackendCompilerFailed, RecursionError in proxy_tensor), "
                         "and eval and the end-of-run sample change the length; use compile=false with tp")
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
