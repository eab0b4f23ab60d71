"""One step API (``deepshard.core.step``) under the engine and the pipeline: same batch, same loss and
gradients, and both reach the arithmetic through core's named functions.

One batch of 4 masked, variable-length rows (one row without a valid token): the engine at dp=2 (2
rows per rank, ZeRO 0) and the pipeline at pp=2 (one replica, 2 microbatches of 2 rows) compute the
same micro-batches, so their losses agree to float rounding and their gradients to 1e-5.  The
reference is plain torch written here.  The same launch runs the batch again with an extra loss term
(``add_aux_loss`` from a forward hook on ``layers.1``, which sits on the pipeline's *first* stage,
away from the loss): both engines must add ``weight * mean over micro-batches`` and nothing else.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.core.test_token_weighted_parity import CLIP, LR, MICRO, model

AUX_WEIGHT = 0.25
SEQ, ROWS = 16, 4
SPIED = ("count_valid_tokens", "loss_scale_factor")


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """4 rows following next = 5 * prev + 1 (mod vocab); masked prompts, right padding, row 2 empty."""
    g = torch.Generator().manual_seed(3)
    seq = [torch.randint(0, MICRO.vocab_size, (ROWS, 1), generator=g)]
    for _ in range(SEQ):
        seq.append((seq[-1] * 5 + 1) % MICRO.vocab_size)
    tokens = torch.cat(seq, dim=-1)
    ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for r, (prompt, end) in enumerate([(3, 16), (9, 12), (0, 0), (1, 7)]):
        pos = torch.arange(SEQ)
        labels[r][(pos < prompt) | (pos >= end)] = -100
    return ids, labels


def _aux(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _hook_aux(modules) -> None:
    """``add_aux_loss`` on ``layers.1``'s output: how an MoE block would attach its router loss."""
    from deepshard.core.step import add_aux_loss

    for m in modules:
        for name, sub in m.named_modules():
            if name == "layers.1":
                sub.register_forward_hook(lambda mod, args, out: add_aux_loss(out, _aux(out), weight=AUX_WEIGHT))


def _config():
    from deepshard.core import EngineConfig, OptimConfig, ZeroConfig

    return EngineConfig(zero=ZeroConfig(stage=0), optim=OptimConfig(lr=LR, grad_clip=CLIP))


def _grads(stage) -> dict[str, torch.Tensor]:
    return {n.replace("_checkpoint_wrapped_module.", ""): g.detach().float().cpu().clone()
            for n, g in zip(stage.names, stage.local_grads())}


def _engine(aux: bool) -> tuple[float, dict]:
    import torch.distributed as dist

    from deepshard.core import initialize
    from deepshard.core.mesh import local_device
    from deepshard.core.step import local_valid_tokens, token_mean

    engine = initialize(model().to(local_device()), _config())
    if aux:
        _hook_aux([engine.model])
    ids, labels = batch()
    rank = dist.get_rank()
    x, y = ids[2 * rank:2 * rank + 2].to(local_device()), labels[2 * rank:2 * rank + 2].to(local_device())
    count = engine.global_num_items(local_valid_tokens(y))
    loss_sum = engine(x, y, reduction="sum")
    engine.backward(loss_sum, num_items=count)
    total = loss_sum.detach().float()
    dist.all_reduce(total)
    return token_mean(total, count).item(), _grads(engine.stage)


def _pipeline(aux: bool) -> tuple[float, dict]:
    from deepshard.core import ParallelDims, build_mesh
    from deepshard.core.mesh import local_device
    from deepshard.finetune.models.llama.parallelize import pipeline_llama

    pipe_engine = pipeline_llama(model(), build_mesh(ParallelDims(pp=2)), _config(), schedule="1f1b", microbatches=2)
    if aux:
        _hook_aux(pipe_engine.pipeline.modules)
    ids, labels = batch()
    loss = pipe_engine.forward_backward(ids.to(local_device()), labels.to(local_device()))
    return loss.item(), _grads(pipe_engine.zero)


def _worker() -> dict:
    import deepshard.core.engine as engine_mod
    import deepshard.pipeline.engine as pipeline_mod
    from deepshard.core import init_distributed

    init_distributed()
    calls: dict[tuple[str, str], int] = {}
    for mod, who in ((engine_mod, "engine"), (pipeline_mod, "pipeline")):  # spy on the names each caller uses
        for name in SPIED:
            if hasattr(mod, name):
                real = getattr(mod, name)

                def spy(*a, _real=real, _key=(who, name), **k):
                    calls[_key] = calls.get(_key, 0) + 1
                    return _real(*a, **k)

                setattr(mod, name, spy)
    out: dict = {(who, aux): run(aux) for aux in (False, True) for who, run in (("engine", _engine),
                                                                                 ("pipeline", _pipeline))}
    out["calls"] = calls
    return out


@pytest.fixture(scope="module")
def runs(gloo_pool) -> list[dict]:
    return gloo_pool(2).run(_worker)


def reference(aux: bool) -> tuple[float, dict]:
    """Plain torch: the whole batch, summed cross-entropy / valid tokens (+ weight x the mean of the
    two micro-batches' aux values, each computed on its own 2 rows)."""
    m = model()
    ids, labels = batch()
    loss = F.cross_entropy(m(ids).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    loss = loss / (labels != -100).sum()
    if aux:
        seen: list[torch.Tensor] = []
        handle = m.layers[1].register_forward_hook(lambda mod, args, out: seen.append(_aux(out)))
        for lo in (0, 2):
            m(ids[lo:lo + 2])
        handle.remove()
        total = loss + AUX_WEIGHT * (seen[0] + seen[1]) / 2
    else:
        total = loss
    total.backward()
    return loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("aux", [False, True], ids=["plain", "aux_loss"])
def test_engine_and_pipeline_give_equal_loss_and_gradients(runs, aux):
    ref_loss, ref_grads = reference(aux)
    engine_loss, engine_grads = runs[0][("engine", aux)]
    assert runs[1][("engine", aux)][0] == engine_loss  # every rank reports the same loss
    assert engine_loss == pytest.approx(ref_loss, rel=1e-6)
    assert engine_grads.keys() == ref_grads.keys()
    pipe: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        loss, grads = runs[rank][("pipeline", aux)]
        assert loss == pytest.approx(engine_loss, rel=1e-6), f"pipeline rank {rank}"
        assert not pipe.keys() & grads.keys()  # each stage holds its own layers
        pipe.update(grads)
    assert pipe.keys() == engine_grads.keys()
    for name, g in engine_grads.items():
        torch.testing.assert_close(pipe[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    if aux:  # the term really moved the gradients
        plain = runs[0][("engine", False)][1]
        assert any(not torch.allclose(plain[n], g) for n, g in engine_grads.items())


def test_both_engines_call_cores_step_functions(runs):
    for rank in (0, 1):
        calls = runs[rank]["calls"]
        for who in ("engine", "pipeline"):
            for name in SPIED:
                assert calls.get((who, name), 0) >= 2, f"rank {rank}: {who} never called {name}"


def test_aux_loss_seam_single_process():
    """``add_aux_loss`` under ``aux_loss_scale``: gradients of ``main * factor + weight * aux *
    scale / micro_batches``, against autograd on that sum written out; the identity without grad."""
    from deepshard.core.step import add_aux_loss, aux_loss_scale

    torch.manual_seed(0)
    w, x = torch.randn(5, 3), torch.randn(4, 5)
    ours = w.clone().requires_grad_()
    h = x @ ours
    out = add_aux_loss(h, h.pow(2).mean(), weight=0.3)
    with aux_loss_scale(8.0, micro_batches=2):
        (out.sin().sum() * 0.5).backward()
    ref = w.clone().requires_grad_()
    h = x @ ref
    (h.sin().sum() * 0.5 + 0.3 * h.pow(2).mean() * 8.0 / 2).backward()
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        h = x @ w
        assert add_aux_loss(h, h.pow(2).mean(), weight=0.3) is h
