"""``deepspeed.initialize`` of a model holding ``deepspeed.moe.layer.MoE(ep_size > 1)``, at world 4 in one pool call.

(a) Four layouts (ep=2 x edp=2 and ep=4 x edp=1; ZeRO 0-3; accumulation 2; top-2 dropless and top-1
capacity-limited; clipping) against one process of plain torch written here: all experts local, the
router and capacity rule written here (top-1 keeps an expert's first tokens, top-2 renormalizes its two
gates, equal gates go to the first expert as DeepSpeed's argmax), the step's loss the mean of every
rank's and micro-batch's loss (DeepSpeed's average), trained by torch.optim.AdamW.  The experts chosen (per-expert counts), the losses and every parameter after 3 steps
equal within 1e-5.  (b) ``deepspeed.utils.groups`` as DeepSpeed's topology names them.  (c)
bench/bench_ds_moe_cifar.py (DeepSpeedExamples' CIFAR-10 MoE script) under deepshard against real
DeepSpeed 0.19.8's losses on the same 4 ranks (fixtures/ds_moe_cifar.json, bench/record_ds_moe.py), and
the epoch after resuming DeepSpeed's own MoE checkpoint (its expert files imported) against DeepSpeed's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.compat.ds_moe_ep_harness import AUX, CASES, EXPERTS, STEPS, batch, weights
from tests.gloo_pool import pool

WORLD = 4
CKPT_VARIANT = "top2"  # bench/record_ds_moe.py: DeepSpeed saved after its epoch and resumed it ("resumed")
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "ds_moe_cifar.json").read_text())


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Path:
    """Where the checkpointed variant saves our engine's checkpoint after the epoch DeepSpeed saved its own at."""
    return tmp_path_factory.mktemp("ours")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ours) -> list[dict]:
    """One pool call for every case; the checkpointed variant also resumes DeepSpeed's own checkpoint after
    its epoch (fixtures/ds_moe_ckpt, imported by ``ds_import``) and trains one more epoch."""
    from deepshard.compat.deepspeed.ds_import import import_checkpoint

    imported = tmp_path_factory.mktemp("imported")
    import_checkpoint(Path(__file__).parent / "fixtures" / "ds_moe_ckpt", imported)
    variants = {name: [*argv, "--load_dir", str(imported), "--ckpt_dir", str(ours)] if name == CKPT_VARIANT else argv
                for name, argv in FIXTURE["variants"].items()}
    return pool(WORLD).run(_run_all, variants)


def _run_all(variants: dict) -> dict:
    from tests.compat.ds_moe_ep_harness import run_all

    return run_all(variants)


def _expert(w: dict, e: int, h: torch.Tensor) -> torch.Tensor:
    return F.linear(torch.relu(F.linear(h, w[f"e{e}.0.weight"], w[f"e{e}.0.bias"])), w[f"e{e}.2.weight"], w[f"e{e}.2.bias"])


def reference_loss(w: dict, x: torch.Tensor, y: torch.Tensor, *, k: int, drop: bool, min_capacity: int):
    """(loss, tokens per expert before dropping) of one rank's micro-batch, every expert local."""
    h = torch.relu(F.linear(x, w["inp.weight"], w["inp.bias"]))
    gates = torch.softmax(h @ w["wg"].t(), dim=-1)
    tokens = h.shape[0]
    # the k largest gates, the first expert among equal ones (DeepSpeed's argmax rule): a token whose hidden
    # state is all zero (every ReLU off, which this data has) has equal gates, where topk's order is the kernel's
    top = torch.sort(gates, dim=-1, descending=True, stable=True).indices[:, :k]
    capacity = max(math.ceil(tokens / EXPERTS), min_capacity) if drop else tokens
    fill, rows = [0] * EXPERTS, []
    for t in range(tokens):
        chosen = top[t].tolist()
        kept = []
        for e in chosen:
            if fill[e] < capacity:
                fill[e] += 1
                kept.append(e)
        norm = gates[t, chosen].sum() if k > 1 else 1.0
        rows.append(sum((gates[t, e] / norm * _expert(w, e, h[t]) for e in kept), torch.zeros_like(h[t])))
    first = F.one_hot(top[:, 0], EXPERTS).float().mean(dim=0)
    l_aux = (gates.mean(dim=0) * first).sum() * EXPERTS if k == 1 else (gates.mean(dim=0) * first).mean() * EXPERTS ** 2
    logits = F.linear(torch.stack(rows), w["out.weight"], w["out.bias"])
    counts = torch.bincount(top.flatten(), minlength=EXPERTS).tolist()
    return F.cross_entropy(logits, y) + AUX * l_aux, counts


def reference_run(ep: int, stage: int, accum: int, k: int, drop: bool, min_capacity: int, clip: float):
    w = {n: t.clone().requires_grad_() for n, t in weights().items()}
    opt = torch.optim.AdamW(list(w.values()), lr=0.02, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    losses = {r: [] for r in range(WORLD)}
    counts = {r: [] for r in range(WORLD)}
    for step in range(STEPS):
        total = 0.0
        for micro in range(accum):
            for r in range(WORLD):
                loss, c = reference_loss(w, *batch(step, micro, r), k=k, drop=drop, min_capacity=min_capacity)
                losses[r].append(loss.item())
                counts[r].append(c)
                total = total + loss / (WORLD * accum)
        total.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(list(w.values()), clip)
        opt.step()
        opt.zero_grad()
    return losses, counts, {n: t.detach() for n, t in w.items()}


def _ours_to_reference(name: str, ep_rank: int, local: int) -> str:
    """Our model's parameter name -> the reference's key (an expert by its global id)."""
    if name == "moe.deepspeed_moe.gate.wg.weight":
        return "wg"
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    if name.startswith(prefix):
        i, rest = name[len(prefix):].split(".", 1)
        return f"e{ep_rank * local + int(i)}.{rest}"
    return name


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_initialize_equals_one_process(runs, case):
    ep = CASES[case][0]
    want_losses, want_counts, want_params = reference_run(*CASES[case])
    for rank, out in enumerate(runs):
        got = out[case]
        assert got["ep_rank"] == rank % ep
        diffs = {name: (value - want_params[_ours_to_reference(name, got["ep_rank"], EXPERTS // ep)]).abs().max().item()
                 for name, value in got["params"].items()}
        loss_diffs = [abs(a - b) for a, b in zip(got["losses"], want_losses[rank], strict=True)]
        assert got["counts"] == want_counts[rank], (rank, got["counts"], want_counts[rank], loss_diffs, diffs)
        assert max(loss_diffs) < 1e-5, (rank, loss_diffs)
        assert max(diffs.values()) < 1e-5, (rank, diffs)


def test_the_data_has_tokens_with_equal_gates():
    """The tie rule above is exercised: some step-0 token has an all-zero hidden state (equal gates)."""
    w = weights()
    zero_rows = sum(int((torch.relu(F.linear(batch(0, micro, r)[0], w["inp.weight"], w["inp.bias"])) == 0).all(-1).sum())
                    for micro in range(2) for r in range(WORLD))
    assert zero_rows > 0


def test_groups_are_deepspeeds_topology(runs):
    for rank, out in enumerate(runs):
        g = out["groups"]
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert g == {"ep_ranks": pair, "edp_ranks": [rank % 2, rank % 2 + 2], "ep_size": 2, "ep_rank": rank % 2,
                     "edp_size": 2, "edp_rank": rank // 2, "dp_size": 4, "max_ep": "ep_size_4",
                     "names": ["ep_size_2", "ep_size_4"]}, rank


@pytest.mark.parametrize("variant", list(FIXTURE["variants"]))
def test_deepspeed_moe_cifar_script_equals_deepspeed(runs, variant):
    """The same script, argv and 4 ranks: deepshard's losses against DeepSpeed 0.19.8's, rank by rank."""
    for rank, out in enumerate(runs):
        want, got = FIXTURE["losses"][variant][rank], out[f"cifar_{variant}"]
        assert "error" not in want, want
        if variant == CKPT_VARIANT:  # also the epoch after resuming DeepSpeed's checkpoint (imported here)
            assert max(abs(a - b) for a, b in zip(got["resumed"], want["resumed"], strict=True)) < 1e-5, (
                rank, got["resumed"], want["resumed"])
            want, got = want["losses"], got["losses"]
        assert len(got) == len(want) == 4
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5, (rank, got, want)


def test_our_moe_checkpoint_exports_as_deepspeed_saved_it(runs, ours, tmp_path):
    """Our engine's checkpoint of the script after its epoch (ep_size 2), exported (``ds_moe_export``), against the
    files real DeepSpeed saved after the same epoch (fixtures/ds_moe_ckpt): the same files, names, expert ids,
    optimizer groups and step counts, every tensor within 1e-5 (the two trainings agree that far)."""
    from deepshard.compat.deepspeed.ds_export import export_checkpoint

    fixture = Path(__file__).parent / "fixtures" / "ds_moe_ckpt" / "global_step4"
    out = export_checkpoint(ours / "global_step4", tmp_path / "ds", num_groups=1)  # the script's one group
    assert sorted(f.name for f in out.iterdir()) == sorted(f.name for f in fixture.iterdir())

    def close(want, got, where: str) -> None:
        if isinstance(want, torch.Tensor):
            assert want.shape == got.shape and (want.float() - got.float()).abs().max() < 1e-5, where
        elif isinstance(want, dict):
            assert set(want) == set(got), (where, sorted(map(str, want)), sorted(map(str, got)))
            for k in want:
                close(want[k], got[k], f"{where}.{k}")
        elif isinstance(want, float):
            assert abs(want - got) <= 1e-6 * abs(want), (where, want, got)
        else:
            assert want == got, (where, want, got)

    for f in fixture.glob("*.pt"):
        want, got = (torch.load(p / f.name, weights_only=True) for p in (fixture, out))
        keys = ("module", "num_experts", "global_steps", "lr_scheduler", "dp_world_size") \
            if f.name.startswith("mp_rank") else list(want)
        for key in keys:
            close(want[key], got[key], f"{f.name}:{key}")
