"""Memory-centric tiling at world 2 (real gloo ranks): the vocabulary ops on a ``Shard(0)`` weight, and
the app's ZeRO-3 Llama (``model.vocab_tile_size``) with and without ZeRO-Infinity, never gathering
the embedding or the head whole.

References are plain torch written here (the kernel half: the full weight on each rank's tokens,
weight gradients averaged over the ranks as FSDP2 averages) or the single-process model trained on
the whole global batch with torch.optim.AdamW (tests/core/zero_harness.py).  One launch runs all."""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from deepshard.launch.local import launch_local  # noqa: E402
from tests.core.zero_harness import MICRO, batches, engine_config, reference  # noqa: E402

VOCAB, HID, TOKENS = 1001, 24, 29  # odd: rank 0 owns 501 rows, rank 1 500; tiles of 64 leave a partial one
CFG = dataclasses.replace(MICRO, vocab_size=1001, vocab_tile_size=96)  # 48 rows per rank per tile
STEPS = 3
PIECE = 4096  # offload.sub_group_size: the deferred update's pieces (the head's 16k-element shard in 4)


def _kernel_data(rank: int):
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(VOCAB, HID, generator=g) * 0.2
    hidden = torch.randn(2, TOKENS, HID, generator=g)[rank]
    targets = torch.randint(0, VOCAB, (2, TOKENS), generator=g)[rank]
    targets[::4] = -100
    ids = torch.randint(0, VOCAB, (2, 3, 7), generator=g)[rank]
    grad_out = torch.randn(2, 3, 7, HID, generator=g)[rank]
    return weight, hidden, targets, ids, grad_out


def _kernels(mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    from deepshard.core.zero.tiled_vocab import tiled_embedding, tiled_linear_cross_entropy

    rank = mesh.get_local_rank()
    weight, hidden, targets, ids, grad_out = _kernel_data(rank)
    w = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    h = hidden.clone().requires_grad_()
    loss = tiled_linear_cross_entropy(h, w, targets, reduction="sum", tile_size=64, chunk_size=8)
    loss.backward()
    out = {"loss": loss.detach(), "grad_h": h.grad, "grad_w": w.grad.to_local().clone()}
    e = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    emb = tiled_embedding(ids, e, tile_size=100)
    emb.backward(grad_out)
    out.update(emb=emb.detach(), grad_e=e.grad.to_local().clone())
    return out


def _app_run(nvme_path: str | None, grad_accum: int = 1) -> dict:
    import torch.distributed as dist

    from deepshard.core import ParallelDims, build_mesh, initialize
    from deepshard.finetune.models.llama import Llama
    from deepshard.finetune.models.llama.parallelize import parallelize_llama
    from deepshard.offload import OffloadConfig, make_store_factory, param_offload

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = engine_config(3, grad_accum, 0.05)
    mesh = build_mesh(ParallelDims())
    on = nvme_path is not None
    off = OffloadConfig(device="nvme" if on else "none", nvme_path=nvme_path, params="nvme" if on else "none",
                        buffer_count=2, param_buffer_count=3, param_prefetch=2,
                        sub_group_size=PIECE, buffer_size=PIECE)
    factory = make_store_factory(off, rank, "tiled")
    swap = getattr(factory, "param_swap", None)
    offload_params = param_offload(off, factory)
    with torch.device("meta"):
        model = Llama(CFG)
    unshards = {"embed_tokens": 0, "lm_head": 0}

    def init(m):
        for name in unshards:  # count FSDP2 all-gathers of the tiled units: there must be none
            group = getattr(m, name)._get_fsdp_state()._fsdp_param_group
            orig = group.unshard

            def counted(*a, _orig=orig, _name=name, **k):
                unshards[_name] += 1
                return _orig(*a, **k)

            group.unshard = counted
        m.init_weights(0)

    recipe = partial(parallelize_llama, mesh=mesh, zero=cfg.zero, dtype="fp32", ac="none",
                     offload_params=offload_params)
    engine = initialize(model, cfg, mesh=mesh, parallelize_fn=recipe, store_factory=factory,
                        offload_params=offload_params,
                        materialize=swap.materializer(init) if swap is not None else init)
    census = {"tiled_resident": 0}
    if swap is not None:  # every refill of a unit's shards: the tiled units' resident bytes after it
        tiled = [u for u in swap.units if u.name.endswith(("embed_tokens", "lm_head"))]
        assert len(tiled) == 2, [u.name for u in swap.units]

        def counted(fill):
            def wrapped(unit, *a, **k):
                fill(unit, *a, **k)
                if "pool" in census:  # training is over (resident() below fills them whole on purpose)
                    return
                census["tiled_resident"] = max(census["tiled_resident"], sum(
                    s.data.untyped_storage().nbytes() for u in tiled for s in u.slots))
            return wrapped

        swap.fill, swap.fill_range = counted(swap.fill), counted(swap.fill_range)
    data = batches(STEPS, world, grad_accum, CFG)
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for micro in range(grad_accum):
            tokens = data[step, micro, rank]
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            total += loss.detach()
        engine.step()
        dist.all_reduce(total)
        losses.append(total.item() / (world * grad_accum))
    if swap is not None:
        census.update(pool=swap.pool_bytes(), tile_bytes=max(t.tile_bytes() for t in swap.tiled_shards),
                      gathered=max(u.nbytes for u in swap.units if u not in tiled),
                      tiled=max(u.nbytes for u in tiled))
    ctx = swap.resident() if swap is not None else contextlib.nullcontext()
    with ctx:
        full = {n: p.data.full_tensor().clone() for n, p in engine.model.named_parameters()}
    engine.store.close()
    return {"losses": losses, "params": full, "unshards": unshards, "num_params": engine.num_params,
            "census": census}


def _worker(nvme_path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from deepshard.core import init_distributed

    init_distributed()
    out = {"kernels": _kernels(init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))}
    out["zero3"] = _app_run(None)
    out["infinity"] = _app_run(nvme_path)
    out["infinity_accum"] = _app_run(nvme_path, grad_accum=2)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiled")
    results = launch_local(_worker, 2, str(path))
    assert not any(path.iterdir()), "swap files left behind"
    return results


@pytest.mark.slow
def test_tiled_ops_on_a_sharded_weight_match_torch(runs):
    grads_w, grads_e = [], []
    for rank in (0, 1):
        weight, hidden, targets, ids, grad_out = _kernel_data(rank)
        w, h = weight.clone().requires_grad_(), hidden.clone().requires_grad_()
        ref = F.cross_entropy(h @ w.t(), targets, ignore_index=-100, reduction="sum")
        ref.backward()
        got = runs[rank]["kernels"]
        torch.testing.assert_close(got["loss"], ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["grad_h"], h.grad, rtol=1e-5, atol=1e-5)
        grads_w.append(w.grad)
        e = weight.clone().requires_grad_()
        emb = F.embedding(ids, e)
        emb.backward(grad_out)
        torch.testing.assert_close(got["emb"], emb.detach(), rtol=0, atol=0)
        grads_e.append(e.grad)
    rows = [slice(0, 501), slice(501, VOCAB)]  # torch.chunk's Shard(0) split
    for rank in (0, 1):  # FSDP2 averages gradients over the ranks
        torch.testing.assert_close(runs[rank]["kernels"]["grad_w"], ((grads_w[0] + grads_w[1]) / 2)[rows[rank]],
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(runs[rank]["kernels"]["grad_e"], ((grads_e[0] + grads_e[1]) / 2)[rows[rank]],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero3", "infinity", "infinity_accum"])
def test_tiled_zero3_trains_as_one_process(runs, layout):
    accum = 2 if layout.endswith("accum") else 1
    ref_losses, ref_params = reference(STEPS, 2, accum, engine_config(3, accum, 0.05).optim, CFG)
    for rank in (0, 1):
        got = runs[rank][layout]
        assert got["unshards"] == {"embed_tokens": 0, "lm_head": 0}, "a tiled unit was gathered whole"
        assert got["num_params"] == sum(p.numel() for p in ref_params.values())
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for name, ref in ref_params.items():
            torch.testing.assert_close(got["params"][name], ref, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["infinity", "infinity_accum"])
def test_tiled_units_never_whole_under_nvme_params(runs, layout):
    """With the params on NVMe the embedding's and the head's shards are never refilled whole: each tile
    reads its rows of the param file into a tile buffer (48 rows x 32 of fp32 plus the 4 KiB alignment),
    and the param pool is sized by the largest unit that is gathered (a block), not the head."""
    for rank in (0, 1):
        c = runs[rank][layout]["census"]
        assert c["tiled_resident"] == 0, c
        assert c["tile_bytes"] <= 2 * (48 * 32 * 4 + 2 * 4096), c  # a param and a gradient tile buffer
        assert c["tiled"] > c["gathered"], c
        assert c["pool"] == 3 * c["gathered"], c
