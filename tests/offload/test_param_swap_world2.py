"""ZeRO-Infinity at world size 2 (real gloo ranks): with ``offload.params=nvme`` + ``offload.device=nvme``
the sharded params, their gradients and the Adam moments live in swap files, and training equals the
same ZeRO-3 run without offload (fp32: losses and parameters within 1e-6), also with gradient
accumulation and activation checkpointing, and with as many deferred-step buffers as units
(resident: every unit's state stays in them, gradients too, and a step reads nothing); gradient
clipping is on, so the global norm taken from the swapped gradients is checked too; a checkpoint
saved from the swap files resumes without offload and the reverse.  One launch runs every
configuration."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from deepshard.launch.local import launch_local  # noqa: E402
from tests.core.zero_harness import MICRO, batches, engine_config  # noqa: E402

STEPS = 5
# grad_accum, ac, reshard_after_forward, init through the swap's materializer (unit by unit to NVMe),
# offload.buffer_count (MICRO has 3 units: 3 buffers hold them all), offload.sub_group_size (the
# deferred update's pieces: 1024 elements cut each unit of MICRO, ~3-5k elements per rank, into 3-5)
PIECE = 1024
CASES = {"plain": (1, "none", True, False, 2, 2**24), "accum_ac": (2, "full", False, True, 2, 2**24),
         "resident_accum": (2, "full", True, True, 3, 2**24),
         "pieces_accum": (2, "full", True, True, 2, PIECE), "pieces_resident": (2, "none", True, True, 16, PIECE)}


def _engine(nvme_path: str | None, grad_accum: int = 1, ac: str = "none", reshard: bool = True,
            unit_init: bool = True, buffer_count: int = 2, sub_group_size: int = 2**24):
    import torch.distributed as dist

    from deepshard.core import initialize
    from deepshard.finetune.models.llama import Llama
    from deepshard.offload import OffloadConfig, make_store_factory, param_offload

    cfg = engine_config(3, grad_accum, 0.05, reshard_after_forward=reshard)
    cfg = dataclasses.replace(cfg, ac=ac)
    on = nvme_path is not None
    off = OffloadConfig(device="nvme" if on else "none", nvme_path=nvme_path, params="nvme" if on else "none",
                        buffer_count=buffer_count, param_buffer_count=3, param_prefetch=2,
                        sub_group_size=sub_group_size, buffer_size=sub_group_size)
    factory = make_store_factory(off, dist.get_rank(), "paramswap")
    swap = getattr(factory, "param_swap", None)
    with torch.device("meta"):
        model = Llama(MICRO)

    def init(m):
        m.init_weights(0)

    engine = initialize(model, cfg, store_factory=factory, offload_params=param_offload(off, factory),
                        materialize=swap.materializer(init) if swap is not None and unit_init else init)
    return engine, swap


def _steps(engine, steps, grad_accum: int = 1, after_backward=None, after_forward=None) -> list[float]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(STEPS, world, grad_accum)
    losses = []
    for step in steps:
        total = torch.zeros(())
        for micro in range(grad_accum):
            tokens = data[step, micro, rank]
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            if after_forward is not None:
                after_forward()
            total += loss.detach()
            engine.backward(loss)
        if after_backward is not None:
            after_backward(step)
        engine.step()
        dist.all_reduce(total)
        losses.append(total.item() / (world * grad_accum))
    return losses


def _train(nvme_path: str | None, grad_accum: int, ac: str, reshard: bool, unit_init: bool, buffer_count: int,
           sub_group_size: int):
    engine, swap = _engine(nvme_path, grad_accum, ac, reshard, unit_init, buffer_count, sub_group_size)
    held = {}
    stats: dict = {"step_buffers": 0}

    def census() -> None:  # after a forward: the deferred update's buffers, allocated now
        pool = getattr(engine.store, "pool", None)  # InfinityStore's PieceBuffers
        buffers = pool.buffers if pool is not None else []
        stats["step_buffers"] = max(stats["step_buffers"], sum(b.raw.numel() for b in buffers))

    def record_held(step: int) -> None:
        if step == 0:  # after backward: what the stage holds in memory right now
            held.update(grads=engine.stage.grad_bytes(), params=engine.stage.param_bytes(),
                        all_params=sum(p.to_local().numel() * 4 for p in engine.stage.params))
        if step == 1 and swap is not None:  # the last 3 steps' I/O: the updates run in forwards 2-4
            stats.update(whole=swap.io_stats(), unit_bytes=sum(u.nbytes for u in swap.units),
                         largest_unit=max(u.numel for u in swap.units),
                         pieces=sum(-(-u.numel // PIECE) for u in swap.units))
            swap.reset_io_stats()

    losses = _steps(engine, range(STEPS), grad_accum, after_backward=record_held, after_forward=census)
    if swap is not None:
        stats.update(last3=swap.io_stats())
    with swap.resident() if swap is not None else contextlib.nullcontext():
        full = {n.replace("_checkpoint_wrapped_module.", ""): p.data.full_tensor().clone()
                for n, p in engine.model.named_parameters()}
    engine.store.close()
    return losses, full, held, stats


def _resumed(nvme_path: str, ckpt_root: str, save_nvme: bool, load_nvme: bool, buffer_count: int) -> list[float]:
    """2 steps in one layout, a checkpoint, 3 more steps after loading it into the other layout
    (``buffer_count=3``: the swapped side is resident, its state and gradients in the step's buffers)."""
    from deepshard.core.checkpoint.state import load_checkpoint, save_checkpoint

    first, _ = _engine(nvme_path if save_nvme else None, buffer_count=buffer_count)
    losses = _steps(first, range(2))
    path = save_checkpoint(ckpt_root, 2, first.optimizer, first.mesh["dp"], model=first.model)
    first.store.close()
    second, _ = _engine(nvme_path if load_nvme else None, buffer_count=buffer_count)
    load_checkpoint(path, second.optimizer, second.mesh["dp"], model=second.model)
    losses += _steps(second, range(2, STEPS))
    second.store.close()
    return losses


def _worker(nvme_path: str, ckpt_root: str):
    from deepshard.core import init_distributed

    init_distributed()
    out = {(name, on): _train(nvme_path if on else None, *case) for name, case in CASES.items()
           for on in (False, True)}
    for save, load in ((True, False), (False, True)):
        for count in (2, 3):
            out[("resumed", save, load, count)] = _resumed(nvme_path, f"{ckpt_root}/{int(save)}{int(load)}{count}",
                                                           save, load, count)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("paramswap")
    results = launch_local(_worker, 2, str(path), str(tmp_path_factory.mktemp("ckpt")))
    assert not any(path.iterdir()), "swap files left behind"
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_param_swap_matches_no_offload(runs, case):
    for rank in (0, 1):
        base_losses, base_params, _, _ = runs[rank][(case, False)]
        losses, params, held, stats = runs[rank][(case, True)]
        # bit for bit (the issue asks 1e-6): the same arithmetic on the same shards, unit by unit
        assert losses == base_losses
        assert base_params.keys() == params.keys()
        for name, ref in base_params.items():
            torch.testing.assert_close(params[name], ref, rtol=0, atol=0)
        # after backward no gradient is held and only prefetched shards are resident
        assert held["grads"] == 0
        assert held["params"] < held["all_params"], held
        whole, last3 = stats["whole"], stats["last3"]
        assert whole["prefetched"] > 0 and whole["read_bytes"] > 0 and whole["write_bytes"] > 0
        grad_accum, _, _, _, buffer_count, sub_group_size = CASES[case]
        if sub_group_size == PIECE:  # the step's buffers: buffer_count x 16 B x the piece, not the largest unit
            assert stats["largest_unit"] > 2 * PIECE, stats
            assert stats["step_buffers"] == min(buffer_count, stats["pieces"]) * 16 * PIECE, stats
        if "resident" in case:  # each of 3 updates writes param + moments once; nothing read
            assert last3["read_bytes"] == 0, last3
            assert last3["write_bytes"] == 3 * 3 * stats["unit_bytes"], (last3, stats["unit_bytes"])
        else:  # each update reads its 4 files (grads too) and writes 3, the backward its gradients
            assert last3["read_bytes"] >= 3 * 4 * stats["unit_bytes"], (last3, stats["unit_bytes"])
            assert last3["write_bytes"] >= 3 * 4 * stats["unit_bytes"], (last3, stats["unit_bytes"])


@pytest.mark.slow
@pytest.mark.parametrize(("save", "load", "count"), [(True, False, 2), (False, True, 2), (True, False, 3), (False, True, 3)],
                         ids=["nvme_to_none", "none_to_nvme", "resident_to_none", "none_to_resident"])
def test_checkpoint_resumes_across_the_layout(runs, save, load, count):
    """Saved from the swap files and loaded into no offload, and the reverse: the losses go on as if
    one run (the uninterrupted run without offload is the reference)."""
    for rank in (0, 1):
        base = runs[rank][("plain", False)][0]
        assert runs[rank][("resumed", save, load, count)] == pytest.approx(base, rel=1e-6)

