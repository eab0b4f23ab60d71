"""Our checkpoint of a ``deepspeed.moe`` model out as DeepSpeed 0.19.8's expert files (``ds_moe_export``), in one
process: real DeepSpeed's MoE checkpoint (fixtures/ds_moe_ckpt, bench/record_ds_moe.py: ep_size 2, layers of 2
and 4 experts) imported and exported again gives DeepSpeed's own files back, tensor for tensor (names, expert
ids, optimizer groups and ids, FusedAdam's step counts), read here with torch's ``weights_only`` loader; and the
export imports again to the same checkpoint.  That real DeepSpeed resumes an export is recorded by
bench/record_ds_moe_export.py (``resumed_from_export`` in fixtures/ds_moe_cifar.json, checked at the end).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from deepshard.compat.deepspeed.ds_export import export_checkpoint
from deepshard.compat.deepspeed.ds_import import import_checkpoint

FIXTURES = Path(__file__).parent / "fixtures"
TAG = FIXTURES / "ds_moe_ckpt" / "global_step4"


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu")


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a.float(), b.float()), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, float):
        assert abs(a - b) < 1e-12, (where, a, b)
    else:
        assert a == b, (where, a, b)


def test_exported_moe_files_are_deepspeed_s_own(tmp_path):
    ours = import_checkpoint(TAG.parent, tmp_path / "ours")
    out = export_checkpoint(ours, tmp_path / "ds")
    assert out.name == "global_step4" and (tmp_path / "ds" / "latest").read_text().strip() == "global_step4"
    assert sorted(f.name for f in out.iterdir()) == sorted(f.name for f in TAG.iterdir())
    for f in TAG.glob("layer_*"):
        _same(_load(f), _load(out / f.name), f.name)  # global expert ids and names, values bit for bit
    for f in TAG.glob("expp_rank_*"):
        _same(_load(f)["optimizer"], _load(out / f.name)["optimizer"], f.name)
    want, got = _load(TAG / "mp_rank_00_model_states.pt"), _load(out / "mp_rank_00_model_states.pt")
    for key in ("module", "num_experts", "global_steps", "global_samples", "skipped_steps", "lr_scheduler",
                "dp_world_size", "mp_world_size", "buffer_names", "optimizer", "ds_version"):
        _same(want[key], got[key], key)
    # and back in: the same checkpoint as the first import
    again = import_checkpoint(tmp_path / "ds", tmp_path / "again")
    names = {"model.moe_layer_list.1.deepspeed_moe.experts.deepspeed_experts.1.weight": (168, 84),
             "optim.exp_avg_sq.moe_layer_list.0.deepspeed_moe.experts.deepspeed_experts.0.bias": (168,),
             "model.fc1.weight": (120, 400), "optim.exp_avg.fc4.bias": (10,)}
    for name, shape in names.items():
        a, b = {name: torch.zeros(shape)}, {name: torch.zeros(shape)}
        dcp.load(a, checkpoint_id=str(ours), no_dist=True)
        dcp.load(b, checkpoint_id=str(again), no_dist=True)
        assert torch.equal(a[name], b[name]) and a[name].abs().sum() > 0, name


def test_moe_export_refuses_zero_stages_and_a_wrong_ep_size(tmp_path):
    ours = import_checkpoint(TAG.parent, tmp_path / "ours")
    with pytest.raises(ValueError, match="--stage 2: a deepspeed.moe checkpoint"):
        export_checkpoint(ours, tmp_path / "a", stage=2)
    with pytest.raises(ValueError, match="--ep-size 4: the checkpoint was saved at ep_size=2"):
        export_checkpoint(ours, tmp_path / "b", ep_size=4)


def test_real_deepspeed_resumes_the_export_as_its_own_checkpoint():
    """Recorded: DeepSpeed 0.19.8 loading our export of its checkpoint trains the next epoch with the losses it
    has after loading its own (bench/record_ds_moe_export.py)."""
    ranks = json.loads((FIXTURES / "ds_moe_cifar.json").read_text())["losses"]["top2"]
    for rank in ranks:
        assert len(rank["resumed_from_export"]) == len(rank["resumed"]) > 0
        assert max(abs(a - b) for a, b in zip(rank["resumed_from_export"], rank["resumed"], strict=True)) < 1e-6
