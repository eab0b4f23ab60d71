"""A DeepSpeed ZeRO-1/2/3 checkpoint (``latest``, ``mp_rank_*_model_states.pt``,
``*zero_pp_rank_*_optim_states.pt``; any data-parallel world size) as an ordinary checkpoint of ours,
``OUT_DIR/step-NNNNNNNN``: fp32 master weights, both Adam moments, the update count (Adam's step,
which is also where the LR schedule stands), the loss scaler and DeepSpeed's counters, under the
parameter names DeepSpeed saved.  It resumes at any world size and ZeRO stage like any checkpoint of
ours: ``engine.load_checkpoint(OUT_DIR)`` here, core's ``load_checkpoint``, or an app's resume.

Files are read without running anything in them (``ds_files``); each output tensor is assembled when
DCP writes it, from the mapped pieces of the rank files holding it (``ds_layout``), so the peak
memory is about one parameter, never the model (DeepSpeed's zero_to_fp32 holds it all).  Whatever is
wrong with the files is a ValueError naming the file, and no partial output stays (core's
``write_offline_checkpoint``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from deepshard.core.checkpoint import write_offline_checkpoint

from .ds_files import DS_OWN_KEYS, resolve_tag_dir
from .ds_layout import DsCheckpoint, reading
from .ds_moe_import import import_moe_checkpoint, is_moe_checkpoint

__all__ = ["client_state", "import_checkpoint", "loss_scaler_state"]

KINDS = {"model.": "master", "optim.exp_avg.": "exp_avg", "optim.exp_avg_sq.": "exp_avg_sq"}


def import_checkpoint(ds_dir: str | Path, out_dir: str | Path, *, tag: str | None = None) -> Path:
    """Write ``out_dir/step-N`` from the DeepSpeed checkpoint (``tag``, or the one ``latest`` names);
    returns its path."""
    tag_dir = resolve_tag_dir(ds_dir, tag)
    if is_moe_checkpoint(tag_dir):  # deepspeed.moe's per-expert files (ds_moe_import)
        return import_moe_checkpoint(tag_dir, out_dir)
    ds = DsCheckpoint(tag_dir)
    ms = ds.model_states
    params = {p.name: p for p in ds.params}
    state: dict[str, torch.Tensor] = {}
    for prefix in KINDS:
        for p in ds.params:
            state[prefix + p.name] = torch.empty(p.shape, dtype=torch.float32, device="meta")
    with reading(ds.model_file):
        buffers = {n: t for n, t in ms["module"].items() if n in set(ms.get("buffer_names") or [])}
        for name, t in buffers.items():
            state["model." + name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
        # tied weights (lm_head.weight -> model.embed_tokens.weight): DeepSpeed trains one, our checkpoints
        # also hold the alias (the model's state_dict has it), in the module's dtype
        aliases = {a: src for a, src in dict(ms.get("shared_params") or {}).items() if src in params}
        for alias, src in aliases.items():
            dtype = ms["module"][alias].dtype if alias in ms["module"] else torch.float32
            state["model." + alias] = torch.empty(params[src].shape, dtype=dtype, device="meta")
        global_steps = int(ms.get("global_steps", ds.adam_step))

    def build(fqn: str) -> torch.Tensor:
        if fqn.startswith("model.") and fqn[len("model."):] in aliases:
            alias = fqn[len("model."):]
            return ds.full(params[aliases[alias]], "master").to(state[fqn].dtype)
        for prefix, kind in KINDS.items():
            if fqn.startswith(prefix) and fqn[len(prefix):] in params:
                return ds.full(params[fqn[len(prefix):]], kind)
        return buffers[fqn[len("model."):]].clone()

    step = ds.adam_step
    app, scaler = _app_state(ds, tag_dir, step, global_steps)
    record = app["deepspeed"]
    note = (f"imported from DeepSpeed {record['version']} (ZeRO-{ds.stage}, dp {ds.world}, tag {tag_dir.name}): "
            f"fp32 weights and Adam moments, Adam and the LR schedule at update {step}, loss scale "
            f"{scaler['scale']:g} (DeepSpeed saves no data position or RNG)")
    return write_offline_checkpoint(out_dir, step, state, build, scaler=scaler, app_state=app, zero_stage=ds.stage,
                                    dp_size=ds.world,
                                    meta={"source": f"deepspeed {record['version']} {tag_dir}", "note": note})


def _app_state(ds: DsCheckpoint, tag_dir: Path, step: int, global_steps: int) -> tuple[dict[str, Any], dict]:
    """What compat's engine keeps beside the tensors (its counters, the script's client_state) and the
    DeepSpeed run's record (to_deepspeed writes its layout back); the loss scaler's state."""
    ms = ds.model_states
    with reading(ds.model_file):
        sched = dict(ms.get("lr_scheduler") or {})
        counters = {"global_steps": global_steps, "global_samples": int(ms.get("global_samples", 0)),
                    "skipped_steps": int(ms.get("skipped_steps", 0)), "micro_steps": 0}
    with reading(ds.optim_files[0]):
        scaler = loss_scaler_state(ds.osd_meta, global_steps)
    if sched and int(sched.get("last_batch_iteration", step - 1)) + 1 != step:
        print(f"warning: {tag_dir}: the LR scheduler is at iteration {sched['last_batch_iteration']} but Adam at "
              f"step {step} (skipped fp16 steps); one counter drives both here: Adam's", file=sys.stderr)
    app = {"counters": counters, "client_state": client_state(ms, ds.model_file),
           "deepspeed": {"tag": tag_dir.name, "version": str(ms.get("ds_version", "?")), "zero_stage": ds.stage,
                         "dp_world_size": ds.world, "bf16": ds.optim_files[0].name.startswith("bf16_"),
                         "parameter_alignment": any(any(g) for g in ds.osd_meta.get("param_alignment_paddings") or []),
                         "lr_scheduler": {k: v for k, v in sched.items() if isinstance(v, (int, float, str))},
                         "param_groups": _jsonable(ds.param_groups)}}
    return app, scaler


def loss_scaler_state(osd_meta: dict, global_steps: int) -> dict[str, float]:
    """DeepSpeed's (static or dynamic) loss scaler as our LossScaler's state."""
    ls = osd_meta.get("loss_scaler")
    attrs = ls.as_dict() if hasattr(ls, "as_dict") else dict(ls or {})
    return {"scale": float(attrs.get("cur_scale", 1.0)), "cur_hysteresis": int(attrs.get("cur_hysteresis", 2)),
            "iteration": int(attrs.get("cur_iter", global_steps)),
            "last_overflow": int(attrs.get("last_overflow_iter", -1)), "num_overflows": 0}


def client_state(ms: dict, model_file: Path) -> dict[str, Any]:
    """The script's ``client_state`` (the keys DeepSpeed did not write), as JSON: a 0-d tensor becomes its
    number; a value JSON cannot hold (a tensor, an object) is dropped with a warning naming its key."""
    out = {}
    for key, value in ms.items():
        if key in DS_OWN_KEYS or not isinstance(key, str):
            continue
        value = value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 else value
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            print(f"warning: {model_file}: client_state[{key!r}] ({type(value).__name__}) is not JSON: not "
                  f"imported (our checkpoints hold client_state as JSON)", file=sys.stderr)
            continue
        out[key] = value
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
