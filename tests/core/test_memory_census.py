"""``engine.memory()`` counts every buffer the engine holds: its ``live_total`` equals a census of
the live tensor storages the engine added (walked with the garbage collector, each storage once),
within 2%, at ZeRO stages 0-3, world 2, fp32 and bf16, after an optimizer step; at stages 1-2 that is
the ZeRO formula plus one bucket per collective kind.  In the same launch: bucket collectives launch
while backward runs, and with ``zero.overlap_allgather`` the parameters every module computes with
equal the plain path's, while buckets are still being gathered during the forward; and a checkpoint
loaded right after such a step (its gather still in flight, no forward between) restores exactly the
saved parameters and trains on exactly as a run without overlap."""

from __future__ import annotations

import gc

import pytest
import torch

from deepshard.launch.local import launch_local
from tests.core.zero_harness import MICRO, build_model, engine_config


def _storages() -> dict[int, torch.UntypedStorage]:
    """data_ptr -> every tensor storage reachable from Python (DTensors: their local tensor).  The dict
    holds the storages: while it lives, none of their addresses can be reused by a later allocation
    (a census by address would miss a new buffer placed where a tensor freed after this walk lived)."""
    from torch.distributed.tensor import DTensor

    gc.collect()
    out = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
        except Exception:  # noqa: BLE001 - exotic proxies in gc's list
            continue
        t = obj._local_tensor if isinstance(obj, DTensor) else obj
        if t.device.type != "meta" and t.untyped_storage().nbytes():
            out[t.untyped_storage().data_ptr()] = t.untyped_storage()
    return out


def _worker(root):
    from deepshard.core import init_distributed, initialize
    from deepshard.core.mesh import local_device

    init_distributed()
    out = {}
    for dtype in ("fp32", "bf16"):
        for stage in (0, 1, 2, 3):
            tokens = torch.randint(0, MICRO.vocab_size, (2, 17), device=local_device())
            before = _storages()
            engine = initialize(build_model().to(local_device()), engine_config(stage, dtype=dtype, bucket=3000))
            for _ in range(2):  # the second step runs with every lazily allocated buffer in place
                engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
                engine.step()
            after = _storages()
            census = sum(s.nbytes() for ptr, s in after.items() if ptr not in before)
            del before, after
            memory = engine.memory()
            out[(dtype, stage)] = (census, memory["measured"].as_dict(), memory["expected"].total)
            del engine
    out["overlap"] = {stage: _buckets_launched_before_backward_ends(stage) for stage in (1, 2)}
    out["gather_in_forward"] = {stage: (_params_at_every_use(stage, False), _params_at_every_use(stage, True))
                                for stage in (1, 2)}
    out["load_after_overlapped_step"] = {
        (stage, with_model): _load_after_overlapped_step(stage, with_model, f"{root}/stage{stage}-{with_model}")
        for stage in (1, 2) for with_model in (True, False)}
    return out


def _load_after_overlapped_step(stage: int, with_model: bool, root: str):
    """Overlapped run: 2 steps, save, a third step on another batch (its all-gather is left in flight),
    load the save at once (no forward between), 3 more steps.  Plain run: the same 2 + 3 steps.
    Returns (saved params, params right after the load, losses after the load, the plain run's last 3
    losses, both runs' final params, buckets still in flight when the load began).  ``with_model``:
    the load is given the model (its ``state_dict()`` finishes the gather) or not (only the optimizer)."""
    import torch.distributed as dist

    from deepshard.core import initialize
    from deepshard.core.checkpoint.state import load_checkpoint, save_checkpoint
    from deepshard.core.mesh import local_device

    g = torch.Generator().manual_seed(11 + dist.get_rank())
    data = [torch.randint(0, MICRO.vocab_size, (2, 17), generator=g).to(local_device()) for _ in range(6)]

    def train(engine, batches):
        losses = []
        for tokens in batches:
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    def params(engine):
        engine.gather_params()
        return {n: p.detach().clone() for n, p in engine.model.named_parameters()}

    plain = initialize(build_model().to(local_device()), engine_config(stage, bucket=3000))
    plain_losses = train(plain, data[:5])[2:]
    lazy = initialize(build_model().to(local_device()), engine_config(stage, bucket=3000, overlap_allgather=True))
    train(lazy, data[:2])
    dp = lazy.mesh["dp"]
    path = save_checkpoint(root, 2, lazy.optimizer, dp, model=lazy.model)
    saved = params(lazy)
    train(lazy, data[5:6])  # a step that the load must undo; its gather is still running
    gatherer = lazy.stage.gatherer
    in_flight = len(gatherer.buckets) - gatherer._next + (gatherer._inflight is not None)
    load_checkpoint(path, lazy.optimizer, dp, model=lazy.model if with_model else None)
    restored = params(lazy)
    lazy_losses = train(lazy, data[2:5])
    return saved, restored, lazy_losses, plain_losses, params(lazy), params(plain), in_flight


def _params_at_every_use(stage: int, overlap_allgather: bool):
    """Three steps; at every module's forward (after the engine's own pre-hook) a copy of the params it
    computes with.  Returns (uses, losses, buckets the forward had to wait for, buckets in all)."""
    from deepshard.core import initialize
    from deepshard.core.mesh import local_device

    model = build_model().to(local_device())
    engine = initialize(model, engine_config(stage, bucket=3000, overlap_allgather=overlap_allgather))
    uses = []

    def record(module, args):
        uses.append([p.detach().clone() for p in module.parameters(recurse=False)])

    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(record)
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, MICRO.vocab_size, (2, 17), generator=g).to(local_device())
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    final = {n: p.detach().clone() for n, p in model.state_dict().items()}  # state_dict() waits for the gather
    gatherer = engine.stage.gatherer
    return uses, losses, final, gatherer.num_waits_in_forward, len(gatherer.buckets)


def _buckets_launched_before_backward_ends(stage: int) -> tuple[int, int]:
    """(buckets whose collective was already launched when the last gradient of backward arrived,
    buckets in all): the reduction overlaps backward when the first number is > 1."""
    from deepshard.core import initialize
    from deepshard.core.mesh import local_device

    model = build_model().to(local_device())
    engine = initialize(model, engine_config(stage, bucket=3000))
    reducer = engine.stage.reducer
    seen = []
    # the embedding's gradient is the last of backward; its hook runs after the reducer's own
    model.embed_tokens.weight.register_post_accumulate_grad_hook(lambda p: seen.append(reducer.num_launched))
    tokens = torch.randint(0, MICRO.vocab_size, (2, 17), device=local_device())
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    return seen[0], len(reducer.buckets)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch_local(_worker, 2, str(tmp_path_factory.mktemp("ckpt")))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_report_equals_live_tensor_census(runs, stage, dtype):
    # a bucket holds up to 3000 elements, or one larger tensor alone (the 96 x 32 embedding)
    bucket = max(3000, MICRO.vocab_size * MICRO.dim)
    bucket_bytes = bucket * (2 if dtype == "bf16" else 4)
    for rank in (0, 1):
        census, reported, formula = runs[rank][(dtype, stage)]
        assert abs(reported["live_total"] - census) <= 0.02 * census, (rank, stage, dtype, census, reported)
        if stage in (1, 2):  # the buffers are really there, and named: one bucket each
            assert 0 < reported["buffers.allgather"] <= bucket_bytes
        if stage == 2:
            assert 0 < reported["buffers.reduce_scatter"] <= bucket * 4  # packed in reduce_dtype=fp32
        # the model state is the formula (+ Shard(0) padding); the buffers are the buckets and the RoPE table
        assert reported["total"] <= 1.02 * formula, (rank, stage, dtype, reported["total"], formula)


@pytest.mark.parametrize("stage", [1, 2])
def test_bucket_collectives_launch_while_backward_runs(runs, stage):
    for rank in (0, 1):
        launched, total = runs[rank]["overlap"][stage]
        assert total > 2, "the test model must span several buckets"
        assert launched > 1, f"stage {stage}: only {launched} of {total} buckets launched before backward ended"


@pytest.mark.parametrize("stage", [1, 2])
def test_params_gathered_in_forward_equal_the_plain_path_at_every_use(runs, stage):
    for rank in (0, 1):
        (plain, plain_losses, plain_final, _, _), (lazy, lazy_losses, lazy_final, waits, buckets) = \
            runs[rank]["gather_in_forward"][stage]
        assert buckets > 2, "the test model must span several buckets"
        assert waits > 1, f"stage {stage}: the forward waited for only {waits} of {buckets} buckets"
        assert lazy_losses == plain_losses
        assert len(lazy) == len(plain)
        for i, (a, b) in enumerate(zip(lazy, plain)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"module use {i}: params differ from the plain path"
        assert lazy_final.keys() == plain_final.keys()
        assert all(torch.equal(lazy_final[k], plain_final[k]) for k in plain_final)


@pytest.mark.parametrize("with_model", [True, False])
@pytest.mark.parametrize("stage", [1, 2])
def test_load_right_after_an_overlapped_step_restores_the_save_and_trains_on_as_the_plain_path(runs, stage,
                                                                                              with_model):
    for rank in (0, 1):
        saved, restored, lazy_losses, plain_losses, lazy_final, plain_final, in_flight = \
            runs[rank]["load_after_overlapped_step"][(stage, with_model)]
        assert in_flight > 1, f"stage {stage}: only {in_flight} buckets were in flight when the load began"
        assert restored.keys() == saved.keys()
        for name in saved:
            assert torch.equal(restored[name], saved[name]), f"{name}: the load did not restore the saved values"
        assert lazy_losses == plain_losses
        assert all(torch.equal(lazy_final[n], plain_final[n]) for n in plain_final)
