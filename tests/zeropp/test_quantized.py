"""ZeRO++'s quantized collectives at world 4 (real gloo ranks, "nodes" of 2 ranks for qgZ's two hops).

- The collectives alone: qwZ's all-gather and qgZ's reduce-scatter against the exact results
  computed here from every rank's seeded input, within the quantization error the blocks allow.
- Training: the same small masked-data run, 100 steps, same seed, unquantized ZeRO-3 and qwZ + hpZ +
  qgZ (int8, and int4 gradients as DeepSpeed sends them): final losses within 2%, printed side by side;
  LoCo's error feedback (``zero.loco``) with int4 gradients, printed beside them (it does NOT end closer
  to ZeRO-3 here: a strict xfail records it), its fp32 error buffers counted by the census.

One launch, on the README model's 3-block scale-down: 97 CPU-s, 57 s wall on 2 cores by the CPU census (before
issue 47, 4 blocks: 134 CPU-s, 84 s).  2 blocks would cost less but fail the 2% check (measured: qwZ+hpZ+qgZ
2.0252, int4 2.0233 against ZeRO-3's 1.9798: 2.3% and 2.2%).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.zeropp.zeropp_harness import MICRO, build_engine, data, train

pytestmark = pytest.mark.slow  # world-size launches: the full suite only (the inner loop: -m 'not slow')

STEPS = 100
SHAPE = replace(MICRO, n_layers=3)  # see the module docstring: 2 blocks break the 2% check
SEG = 5000  # per-rank elements: one whole block of 4096 and a partial one
ZEROPP = dict(quantized_weights=True, hpz_partition_size=2, quantized_gradients=True, quantized_gradients_node_size=2)
RUNS = {"zero3": {}, "zero++": ZEROPP, "zero++ int4": dict(ZEROPP, quantized_gradients_bits=4),
        "zero++ int4 loco": dict(ZEROPP, quantized_gradients_bits=4, loco=True)}


def _rank_input(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(numel, generator=g) * (rank + 1)


def _collectives() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from deepshard.core.zero.quantized import QuantizedAllGather, QuantizedReduceScatter, node_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    group = mesh.get_group()
    out = {}
    gathered = torch.empty(world * SEG)
    work = QuantizedAllGather()(gathered, _rank_input(rank, SEG), group, async_op=True)
    work.wait()
    out["gather"] = gathered
    pair = node_mesh(mesh, 2).get_group("qgz_intra")  # hpZ's backward gather inside a "node": left exact
    in_node = torch.empty(2 * SEG)
    QuantizedAllGather(group_size=world)(in_node, _rank_input(rank, SEG), pair)
    out["gather_in_node"] = in_node
    for name, nodes, bits in (("one_hop", None, 8), ("two_hops", node_mesh(mesh, 2), 8), ("two_hops_int4", node_mesh(mesh, 2), 4)):
        res = torch.empty(SEG)
        QuantizedReduceScatter(bits=bits, nodes=nodes)(res, _rank_input(rank, world * SEG), group, dist.ReduceOp.SUM)
        out[name] = res
    return out


def _worker():
    from deepshard.core import init_distributed

    init_distributed()
    out = {"collectives": _collectives()}
    ids, labels = data(STEPS)
    for name, zero in RUNS.items():
        engine = build_engine(1, cfg=SHAPE, **zero)
        out[name] = train(engine, ids, labels, range(STEPS))
        out[name + " census"] = engine.memory()["measured"].buffer_parts
    return out


@pytest.fixture(scope="module")
def runs(gloo_pool):
    return gloo_pool(4).run(_worker)


def test_quantized_all_gather_within_half_a_step_per_block(runs):
    exact = torch.cat([_rank_input(r, SEG) for r in range(4)])
    for rank in range(4):
        got = runs[rank]["collectives"]["gather"]
        assert torch.equal(got, runs[0]["collectives"]["gather"])  # every rank computes with the same weights
        for r in range(4):
            for start in range(0, SEG, 4096):
                sl = slice(r * SEG + start, r * SEG + min(SEG, start + 4096))
                half_step = exact[sl].abs().max() / 127 / 2
                assert (got[sl] - exact[sl]).abs().max() <= half_step * (1 + 1e-5)
        assert not torch.equal(got, exact)  # really quantized


def test_hpz_gather_inside_a_node_is_exact(runs):
    for rank in range(4):
        node = rank // 2
        exact = torch.cat([_rank_input(r, SEG) for r in (2 * node, 2 * node + 1)])
        assert torch.equal(runs[rank]["collectives"]["gather_in_node"], exact)


@pytest.mark.parametrize("name,tol", [("one_hop", 1.5e-2), ("two_hops", 2e-2), ("two_hops_int4", 0.3)])
def test_quantized_reduce_scatter_close_to_exact_sum(runs, name, tol):
    total = sum(_rank_input(r, 4 * SEG) for r in range(4))
    for rank in range(4):
        got, exact = runs[rank]["collectives"][name], total[rank * SEG:(rank + 1) * SEG]
        err = ((got - exact).norm() / exact.norm()).item()
        # int8: each of 4 addends errs by <= half a step of its block (absmax/254), ~1/sqrt(3) of that in
        # RMS; summed and re-quantized once more in the second hop; int4 steps are 18x coarser
        assert 0 < err < tol, f"{name} rank {rank}: relative error {err:.2e}"


def test_training_with_qwz_hpz_qgz_within_2_percent(runs):
    base = runs[0]["zero3"]
    print("\nstep  zero3     qwZ+hpZ+qgZ  (int4 gradients)")
    for s in (0, 9, 24, 49, 74, 99):
        print(f"{s + 1:4d}  {base[s]:.5f}  {runs[0]['zero++'][s]:.5f}      {runs[0]['zero++ int4'][s]:.5f}")
    assert base[-1] < 0.5 * base[0]  # it really trained
    for name in ("zero++", "zero++ int4"):
        assert runs[0][name][-1] == pytest.approx(base[-1], rel=2e-2), name
        assert runs[0][name] != base  # quantization really changed the numbers


@pytest.mark.xfail(strict=True, reason="measured here: LoCo (err_beta 0.8, DeepSpeed's default) ends farther from "
                   "ZeRO-3 than plain int4 on this run (final 2.0864 vs 2.0454, ZeRO-3 2.0104; at 4 blocks 2.1315 vs "
                   "2.0947, ZeRO-3 2.0825, and err_beta 0: 2.2457); "
                   "strict: the day it holds, this flags it")
def test_loco_int4_at_least_as_close_as_without(runs):
    base, plain, loco = runs[0]["zero3"], runs[0]["zero++ int4"], runs[0]["zero++ int4 loco"]
    print("\nstep  zero3     qwZ+hpZ+qgZ int4  + LoCo")
    for s in (0, 9, 24, 49, 74, 99):
        print(f"{s + 1:4d}  {base[s]:.5f}  {plain[s]:.5f}           {loco[s]:.5f}")
    print(f"final |diff| to zero3: without LoCo {abs(plain[-1] - base[-1]):.5f}, with {abs(loco[-1] - base[-1]):.5f}")
    assert loco != plain  # the feedback really changed what was sent
    assert abs(loco[-1] - base[-1]) <= abs(plain[-1] - base[-1])


def test_loco_buffers_in_the_census(runs):
    from tests.zeropp.zeropp_harness import model

    psi = sum(p.numel() for p in model(SHAPE).parameters())
    for rank in range(4):
        assert "loco_error_feedback" not in runs[rank]["zero++ int4 census"]
        # at least one fp32 buffer of each unit's whole (unsharded, padded) gradient: DeepSpeed's intra-node one
        assert runs[rank]["zero++ int4 loco census"]["loco_error_feedback"] >= 4 * psi
