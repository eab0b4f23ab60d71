"""A parameter that some micro-steps (or a whole step) never reach: its gradient is zero there, not
the last step's, at ZeRO 0-3 (world 2, grad_accum 2, real gloo ranks).

Stages 0-1 keep gradients as views of flat buckets that are not wiped between steps: a step's first
gradient is copied in and a view that no gradient reached is zeroed when its bucket launches.  A
branch taken in step 0, skipped in step 1, taken only in the second micro-step of step 2 and only in
the first of step 3 walks every case.  The reference is plain single-process torch written here:
the whole global batch, torch.optim.AdamW with its gradients zeroed, not set to None (so a skipped
branch gets a zero gradient and still moves by its momentum and decay, as the engine's does).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

DIM, ROWS, LR, WD, BETAS = 8, 4, 1e-2, 0.1, (0.9, 0.95)
BRANCH = [(True, True), (False, False), (False, True), (True, False)]  # step -> micro-step -> use the branch


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(DIM, DIM)
        self.branch = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h).pow(2).mean()


def data() -> torch.Tensor:
    """[step, micro, rank, ROWS, DIM]."""
    return torch.randn(len(BRANCH), 2, 2, ROWS, DIM, generator=torch.Generator().manual_seed(3))


def reference() -> dict[str, torch.Tensor]:
    model = Branchy()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=1e-6)
    x = data()
    for step, uses in enumerate(BRANCH):
        loss = sum(model(x[step, m].reshape(-1, DIM), use) for m, use in enumerate(uses)) / len(uses)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(stage: int) -> dict:
    """Every step of ``BRANCH`` on this rank; returns the final full params and this rank's gradients
    (``stage.local_grads()``: its Shard(0) rows from stage 1 on) after step 0's backward passes,
    before its optimizer step."""
    import torch.distributed as dist

    from deepshard.core import EngineConfig, OptimConfig, ZeroConfig, initialize

    rank = dist.get_rank()
    config = EngineConfig(zero=ZeroConfig(stage=stage, reduce_bucket_size=100, allgather_bucket_size=100),
                          optim=OptimConfig(lr=LR, betas=BETAS, eps=1e-6, weight_decay=WD, grad_clip=0.0), grad_accum=2)
    model = Branchy()
    engine = initialize(model, config, blocks=[model.inp, model.branch])
    x = data()
    first_grads: list[torch.Tensor] = []
    for step, uses in enumerate(BRANCH):
        for m, use in enumerate(uses):
            engine.backward(engine(x[step, m, rank], use))
        if step == 0:
            first_grads = [g.detach().clone() for g in engine.stage.local_grads()]
        engine.step()
    engine.gather_params()
    params = {n: (p.data.full_tensor() if hasattr(p.data, "full_tensor") else p.data).detach().clone()
              for n, p in engine.model.named_parameters()}
    return {"params": params, "first_grads": first_grads}


def _worker() -> dict[int, dict]:
    from deepshard.core import init_distributed

    init_distributed()
    return {stage: _run(stage) for stage in (0, 1, 2, 3)}


@pytest.fixture(scope="module")
def runs(gloo_pool) -> list[dict[int, dict]]:
    return gloo_pool(2).run(_worker)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unreached_parameters_get_a_zero_gradient(runs, stage):
    ref = reference()
    for rank, by_stage in enumerate(runs):
        for name, want in ref.items():
            got = by_stage[stage]["params"][name]
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-5, f"stage {stage} rank {rank}: {name} differs from the reference by {err:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reduced_gradients_are_the_global_batch_average(runs, stage):
    """Each rank's own rows after the accumulation boundary are the reference's gradient, to 1e-6: the
    parity tests above cannot see a wrong divisor (AdamW without clipping is scale-invariant), this can."""
    model = Branchy()
    x = data()
    loss = sum(model(x[0, m].reshape(-1, DIM), use) for m, use in enumerate(BRANCH[0])) / len(BRANCH[0])
    loss.backward()
    ref = [p.grad for p in model.parameters()]
    for rank, out in enumerate(runs):
        got = out[stage]["first_grads"]
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            per = -(-r.shape[0] // 2)  # Shard(0): ceil(rows / 2) rows each, rank 1's of a 1-row bias empty
            want = r if stage == 0 else r[rank * per:(rank + 1) * per]
            assert g.shape == want.shape, (stage, rank, g.shape, want.shape)
            if not want.numel():
                continue
            err = ((g - want).norm() / want.norm()).item()
            assert err < 1e-6, f"stage {stage} rank {rank}: gradient differs from the reference by {err:.2e}"


def test_reference_really_skips_the_branch():
    """Without the branch the loss does not depend on ``branch``: its gradient is exactly zero there."""
    model = Branchy()
    model(data()[0, 0, 0], False).backward()
    assert model.branch.weight.grad is None
