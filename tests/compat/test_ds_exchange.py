"""Issue 34 item 4: checkpoint exchange with DeepSpeed on ordinary scripts.

DeepSpeed -> ours: a real DeepSpeed 0.19.8 checkpoint (tests/compat/fixtures/ds_tied_zero2, made by
bench/record_ds_tied_client_state.py: a tied-embedding tiny Llama, ZeRO-2, world 2, saved with a
``client_state``) imported with from_deepspeed and resumed by deepshard.compat.deepspeed at world 2:
``load_checkpoint`` hands back the script's client_state, the embedding stays tied, and the next 3
losses equal DeepSpeed's own continuation (recorded in the fixture).

Ours -> DeepSpeed, DeepSpeed-free: a real DeepSpeed bf16 ZeRO-2 checkpoint of a script that passed
``model.parameters()`` (one group; fixtures/ds_bf16_onegroup_zero2, same recorder) imported and
exported again gives back DeepSpeed's own optimizer files: the ``bf16_zero_pp_rank_*`` names, one
parameter group with DeepSpeed's hyper-parameters, every flat partition bit-identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepshard.compat.deepspeed.ds_export import export_checkpoint
from deepshard.compat.deepspeed.ds_files import load_ds_file
from deepshard.compat.deepspeed.ds_import import import_checkpoint
from tests.compat.ds_exchange_harness import resume_tied_worker
from tests.gloo_pool import pool

TIED = Path(__file__).parent / "fixtures" / "ds_tied_zero2"
BF16 = Path(__file__).parent / "fixtures" / "ds_bf16_onegroup_zero2" / "checkpoint" / "global_step3"


@pytest.mark.slow
@pytest.mark.parametrize("ds_stage", [2, 3])
def test_deepspeed_tied_checkpoint_with_client_state_resumes(tmp_path, ds_stage):
    """Saved by DeepSpeed at its ZeRO ``ds_stage`` (fixtures/ds_tied_zero2, ds_tied_zero3), resumed by ours at
    ZeRO 2 and 3."""
    tied = TIED.parent / f"ds_tied_zero{ds_stage}"
    record = json.loads((tied / "continuation.json").read_text())
    imported = import_checkpoint(tied / "checkpoint", tmp_path / "imported")
    for out in pool(2).run(resume_tied_worker, str(imported), [2, 3]):
        for stage, got in out.items():  # at our ZeRO-2 and ZeRO-3 (the tied weight sharded once, FSDP2)
            assert got["client_state"] == record["client_state"], stage
            assert got["tied"] and got["same_after"], stage
            assert got["losses"] == pytest.approx(record["losses_after_resume"], abs=1e-5), stage


def test_export_one_group_bf16_gives_deepspeeds_files(tmp_path):
    imported = import_checkpoint(BF16.parent, tmp_path / "imported")
    out = export_checkpoint(imported, tmp_path / "exported", stage=2)
    theirs = sorted(f.name for f in BF16.glob("*optim_states.pt"))
    assert theirs == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert sorted(f.name for f in out.glob("*optim_states.pt")) == theirs
    for name in theirs:
        ds = load_ds_file(BF16 / name)["optimizer_state_dict"]
        ours = load_ds_file(out / name)["optimizer_state_dict"]
        assert ours["base_optimizer_state"]["param_groups"] == ds["base_optimizer_state"]["param_groups"]
        assert len(ours["single_partition_of_fp32_groups"]) == 1
        assert torch.equal(ours["single_partition_of_fp32_groups"][0], ds["single_partition_of_fp32_groups"][0])
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours["base_optimizer_state"]["state"][0][kind], ds["base_optimizer_state"]["state"][0][kind])
        for key in ("group_paddings", "partition_count", "param_alignment_paddings"):
            assert ours[key] == ds[key], key


@pytest.mark.slow
def test_per_group_weight_decay_through_optimizer_is_honoured():
    """``initialize(optimizer=AdamW(groups with their own weight_decay))`` at ZeRO 2 and 3 equals torch's
    AdamW over the same groups (each rank's mean loss averaged), 3 steps."""
    import torch.nn.functional as F  # noqa: N812

    from tests.compat.ds_exchange_harness import decay_groups, group_decay_worker
    from tests.compat.ds_zero3_patterns_harness import TinyLM, batch

    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(decay_groups(model), lr=5e-2, betas=(0.9, 0.95))
    for step in range(3):
        opt.zero_grad()
        losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in (batch(step, r) for r in (0, 1))]
        (sum(losses) / 2).backward()
        opt.step()
    for out in pool(2).run(group_decay_worker, [2, 3], 3):
        for stage, got in out.items():
            for name, p in model.named_parameters():
                torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6,
                                           msg=lambda m, s=stage, n=name: f"ZeRO-{s} {n}: {m}")


@pytest.mark.slow
def test_a_tag_that_differs_per_rank_warns_and_saves_under_rank_0s(tmp_path):
    from tests.compat.ds_exchange_harness import per_rank_tag_worker

    outs = pool(2).run(per_rank_tag_worker, str(tmp_path))
    tags = [o["tag"] for o in outs]
    assert tags[0] != tags[1]  # the ranks' losses differ: the case exists
    for out in outs:  # DeepSpeed's default tag_validation (Warn) warns on every rank
        assert len(out["warnings"]) == 1 and f"saved under rank 0's tag {tags[0]!r}" in out["warnings"][0]
    assert (tmp_path / "latest").read_text() == tags[0]
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [tags[0]]
    assert list((tmp_path / tags[0]).glob("step-*/manifest.json"))


@pytest.mark.slow
def test_deepspeed_resumes_our_tied_one_group_checkpoint_with_client_state(tmp_path):
    """Ours -> DeepSpeed (skipped without DeepSpeed): DeepSpeed 0.19.8 resumes our export of a tied-embedding
    one-group ZeRO-2 run, hands back its client_state and continues with our losses."""
    pytest.importorskip("deepspeed")
    from tests.compat.ds_exchange_harness import CLIENT_STATE, ours_to_deepspeed_worker

    for out in pool(2).run(ours_to_deepspeed_worker, str(tmp_path), 2):
        assert out["client_state"] == CLIENT_STATE
        assert out["ds"] == pytest.approx(out["ours"], abs=1e-5)


def test_import_reads_zeros_parameter_alignment_layout(tmp_path):
    """DeepSpeed -> ours with ``zero_optimization.parameter_alignment`` (fixtures/ds_aligned_zero2: bf16, odd
    parameter sizes, so parameters are padded inside the flat groups and the last rank's partition is shorter):
    every imported fp32 master rounds to the bf16 weight DeepSpeed saved in its module state."""
    import torch.distributed.checkpoint as dcp

    aligned = Path(__file__).parent / "fixtures" / "ds_aligned_zero2" / "checkpoint"
    module = load_ds_file(aligned / "global_step3" / "mp_rank_00_model_states.pt")["module"]
    imported = import_checkpoint(aligned, tmp_path / "imported")
    masters = {f"model.{n}": torch.zeros(t.shape) for n, t in module.items()}
    dcp.load(masters, checkpoint_id=str(imported), no_dist=True)
    for name, t in module.items():
        assert torch.equal(masters[f"model.{name}"].to(torch.bfloat16), t), name


def test_export_writes_zeros_parameter_alignment_layout(tmp_path):
    """Ours -> DeepSpeed with ``zero_optimization.parameter_alignment`` (fixtures/ds_aligned_zero2: bf16, odd
    parameter sizes, two groups): DeepSpeed's own checkpoint imported and exported again gives back its optimizer
    files: each parameter padded to 16 bytes inside the flat groups, the last rank's masters stopping at their
    data (``group_paddings``), the same ``param_alignment_paddings`` (which DeepSpeed's load compares with its
    own layout), every flat partition bit-identical."""
    aligned = Path(__file__).parent / "fixtures" / "ds_aligned_zero2" / "checkpoint"
    imported = import_checkpoint(aligned, tmp_path / "imported")
    out = export_checkpoint(imported, tmp_path / "exported", stage=2)
    theirs = sorted(f.name for f in (aligned / "global_step3").glob("*optim_states.pt"))
    assert sorted(f.name for f in out.glob("*optim_states.pt")) == theirs and len(theirs) == 2
    for name in theirs:
        ds = load_ds_file(aligned / "global_step3" / name)["optimizer_state_dict"]
        ours = load_ds_file(out / name)["optimizer_state_dict"]
        for key in ("param_alignment_paddings", "group_paddings", "partition_count", "zero_stage"):
            assert ours[key] == ds[key], (name, key, ours[key], ds[key])
        assert ours["base_optimizer_state"]["param_groups"] == ds["base_optimizer_state"]["param_groups"]
        assert len(ours["single_partition_of_fp32_groups"]) == len(ds["single_partition_of_fp32_groups"]) == 2
        for g, t in enumerate(ds["single_partition_of_fp32_groups"]):
            assert torch.equal(ours["single_partition_of_fp32_groups"][g], t), (name, g)
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ours["base_optimizer_state"]["state"][g][kind],
                                   ds["base_optimizer_state"]["state"][g][kind]), (name, g, kind)
    # without the alignment (a run that does not set it) the layout is DeepSpeed's default: no padding
    plain = export_checkpoint(imported, tmp_path / "plain", stage=2, parameter_alignment=False)
    osd = load_ds_file(plain / theirs[0])["optimizer_state_dict"]
    assert osd["param_alignment_paddings"] == [[0, 0, 0, 0], [0, 0, 0, 0, 0]]


@pytest.mark.slow
def test_deepspeed_resumes_our_parameter_aligned_export(tmp_path):
    """Ours -> DeepSpeed with ``zero_optimization.parameter_alignment`` (skipped without DeepSpeed): DeepSpeed
    0.19.8 loads our ``--parameter-alignment`` export of a two-group run with odd parameter sizes (fp32: 4
    elements to 16 bytes; it refuses a layout that differs from its own) and continues with our losses."""
    pytest.importorskip("deepspeed")
    from tests.compat.ds_exchange_harness import aligned_to_deepspeed_worker

    for out in pool(2).run(aligned_to_deepspeed_worker, str(tmp_path)):
        assert any(any(g) for g in out["paddings"])  # the case exists: parameters padded inside the groups
        assert out["ds"] == pytest.approx(out["ours"], abs=1e-5)
