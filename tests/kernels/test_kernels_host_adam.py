"""The one-pass host AdamW against torch.optim.AdamW(fused=True), bitwise, and its no-compiler fallback.

The reference is plain torch: an optimizer over fp32 parameters, gradient scale given the way
GradScaler gives it (``optimizer.grad_scale``, which torch's fused kernel divides by).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from deepshard.kernels import host_adam

BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1


def reference(p0: torch.Tensor, grads: list[torch.Tensor], scales: list[float], lrs: list[float]):
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=lrs[0], betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    for g, s, lr in zip(grads, scales, lrs):
        p.grad = g.clone()
        opt.param_groups[0]["lr"] = lr
        opt.grad_scale = None if s == 1.0 else torch.tensor(1.0 / s)
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


def run_ours(p0, grads, scales, lrs, *, out_dtype=None, alias_out=False):
    n = p0.numel()
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    outs = []
    for step, (g, s, lr) in enumerate(zip(grads, scales, lrs), start=1):
        g = g.clone()
        out = None
        if out_dtype is not None:  # offload's layout: the cast lands in the front bytes of the grad buffer
            out = g.view(torch.uint8)[: n * 2].view(out_dtype) if alias_out else torch.empty(n, dtype=out_dtype)
        host_adam.host_adamw_(p, g, m, v, lr=lr, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
                              step=step, grad_scale=s, out=out)
        outs.append(None if out is None else out.clone())
    return p, m, v, outs


def inputs(n: int, steps: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 10 ** -k for k in range(steps)]  # shrinking grads, like training
    scales = [1.0 if k % 2 else 0.37 for k in range(steps)]
    lrs = [1e-2 * (k + 1) for k in range(steps)]
    return p0, grads, scales, lrs


def assert_bitwise(ours, ref) -> None:
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours[:3], ref):
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} of {a.numel()} differ"


@pytest.mark.parametrize("n", [5, 16, 1000, 4099, 100_003])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
def test_bitwise_equal_to_torch_fused_adamw(n, out_dtype):
    before = host_adam.calls["compiled"]
    p0, grads, scales, lrs = inputs(n)
    ours = run_ours(p0, grads, scales, lrs, out_dtype=out_dtype)
    want = reference(p0, grads, scales, lrs)
    assert_bitwise(ours, want)
    if out_dtype is not None:  # the cast written in the same pass is the final params' cast
        assert torch.equal(ours[3][-1], want[0].to(out_dtype))
    if host_adam.compiled_available() and n >= 16:
        assert host_adam.calls["compiled"] > before, "the compiled pass never ran"


@pytest.mark.parametrize("threads", [1, 2])
def test_out_in_the_grad_buffer_front(threads):
    """The cast overwrites gradients other threads may still need: the chunked order keeps it exact."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        p0, grads, scales, lrs = inputs(300_007, steps=3)
        ours = run_ours(p0, grads, scales, lrs, out_dtype=torch.bfloat16, alias_out=True)
    finally:
        torch.set_num_threads(old)
    want = reference(p0, grads, scales, lrs)
    assert_bitwise(ours, want)
    assert torch.equal(ours[3][-1], want[0].to(torch.bfloat16))


@pytest.mark.slow  # a fresh interpreter and inductor cache (~6 s)
def test_without_a_compiler_torch_serves_the_same_numbers(tmp_path):
    """No working C++ compiler (a fresh inductor cache, so nothing compiled earlier is reused)."""
    script = textwrap.dedent("""
        import torch, torch._inductor.config as cfg
        cfg.cpp.cxx = ("/nonexistent/c++",)
        from deepshard.kernels import host_adam
        n = 4099
        gen = torch.Generator().manual_seed(1)
        p, g, m, v = (torch.randn(n, generator=gen) for _ in range(4))
        m.zero_(); v.zero_()
        out = torch.empty(n, dtype=torch.bfloat16)
        host_adam.host_adamw_(p, g, m, v, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                              step=1, out=out)
        torch.save({"p": p, "m": m, "v": v, "out": out, "available": host_adam.compiled_available(),
                    "calls": dict(host_adam.calls)}, %r)
    """) % str(tmp_path / "out.pt")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
    got = torch.load(tmp_path / "out.pt")
    assert not got["available"] and got["calls"] == {"compiled": 0, "torch": 1}
    gen = torch.Generator().manual_seed(1)
    p0, g = torch.randn(4099, generator=gen), torch.randn(4099, generator=gen)
    want = reference(p0, [g], [1.0], [1e-2])
    assert_bitwise((got["p"], got["m"], got["v"]), want)
    assert torch.equal(got["out"], want[0].to(torch.bfloat16))
