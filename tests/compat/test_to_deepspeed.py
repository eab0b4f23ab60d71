"""Exporter, DeepSpeed-free: a real DeepSpeed 0.19.8 ZeRO-3 checkpoint (tests/compat/fixtures/ds_zero3),
imported and exported again at ZeRO-3, gives back DeepSpeed's own files: the same entries, every
partition tensor bit-identical, the same LR-scheduler position and counters.  Sub-groups follow
DeepSpeed's rule (stage3.py ``_create_fp16_sub_groups``).  (DeepSpeed resuming the exports and
continuing with our losses: tests/compat/test_from_deepspeed.py, where DeepSpeed is installed.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from deepshard.compat.deepspeed.ds_export import export_checkpoint
from deepshard.compat.deepspeed.ds_files import LossScaler, load_ds_file
from deepshard.compat.deepspeed.ds_import import import_checkpoint
from deepshard.finetune.tools.to_deepspeed import main

FIXTURE = Path(__file__).parent / "fixtures" / "ds_zero3" / "checkpoint"
TAG = "global_step3"


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    return import_checkpoint(FIXTURE, tmp_path_factory.mktemp("imported") / "ours")


def _same(ours, theirs, where: str) -> None:
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype, where
        assert torch.equal(ours.float(), theirs.float()), where
    elif isinstance(theirs, dict):
        assert sorted(map(str, ours)) == sorted(map(str, theirs)), where
        for k in theirs:
            _same(ours[k], theirs[k], f"{where}.{k}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(theirs, LossScaler):
        assert isinstance(ours, LossScaler) and ours.as_dict() == theirs.as_dict(), where
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def test_zero3_round_trip_gives_deepspeeds_own_partitions(imported, tmp_path):
    out = export_checkpoint(imported, tmp_path / "ds", stage=3)
    assert (tmp_path / "ds" / "latest").read_text() == TAG and out.name == TAG
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (FIXTURE / TAG).iterdir()
                                                           if p.suffix == ".pt")
    for rank in range(2):
        name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        ours, theirs = load_ds_file(out / name)["optimizer_state_dict"], \
            load_ds_file(FIXTURE / TAG / name)["optimizer_state_dict"]
        skip = {"ds_config"}  # the user's own config is DeepSpeed's business at resume
        _same({k: v for k, v in ours.items() if k not in skip}, {k: v for k, v in theirs.items() if k not in skip},
              name)
        name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        ours, theirs = load_ds_file(out / name), load_ds_file(FIXTURE / TAG / name)
        for key in ("param_shapes", "lr_scheduler", "global_steps", "global_samples", "skipped_steps",
                    "dp_world_size", "buffer_names", "frozen_param_shapes"):
            _same(ours[key], theirs[key], f"{name}:{key}")
        assert {k: tuple(v.shape) for k, v in ours["module"].items()} == \
            {k: tuple(v.shape) for k, v in theirs["module"].items()}


def _expected_sub_groups(numels: list[int], world: int, size: int) -> list[int]:
    """DeepSpeed's rule, written out: close a sub-group once its partitions reach ``size`` elements."""
    parts = [math.ceil(n / world) for n in numels]
    if size >= sum(parts):
        return [len(numels)]
    out, count, acc = [], 0, 0
    for i, p in enumerate(parts):
        count, acc = count + 1, acc + p
        if acc >= size or i == len(parts) - 1:
            out.append(count)
            count, acc = 0, 0
    return out


@pytest.mark.parametrize("world,size", [(3, 300), (1, 10**9), (2, 1)])
def test_zero3_sub_groups_and_uneven_pieces_re_import_exactly(imported, tmp_path, world, size):
    out = export_checkpoint(imported, tmp_path / "ds", stage=3, world=world, sub_group_size=size)
    osd = load_ds_file(out / "zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    shapes = load_ds_file(out / "zero_pp_rank_0_mp_rank_00_model_states.pt")["param_shapes"]
    counts = [c for g in shapes for c in _expected_sub_groups([math.prod(s) for s in g.values()], world, size)]
    assert len(osd["fp32_flat_groups"]) == len(counts) == len(osd["optimizer_state_dict"]["state"])
    assert [len(g["params"]) for g in osd["optimizer_state_dict"]["param_groups"]] == \
        [len(_expected_sub_groups([math.prod(s) for s in g.values()], world, size)) for g in shapes]
    again = import_checkpoint(tmp_path / "ds", tmp_path / "again")  # our importer reads DeepSpeed's layout
    import torch.distributed.checkpoint as dcp

    from deepshard.core.checkpoint.consolidate import load_full_tensor, tensor_infos

    infos = [i for prefix in ("model.", "optim.exp_avg.", "optim.exp_avg_sq.") for i in tensor_infos(imported, prefix)]
    got = {i.key: torch.zeros(i.shape) for i in infos}
    dcp.load(got, checkpoint_id=str(again), no_dist=True)
    for i in infos:
        assert torch.equal(got[i.key], load_full_tensor(imported, i)), i.key


def test_bad_stage_is_one_line(imported, tmp_path, capsys):
    assert main([str(imported), str(tmp_path / "x"), "--stage", "4"]) == 2
    assert capsys.readouterr().err.strip() == "error: --stage 4: the exporter writes ZeRO-1, -2 or -3 checkpoints " \
                                              "(valid: 1, 2, 3)"



def _zero0_save(save_dir: str) -> list[str]:
    """On a pool rank: one step of a DeepSpeed-API script at ZeRO-0, saved; the module's parameter order."""
    import deepshard.compat.deepspeed as deepspeed
    from tests.compat.compat_harness import batches, tiny_llama, tokenizer

    deepspeed.init_distributed()
    model = tiny_llama(len(tokenizer()))
    ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    inputs = next(iter(batches(engine.global_rank, engine.world_size, 2, 1, engine.device)))
    engine.backward(engine(**inputs).loss)
    engine.step()
    engine.save_checkpoint(save_dir)
    return [n for n, _ in model.named_parameters()]


def test_a_world_2_zero0_save_exports_in_the_modules_order(tmp_path, gloo_pool):
    """ZeRO-0 replicates every tensor: DCP's save lets one rank write each and lists them plan by plan.
    The export lays DeepSpeed's flat partitions out in the checkpoint's order, so that order must be the
    module's (load-balanced plans listed ``layers.1`` before ``layers.0``); the partitions' values are
    checked against torch's own DCP-to-torch.save conversion."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from deepshard.core.checkpoint import tensor_infos

    order = gloo_pool(2).run(_zero0_save, str(tmp_path / "ck"))[0]
    (ckpt,) = (tmp_path / "ck").glob("*/step-*")
    assert [i.key[6:] for i in tensor_infos(ckpt, "model.")][:len(order)] == order

    out = export_checkpoint(ckpt, tmp_path / "ds", stage=2)
    module = load_ds_file(out / "mp_rank_00_model_states.pt")["module"]
    assert list(module)[:len(order)] == order
    dcp_to_torch_save(ckpt, tmp_path / "torch.pt")
    saved = torch.load(tmp_path / "torch.pt", weights_only=True)
    matrices = torch.cat([saved[f"model.{n}"].reshape(-1) for n in order if saved[f"model.{n}"].dim() >= 2])
    parts = [load_ds_file(out / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
             ["single_partition_of_fp32_groups"][0] for r in (0, 1)]
    assert torch.equal(torch.cat(parts)[:matrices.numel()], matrices)
