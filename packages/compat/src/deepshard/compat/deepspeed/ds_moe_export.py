"""One of our checkpoints of a ``deepspeed.moe`` model (experts as each ep rank's local experts, one
canonical tensor per local expert: ``ds_moe_import``'s layout, which ``deepspeed.initialize`` saves at
``ep_size > 1``) as the files DeepSpeed 0.19.8's ``_save_moe_checkpoint`` writes without ZeRO partitions
(``zero_optimization.stage`` 0), so that DeepSpeed's ``load_checkpoint`` resumes it at the same ``ep_size``:

- ``mp_rank_00_model_states.pt``: the module without its experts, the counters, ``lr_scheduler``,
  ``num_experts`` per MoE layer, and (as DeepSpeed keeps it) expert-parallel rank 0's optimizer state;
- ``layer_<L>_expert_<E>_mp_rank_00_model_states.pt``: MoE layer L's global expert E (``r * local + i``
  for ep rank r's local expert i), named ``<layer>.deepspeed_moe.experts.deepspeed_experts.<E>.<rest>``;
- ``expp_rank_<R>_mp_rank_00_optim_states.pt``: ``{"optimizer": ...}``, a FusedAdam state dict of ep rank
  R's parameters: the dense groups, then one ``moe`` group per dense group (``split_params_into_different_
  moe_groups_for_optimizer``'s order) holding R's experts layer by layer.  FusedAdam counts steps in the
  last parameter of each group only (its ``state`` variable is the loop's last), so that one holds the
  step count and the others 0, as DeepSpeed's own files have them.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from deepshard.core.checkpoint import (
    TensorInfo,
    load_full_tensor,
    read_manifest,
    read_trainer,
    tensor_infos,
    write_text,
)

from .ds_export import DS_VERSION, _find, client_state, default_num_groups, ds_group, groups
from .ds_moe_import import EXPERTS

__all__ = ["export_moe_checkpoint", "is_moe_export"]


def is_moe_export(ckpt: str | Path) -> bool:
    """Whether our checkpoint holds ``deepspeed.moe`` experts (names with ``deepspeed_experts``)."""
    return any(EXPERTS in i.key for i in tensor_infos(_find(Path(ckpt)), "model."))


def _ep_size(app: dict, given: int | None) -> int:
    saved = app.get("deepspeed", {}).get("ep_size") or app.get("ep_size")
    ep = given or saved
    if not ep:
        raise ValueError("--ep-size: the checkpoint records no ep_size (saved before it was recorded); give the "
                         "ep_size of its MoE layers (the experts' canonical rows are ep_size ranks' local experts)")
    if saved and given and int(given) != int(saved):
        raise ValueError(f"--ep-size {given}: the checkpoint was saved at ep_size={saved}; its expert rows are "
                         f"{saved} ranks' local experts (export at --ep-size {saved})")
    return int(ep)


def export_moe_checkpoint(ckpt: str | Path, out_dir: str | Path, *, ep_size: int | None = None, tag: str | None = None,
                          num_groups: int | None = None) -> Path:
    """``out_dir/TAG/`` and ``out_dir/latest`` (``num_groups``: the resuming script's parameter groups
    before the MoE split, 1 or 2, as ``ds_export``)."""
    path = _find(Path(ckpt))
    manifest, trainer = read_manifest(path), read_trainer(path)
    app = trainer["app"] if isinstance(trainer["app"], dict) else {}
    ep = _ep_size(app, ep_size)
    steps = int(trainer["num_updates"])
    counters = app.get("counters", {})
    tag = tag or f"global_step{counters.get('global_steps', steps)}"
    infos = _module_order(list(tensor_infos(path, "model.")), app)
    moments = {j.key[len("optim.exp_avg."):] for j in tensor_infos(path, "optim.exp_avg.")}
    heads = list(OrderedDict.fromkeys(i.key[6:].partition(EXPERTS)[0] for i in infos if EXPERTS in i.key))
    local = {h: 1 + max(int(i.key[6:].partition(EXPERTS)[2].split(".", 1)[0]) for i in infos
                        if i.key[6:].startswith(h + EXPERTS)) for h in heads}
    for i in infos:
        if EXPERTS in i.key and i.shape[0] % ep:
            raise ValueError(f"--ep-size {ep}: {i.key[6:]} has {i.shape[0]} rows, not ep_size ranks' equal parts")
    world = int(manifest["world"].get("dp_size") or manifest["world"]["world_size"] or ep)
    out = Path(out_dir) / tag
    out.mkdir(parents=True, exist_ok=False)

    def rows(prefix: str, info: TensorInfo, rank: int) -> torch.Tensor:  # ep rank ``rank``'s part of an expert
        t = load_full_tensor(path, TensorInfo(prefix + info.key[6:], info.shape, torch.float32))
        return t.chunk(ep)[rank].clone()

    def global_name(name: str, rank: int) -> str:
        head, _, tail = name.partition(EXPERTS)
        expert, rest = tail.split(".", 1)
        return f"{head}{EXPERTS}{rank * local[head] + int(expert)}.{rest}"

    for layer, head in enumerate(heads):  # DeepSpeed's moe_layer_id: MoE modules in module order
        mine = [i for i in infos if i.key[6:].startswith(head + EXPERTS)]
        for rank in range(ep):
            for e in range(local[head]):
                sd = {global_name(i.key[6:], rank): rows("model.", i, rank) for i in mine
                      if i.key[6:].startswith(f"{head}{EXPERTS}{e}.")}
                torch.save(sd, out / f"layer_{layer}_expert_{rank * local[head] + e}_mp_rank_00_model_states.pt")
    trained = [i for i in infos if i.key[6:] in moments]
    dense = [i for i in trained if EXPERTS not in i.key]
    dense_groups = [g for g in groups(dense, num_groups or default_num_groups(trainer)) if g]
    num = len(dense_groups)
    experts = [i for i in trained if EXPERTS in i.key]
    moe_groups = [[i for i in experts if len(i.shape) >= 2], [i for i in experts if len(i.shape) < 2]] if num == 2 \
        else [experts]
    optimizer = {rank: _optim_state(path, trainer, dense_groups, moe_groups, rank=rank, ep=ep, steps=steps, rows=rows)
                 for rank in range(ep)}
    for rank, osd in optimizer.items():
        torch.save({"optimizer": osd}, out / f"expp_rank_{rank}_mp_rank_00_optim_states.pt")
    module = OrderedDict((i.key[6:], load_full_tensor(path, TensorInfo(i.key, i.shape, torch.float32)))
                         for i in infos if EXPERTS not in i.key)
    sched = app.get("deepspeed", {}).get("lr_scheduler") or {"last_batch_iteration": steps - 1}
    state = {"module": module, "buffer_names": [], "optimizer": optimizer[0], "param_shapes": None,
             "frozen_param_shapes": None, "shared_params": None, "frozen_param_fragments": None,
             "lr_scheduler": dict(sched), "data_sampler": None, "random_ltd": None,
             "skipped_steps": int(counters.get("skipped_steps", 0)), "global_steps": int(counters.get("global_steps", steps)),
             "global_samples": int(counters.get("global_samples", 0)), "dp_world_size": world, "mp_world_size": 1,
             "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}, "ds_config": {},
             "ds_version": DS_VERSION, "num_experts": [local[h] * ep for h in heads], "ds_autoep_layers": None,
             **client_state(trainer)}
    torch.save(state, out / "mp_rank_00_model_states.pt")
    write_text(Path(out_dir) / "latest", tag)
    return out


def _module_order(infos: list[TensorInfo], app: dict) -> list[TensorInfo]:
    """``infos`` in the module's order where the save recorded it (a DCP checkpoint lists tensors in its own
    order); an imported checkpoint was written in DeepSpeed's order already."""
    order = {name: i for i, name in enumerate(app.get("state_dict_order") or [])}
    if not order:
        return infos
    return sorted(infos, key=lambda i: order.get(i.key[6:], len(order)))


def _optim_state(path: Path, trainer: dict, dense_groups: list[list[TensorInfo]], moe_groups: list[list[TensorInfo]],
                 *, rank: int, ep: int, steps: int, rows: Any) -> dict[str, Any]:
    """Ep rank ``rank``'s FusedAdam state dict: the dense groups' params, then its experts' (``moe`` groups)."""
    state: dict[int, dict[str, Any]] = {}
    param_groups, index = [], 0
    for gi, group in enumerate([*dense_groups, *moe_groups]):
        moe = gi >= len(dense_groups)
        base = gi - len(dense_groups) if moe else gi
        decay = base == 0 or len(dense_groups) == 1
        hyper = ds_group(trainer, base, decay=decay)
        saved = (trainer["app"].get("deepspeed", {}).get("param_groups") or [{}] * (base + 1))[base] \
            if isinstance(trainer["app"], dict) else {}
        params = list(range(index, index + len(group)))
        head = {"name": f"ep_size_{ep}", "moe": True} if moe else {"name": saved.get("name", "parameters")}
        param_groups.append({**head, **{k: v for k, v in hyper.items() if k != "params"}, "params": params})
        for j, info in zip(params, group, strict=True):
            if moe:
                avg, sq = rows("optim.exp_avg.", info, rank), rows("optim.exp_avg_sq.", info, rank)
            else:
                avg = load_full_tensor(path, TensorInfo("optim.exp_avg." + info.key[6:], info.shape, torch.float32))
                sq = load_full_tensor(path, TensorInfo("optim.exp_avg_sq." + info.key[6:], info.shape, torch.float32))
            state[j] = {"step": steps if j == params[-1] else 0, "exp_avg": avg, "exp_avg_sq": sq}
        index += len(group)
    return {"state": state, "param_groups": param_groups}
