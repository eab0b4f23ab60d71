"""Importer: real DeepSpeed 0.19.8 checkpoints (ZeRO-1/2/3, world 2; tests/compat/fixtures, made by
bench/make_ds_checkpoints.py) become our checkpoints; resumed with deepshard.compat.deepspeed at
world 2 (same stage) and world 1 (ZeRO-0), the next 3 losses equal DeepSpeed's own continuation
from the same checkpoint (recorded in each fixture's continuation.json) to 1e-5 in fp32.  Peak RSS
of the importer stays under 1.5x the largest partition file, on a synthetic 2 x 48 MB checkpoint."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deepshard.compat.deepspeed.ds_import import import_checkpoint
from deepshard.launch.local import launch_local
from tests.app_runner import run_module
from tests.compat.import_harness import resume_worker

FIXTURES = Path(__file__).parent / "fixtures"
STAGES = (1, 2, 3)


def _continuation(stage: int) -> list[float]:
    return json.loads((FIXTURES / f"ds_zero{stage}" / "continuation.json").read_text())["losses_after_resume"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[int, str]:
    root = tmp_path_factory.mktemp("imported")
    return {s: str(import_checkpoint(FIXTURES / f"ds_zero{s}" / "checkpoint", root / f"zero{s}")) for s in STAGES}


def test_import_writes_masters_moments_step_and_scaler(imported):
    for stage, path in imported.items():
        trainer = json.loads((Path(path) / "trainer.json").read_text())
        assert trainer["num_updates"] == 3 and trainer["scaler"]["scale"] == 1.0
        assert trainer["app"]["deepspeed"]["zero_stage"] == stage
        assert trainer["app"]["deepspeed"]["lr_scheduler"] == {"last_batch_iteration": 2}
        assert trainer["app"]["counters"]["global_steps"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 1])
def test_resume_matches_deepspeeds_continuation(imported, world):
    stages = {s: s for s in STAGES} if world == 2 else {s: 0 for s in STAGES}
    outs = launch_local(resume_worker, world, imported, stages)
    for stage in STAGES:
        for out in outs:
            assert out[stage] == pytest.approx(_continuation(stage), abs=1e-5), f"ZeRO-{stage} at world {world}"


def test_refuses_what_is_not_on_the_allowlist(tmp_path):
    """A checkpoint that asks for any other global (here the builtin print) is refused by name; nothing runs."""
    tag = tmp_path / "global_step1"
    tag.mkdir()
    torch.save({"module": {}, "param_shapes": [], "hook": pickle.loads(pickle.dumps(print))},
               tag / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"zero_stage": 1}}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp_path / "latest").write_text("global_step1")
    with pytest.raises(ValueError, match=r"mp_rank_00_model_states.pt: not loaded \(unsupported global: GLOBAL "
                                         r"(builtins\.)?print, not on the allowlist\)"):
        import_checkpoint(tmp_path, tmp_path / "out")


def _synthetic_zero2(tag: Path, world: int, numels: list[int]) -> None:
    """DeepSpeed's ZeRO-2 file layout, written without DeepSpeed (one group, padded to the world size)."""
    total = sum(numels)
    part = -(-total // world)
    shapes = {f"layers.{i}.weight": torch.Size([n // 1024, 1024]) for i, n in enumerate(numels)}
    torch.save({"module": {}, "param_shapes": [shapes], "buffer_names": [], "global_steps": 5,
                "lr_scheduler": {"last_batch_iteration": 4}}, tag / "mp_rank_00_model_states.pt")
    for r in range(world):
        flat = torch.full((part,), float(r))
        torch.save({"optimizer_state_dict": {
            "zero_stage": 2, "loss_scaler": None, "partition_count": [world],
            "single_partition_of_fp32_groups": [flat],
            "base_optimizer_state": {"state": {0: {"step": 5, "exp_avg": flat + 10, "exp_avg_sq": flat + 20}},
                                     "param_groups": [{"lr": 1e-3, "params": [0]}]}}},
                   tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


PEAK = """
import json, resource, sys
from deepshard.compat.deepspeed.ds_import import import_checkpoint
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
import_checkpoint(sys.argv[1], sys.argv[2])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"before_kb": before, "after_kb": after}))
"""


@pytest.mark.slow
def test_peak_rss_within_one_and_a_half_partition_files(tmp_path):
    tag = tmp_path / "ds" / "global_step5"
    tag.mkdir(parents=True)
    _synthetic_zero2(tag, 2, [2**20] * 8)  # 8 matrices of 4 MB: 2 partitions of 16 MB x 3 kinds
    (tmp_path / "ds" / "latest").write_text("global_step5")
    largest = max(f.stat().st_size for f in tag.glob("*optim_states.pt"))
    res = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "ds"), str(tmp_path / "out")],
                         capture_output=True, text=True, check=True)
    m = json.loads(res.stdout.strip().splitlines()[-1])
    grew = (m["after_kb"] - m["before_kb"]) * 1024
    assert grew <= 1.5 * largest, f"peak RSS grew {grew / 1e6:.1f} MB, largest partition file {largest / 1e6:.1f} MB"
    out = next((tmp_path / "out").glob("step-*"))
    import torch.distributed.checkpoint as dcp

    t = {"model.layers.4.weight": torch.zeros(1024, 1024), "optim.exp_avg_sq.layers.3.weight": torch.zeros(1024, 1024)}
    dcp.load(t, checkpoint_id=str(out), no_dist=True)
    assert (t["model.layers.4.weight"] == 1.0).all()  # the second half of the flat vector is rank 1's
    assert (t["optim.exp_avg_sq.layers.3.weight"] == 20.0).all()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_resumes_our_checkpoints(imported, tmp_path, stage):
    """to_deepspeed: DeepSpeed resumes a checkpoint we wrote and continues with our losses; and an
    imported-then-exported fixture continues as DeepSpeed did from its own file (skipped without DeepSpeed)."""
    pytest.importorskip("deepspeed")
    from tests.compat.export_harness import export_worker

    outs = launch_local(export_worker, 2, str(tmp_path), imported[stage], stage)
    for out in outs:
        assert out["ds_from_ours"] == pytest.approx(out["ours"], abs=1e-5)
        assert out["ds_from_import"] == pytest.approx(_continuation(stage), abs=1e-5)


def test_any_world_size_parameters_spanning_rank_partitions(tmp_path):
    """ZeRO-2 at world 3: a parameter that starts in rank 1's partition and ends in rank 2's."""
    tag = tmp_path / "global_step5"
    tag.mkdir()
    _synthetic_zero2(tag, 3, [3 * 1024, 5 * 1024, 1024])  # flat 9216 = 3 x 3072
    out = import_checkpoint(tmp_path, tmp_path / "out", tag="global_step5")
    import torch.distributed.checkpoint as dcp

    t = {f"model.layers.{i}.weight": torch.zeros(n, 1024) for i, n in enumerate((3, 5, 1))}
    t["optim.exp_avg.layers.1.weight"] = torch.zeros(5, 1024)
    dcp.load(t, checkpoint_id=str(out), no_dist=True)
    assert (t["model.layers.0.weight"] == 0).all() and (t["model.layers.2.weight"] == 2).all()
    mid = t["model.layers.1.weight"].reshape(-1)
    assert (mid[:3072] == 1).all() and (mid[3072:] == 2).all()
    assert (t["optim.exp_avg.layers.1.weight"].reshape(-1)[3072:] == 12).all()
    assert json.loads((out / "trainer.json").read_text())["num_updates"] == 5


def test_zero3_uneven_partitions_at_world_3(tmp_path):
    """ZeRO-3 splits every parameter into ceil(numel / world) pieces, the last padded: reassembled exactly."""
    world, shapes = 3, {"a.weight": torch.Size([7, 5]), "b.weight": torch.Size([4]), "c.weight": torch.Size([2, 2])}
    full = {n: torch.arange(s.numel(), dtype=torch.float32).reshape(s) + 100 * i
            for i, (n, s) in enumerate(shapes.items())}
    tag = tmp_path / "global_step2"
    tag.mkdir()
    for r in range(world):
        pieces = []
        for t in full.values():
            part = -(-t.numel() // world)
            flat = torch.nn.functional.pad(t.reshape(-1), (0, part * world - t.numel()))
            pieces.append(flat[r * part:(r + 1) * part])
        flat = torch.cat(pieces)
        torch.save({"module": {}, "param_shapes": [shapes], "buffer_names": [], "global_steps": 2},
                   tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        torch.save({"optimizer_state_dict": {
            "zero_stage": 3, "partition_count": world, "fp32_flat_groups": [flat[:5], flat[5:]],  # two sub-groups
            "optimizer_state_dict": {"state": {0: {"step": 2, "exp_avg": flat[:5] * 2, "exp_avg_sq": flat[:5] * 3},
                                               1: {"step": 2, "exp_avg": flat[5:] * 2, "exp_avg_sq": flat[5:] * 3}},
                                     "param_groups": [{"lr": 1e-3, "params": [0]}]}}},
                   tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    out = import_checkpoint(tmp_path, tmp_path / "out", tag="global_step2")
    import torch.distributed.checkpoint as dcp

    got = {f"model.{n}": torch.zeros(s) for n, s in shapes.items()}
    got |= {f"optim.exp_avg_sq.{n}": torch.zeros(s) for n, s in shapes.items()}
    dcp.load(got, checkpoint_id=str(out), no_dist=True)
    for n, t in full.items():
        assert torch.equal(got[f"model.{n}"], t) and torch.equal(got[f"optim.exp_avg_sq.{n}"], t * 3)


class _CallsGetpid:
    def __reduce__(self):
        return (os.getpid, ())


def test_a_refusal_never_repeats_torchs_advice_to_load_unsafely(tmp_path):
    """torch's weights-only refusals advise ``weights_only=False``; the importer keeps only the reason."""
    tag = tmp_path / "global_step1"
    tag.mkdir()
    torch.save({"optimizer_state_dict": {"zero_stage": 1}}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp_path / "latest").write_text("global_step1")
    f = tag / "mp_rank_00_model_states.pt"
    for content, reason in ((_CallsGetpid(), r"unsupported global: GLOBAL posix\.getpid, not on the allowlist"),
                            (pickle.loads(pickle.dumps(print)), r"unsupported global: GLOBAL (builtins\.)?print,"),
                            (b"not a checkpoint", r"not a torch\.save zip archive")):
        if isinstance(content, bytes):
            f.write_bytes(content)
        else:
            torch.save({"module": {}, "x": content}, f)
        with pytest.raises(ValueError) as err:
            import_checkpoint(tmp_path, tmp_path / "out")
        line = str(err.value)
        assert "will likely succeed" not in line and "False" not in line and "\n" not in line, line
        assert line.startswith(f"{f}: not loaded (") and re.search(reason, line), line


def _hold(leftover: str, ready) -> None:
    """A live importer: writes the owner marker an importer writes into its .tmp-import as it starts, then
    waits (forked from this process, which has deepshard imported: a fresh interpreter costs ~4 s here)."""
    from deepshard.core.checkpoint.owners import write_owner

    write_owner(Path(leftover))
    ready.send("holding")
    time.sleep(300)


def _cli_import(src: Path, out: Path) -> subprocess.CompletedProcess:
    return run_module("deepshard.finetune.tools.from_deepspeed", [src, out], cwd=Path.cwd(), timeout=120)


@pytest.fixture
def leftover_and_holder(tmp_path):
    """``out/step-N.tmp-import`` (N: the fixture's step) with half a file, owned by a live process."""
    name = import_checkpoint(FIXTURES / "ds_zero2" / "checkpoint", tmp_path / "probe").name
    leftover = tmp_path / "out" / f"{name}.tmp-import"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"half")
    ctx = multiprocessing.get_context("fork")
    ready, child_end = ctx.Pipe()
    holder = ctx.Process(target=_hold, args=(str(leftover), child_end), daemon=True)
    holder.start()
    try:
        assert ready.poll(60) and ready.recv() == "holding"
        yield leftover, holder
    finally:
        holder.kill()
        holder.join()


def test_a_live_importers_partial_import_is_named_not_deleted(leftover_and_holder):
    """A second import into the OUT_DIR of one still running: one error line naming the directory and the
    live importer (its pid), exit 2, and the first import's files untouched (it used to delete them)."""
    leftover, holder = leftover_and_holder
    proc = _cli_import(FIXTURES / "ds_zero2" / "checkpoint", leftover.parent)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {leftover}: another import is writing it "), lines
    assert f"pid {holder.pid}" in lines[0] and "still running" in lines[0], lines[0]
    assert (leftover / "__0_0.distcp").read_bytes() == b"half"
    assert sorted(p.name for p in leftover.parent.iterdir()) == [leftover.name]


def test_a_dead_importers_partial_import_is_removed_naming_it(leftover_and_holder):
    """The same leftover once its importer is dead (killed: no chance to clean up): removed with a notice
    naming the dead pid, and the import lands whole."""
    leftover, holder = leftover_and_holder
    holder.kill()
    holder.join()
    proc = _cli_import(FIXTURES / "ds_zero2" / "checkpoint", leftover.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"notice: removing the partial import {leftover} (its importer, pid {holder.pid}, is not running)" \
        in proc.stderr, proc.stderr[-2000:]
    final = leftover.parent / leftover.name[:-len(".tmp-import")]
    assert sorted(p.name for p in leftover.parent.iterdir()) == [final.name]
    assert not (final / ".owner.json").exists()  # the marker is not part of the import


def test_a_link_where_the_import_writes_is_named_and_left_alone(tmp_path):
    """Issue 45: a dangling ``step-N.tmp-import`` link gave "another import keeps creating it"; it is named
    as what it is, never followed nor removed."""
    out = tmp_path / "out"
    out.mkdir()
    link = out / "step-00000003.tmp-import"  # the fixture's step
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(link))}: is a symlink, not an import's temp dir; "):
        import_checkpoint(FIXTURES / "ds_zero2" / "checkpoint", out)
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()
