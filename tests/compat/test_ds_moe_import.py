"""DeepSpeed 0.19.8's MoE checkpoint (fixtures/ds_moe_ckpt: real DeepSpeed, bench/record_ds_moe.py, the CIFAR-10
MoE script at world 4, ep_size 2, layers of 2 and 4 experts, stage 0) imported as ours, in one process.

The expected values are read here from DeepSpeed's files with torch's own ``weights_only`` loader,
by DeepSpeed's file names (``layer_<L>_expert_<E>``: global expert E; ``expp_rank_<R>``: rank R's
optimizer, dense groups then the ``moe`` group), not through the importer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from deepshard.compat.deepspeed.ds_import import import_checkpoint

CKPT = Path(__file__).parent / "fixtures" / "ds_moe_ckpt"
TAG = CKPT / "global_step4"
HEAD = "moe_layer_list.1.deepspeed_moe.experts.deepspeed_experts."


def _load(name: str) -> dict:
    return torch.load(TAG / name, weights_only=True, map_location="cpu")


def test_deepspeed_moe_checkpoint_imports_as_local_experts_at_its_ep_size(tmp_path):
    out = import_checkpoint(CKPT, tmp_path / "out")
    assert out.name == "step-00000004"
    # layer 1 has 4 experts over ep 2: our local expert 1 holds global experts 1 (ep rank 0) and 3 (ep rank 1)
    e1, e3 = _load("layer_1_expert_1_mp_rank_00_model_states.pt"), _load("layer_1_expert_3_mp_rank_00_model_states.pt")
    want = torch.cat([e1[HEAD + "1.weight"], e3[HEAD + "3.weight"]])
    # rank 1's optimizer: 12 dense params (ids 0-11), then its experts: layer 0's expert 1 (2 params), layer 1's
    # experts 2 and 3 (ids 14-17: 2.weight, 2.bias, 3.weight, 3.bias)
    osd = _load("expp_rank_1_mp_rank_00_optim_states.pt")["optimizer"]
    assert osd["param_groups"][1]["moe"] and osd["param_groups"][1]["params"] == [12, 13, 14, 15, 16, 17]
    osd0 = _load("expp_rank_0_mp_rank_00_optim_states.pt")["optimizer"]
    want_avg = torch.cat([osd0["state"][16]["exp_avg"], osd["state"][16]["exp_avg"]])
    dense = _load("mp_rank_00_model_states.pt")["module"]
    got = {"model." + HEAD + "1.weight": torch.zeros(168, 84), "optim.exp_avg." + HEAD + "1.weight": torch.zeros(168, 84),
           "model.fc4.weight": torch.zeros(10, 84), "optim.exp_avg_sq.fc4.weight": torch.zeros(10, 84)}
    dcp.load(got, checkpoint_id=str(out), no_dist=True)
    assert torch.equal(got["model." + HEAD + "1.weight"], want)
    assert torch.equal(got["optim.exp_avg." + HEAD + "1.weight"], want_avg)
    assert torch.equal(got["model.fc4.weight"], dense["fc4.weight"])
    assert torch.equal(got["optim.exp_avg_sq.fc4.weight"], osd0["state"][10]["exp_avg_sq"])


def test_zero_partitioned_moe_checkpoint_is_refused(tmp_path):
    import shutil

    tag = tmp_path / "global_step4"
    shutil.copytree(TAG, tag)
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="MoE checkpoint with ZeRO partitions"):
        import_checkpoint(tag, tmp_path / "out")
