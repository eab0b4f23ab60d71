"""A DeepSpeed MoE checkpoint (``deepspeed.moe.layer.MoE``, no ZeRO partitions) as an ordinary checkpoint of ours.

The layout DeepSpeed 0.19.8 writes (``DeepSpeedEngine._save_moe_checkpoint``, runtime/engine.py; file
names from ``_get_expert_ckpt_name`` and ``_get_optimizer_ckpt_name``), checked against a checkpoint
real DeepSpeed wrote (tests/compat/fixtures/ds_moe_ckpt):

- ``mp_rank_00_model_states.pt``: the module without its experts (gates and dense params), the
  counters, ``lr_scheduler``, ``num_experts`` (per MoE layer, in module order);
- ``layer_<L>_expert_<E>_mp_rank_00_model_states.pt``: MoE layer L's expert E (its *global* id), its
  parameters named ``<layer>.deepspeed_moe.experts.deepspeed_experts.<E>.<rest>``;
- ``expp_rank_<R>_mp_rank_00_optim_states.pt``: expert-parallel rank R's torch optimizer state dict
  (``{"optimizer": ...}``): the dense groups' params, then the ``moe`` groups' (rank R's local experts,
  layer by layer), numbered across groups in that order.

Ours at the same ``ep_size`` (the number of ``expp_rank`` files) names local expert ``i`` of each rank
and writes it as one canonical tensor: ep rank r's rows are its local expert i, i.e. global expert
``r * L + i`` with ``L = num_experts / ep`` (core's ``zero.split.ExpertLayout``), so the checkpoint
written here resumes ``deepspeed.initialize`` of the same model at that ``ep_size``.  Files are read
with the restricted unpickler (``ds_files.load_ds_file``: nothing in them runs).  ZeRO-partitioned MoE
checkpoints (``zero_pp_rank`` files beside expert files) are refused by name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from deepshard.core.checkpoint import write_offline_checkpoint

from .ds_files import load_ds_file

__all__ = ["import_moe_checkpoint", "is_moe_checkpoint", "read_moe_checkpoint"]

EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."
_EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt")
_OPTIM_FILE = re.compile(r"expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
KINDS = ("master", "exp_avg", "exp_avg_sq")


def is_moe_checkpoint(tag_dir: Path) -> bool:
    return any(_EXPERT_FILE.fullmatch(f.name) for f in tag_dir.iterdir())


def _numbered(tag_dir: Path, pattern: re.Pattern, what: str) -> dict[tuple[int, ...], Path]:
    out = {}
    for f in tag_dir.iterdir():
        m = pattern.fullmatch(f.name)
        if m is None:
            continue
        if m.groups()[-1] != "00":
            raise ValueError(f"{f}: model-parallel rank {m.groups()[-1]}: MoE checkpoints with tensor-parallel "
                             f"experts are not supported")
        out[tuple(int(g) for g in m.groups()[:-1])] = f
    if not out:
        raise ValueError(f"{tag_dir}: no {what} files")
    return out


def read_moe_checkpoint(tag_dir: str | Path) -> dict[str, Any]:
    """``{"state": {kind: {DeepSpeed name: full tensor}}, "ep": R, "num_experts": [...], "model_states": ...}``
    with experts under their global ids (``kind``: master, exp_avg, exp_avg_sq)."""
    tag_dir = Path(tag_dir)
    if list(tag_dir.glob("*zero_pp_rank_*")):
        raise ValueError(f"{tag_dir}: a DeepSpeed MoE checkpoint with ZeRO partitions (zero_pp_rank files): not "
                         f"imported yet; save it at zero_optimization.stage 0")
    ms = load_ds_file(tag_dir / "mp_rank_00_model_states.pt")
    buffers = set(ms.get("buffer_names") or [])
    dense = [n for n in ms["module"] if n not in buffers]
    experts: dict[str, torch.Tensor] = {}
    layers: dict[int, list[tuple[int, list[str]]]] = {}
    for (layer, expert), f in sorted(_numbered(tag_dir, _EXPERT_FILE, "layer_N_expert_M").items()):
        sd = load_ds_file(f)
        experts.update({n: t.detach().float() for n, t in sd.items()})
        layers.setdefault(layer, []).append((expert, list(sd)))
    optim = _numbered(tag_dir, _OPTIM_FILE, "expp_rank_R optim_states")
    ep = len(optim)
    if sorted(optim) != [(r,) for r in range(ep)]:
        raise ValueError(f"{tag_dir}: expp_rank files for ranks {sorted(r for r, in optim)}: some are missing")
    state: dict[str, dict[str, torch.Tensor]] = {k: {} for k in KINDS}
    state["master"] = {**{n: ms["module"][n].detach().float() for n in dense}, **experts}
    for (r,), f in sorted(optim.items()):
        osd = load_ds_file(f)["optimizer"]
        groups = [g for g in osd["param_groups"] if not g.get("moe")] + [g for g in osd["param_groups"] if g.get("moe")]
        ids = [i for g in groups for i in g["params"]]
        local = []  # rank r's experts, layer by layer, in their files' parameter order
        for layer in sorted(layers):
            per = len(layers[layer]) // ep
            for expert, names in sorted(layers[layer]):
                if r * per <= expert < (r + 1) * per:
                    local += names
        names = dense + local
        if len(ids) != len(names):
            raise ValueError(f"{f}: {len(ids)} parameters in its optimizer groups, the model has {len(names)} "
                             f"(dense, then this rank's experts): not the layout DeepSpeed writes")
        for i, name in zip(ids, names, strict=True):
            s = osd["state"].get(i, {})
            for kind in ("exp_avg", "exp_avg_sq"):
                t = s.get(kind)
                state[kind][name] = (torch.zeros_like(state["master"][name]) if t is None
                                     else t.detach().float().reshape(state["master"][name].shape))
    first = load_ds_file(optim[(0,)])["optimizer"]["param_groups"]  # the dense groups' hyper-parameters
    dense_groups = [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, str, list))}
                    for g in first if not g.get("moe")]
    return {"state": state, "ep": ep, "num_experts": list(ms.get("num_experts") or []), "model_states": ms,
            "layers": {layer: len(v) for layer, v in layers.items()}, "param_groups": dense_groups}


def local_layout(names: list[str], per_layer: dict[str, int], ep: int) -> dict[str, list[str]]:
    """Our expert name (local index i) -> the global DeepSpeed names its canonical rows hold, rank by rank."""
    out: dict[str, list[str]] = {}
    for name in names:
        head, _, tail = name.partition(EXPERTS)
        if not tail:
            continue
        expert, rest = tail.split(".", 1)
        local = per_layer[head] // ep
        if int(expert) < local:
            out[name] = [f"{head}{EXPERTS}{r * local + int(expert)}.{rest}" for r in range(ep)]
    return out


def import_moe_checkpoint(tag_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``out_dir/step-N`` (our layout at the checkpoint's ep_size) from DeepSpeed's MoE files."""
    tag_dir = Path(tag_dir)
    ck = read_moe_checkpoint(tag_dir)
    ep, ms, state = ck["ep"], ck["model_states"], ck["state"]
    per_layer: dict[str, int] = {}
    for name in state["master"]:
        head, _, tail = name.partition(EXPERTS)
        if tail:
            per_layer[head] = max(per_layer.get(head, 0), int(tail.split(".", 1)[0]) + 1)
    rows = local_layout(list(state["master"]), per_layer, ep)
    ours = {n: [n] for n in state["master"] if EXPERTS not in n} | rows
    prefixes = {"master": "model.", "exp_avg": "optim.exp_avg.", "exp_avg_sq": "optim.exp_avg_sq."}
    shapes: dict[str, torch.Tensor] = {}
    sources: dict[str, tuple[str, list[str]]] = {}
    for kind, prefix in prefixes.items():
        for name, parts in ours.items():
            first = state[kind][parts[0]]
            shape = (first.shape[0] * len(parts), *first.shape[1:]) if len(parts) > 1 else tuple(first.shape)
            shapes[prefix + name] = torch.empty(shape, dtype=torch.float32, device="meta")
            sources[prefix + name] = (kind, parts)

    def build(fqn: str) -> torch.Tensor:
        kind, parts = sources[fqn]
        return torch.cat([state[kind][p] for p in parts]) if len(parts) > 1 else state[kind][parts[0]].clone()

    step = int(ms.get("global_steps", 0))
    sched = dict(ms.get("lr_scheduler") or {})
    counters = {"global_steps": step, "global_samples": int(ms.get("global_samples", 0)),
                "skipped_steps": int(ms.get("skipped_steps", 0)), "micro_steps": 0}
    app = {"counters": counters, "client_state": {},
           "deepspeed": {"tag": tag_dir.name, "version": str(ms.get("ds_version", "?")), "zero_stage": 0,
                         "dp_world_size": int(ms.get("dp_world_size", ep)), "ep_size": ep,
                         "param_groups": ck["param_groups"],  # (ds_moe_export writes them back)
                         "lr_scheduler": {k: v for k, v in sched.items() if isinstance(v, (int, float, str))}}}
    scaler = {"scale": 1.0, "cur_hysteresis": 2, "iteration": step, "last_overflow": -1, "num_overflows": 0}
    note = (f"imported from DeepSpeed {app['deepspeed']['version']} MoE (ep {ep}, tag {tag_dir.name}): experts "
            f"as {ep} ranks' local experts; resumes at ep_size={ep}")
    return write_offline_checkpoint(out_dir, step, shapes, build, scaler=scaler, app_state=app, zero_stage=0,
                                    dp_size=int(ms.get("dp_world_size", ep)),
                                    meta={"source": f"deepspeed {app['deepspeed']['version']} {tag_dir}", "note": note})
