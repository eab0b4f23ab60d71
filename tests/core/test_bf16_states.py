"""bf16 optimizer states (optim.state_dtype=bf16): stochastic rounding keeps updates below half an ulp,
and the store's state bytes halve, counted from the storages it holds."""

from __future__ import annotations

import torch

from deepshard.core.state_store import DeviceStateStore
from deepshard.core.update_rule import AdamW

LR, STEPS = 1e-3, 200


def _store(state_dtype: torch.dtype, params: list[torch.Tensor]) -> DeviceStateStore:
    return DeviceStateStore(params, [0.0] * len(params), AdamW(betas=(0.9, 0.95), state_dtype=state_dtype))


def test_updates_below_half_an_ulp_still_move_the_weight():
    # a bf16 weight of 1.0 has an ulp of 2**-7: an Adam step of lr=1e-3 is a quarter of one
    w = torch.ones(4096, dtype=torch.bfloat16)
    store = _store(torch.bfloat16, [w])
    # plain bf16, written here: the step in fp32, then rounded to nearest into the bf16 weight
    plain = torch.ones(4096, dtype=torch.bfloat16)
    m, v = torch.zeros(4096), torch.zeros(4096)
    exact = torch.ones(4096)
    for step in range(1, STEPS + 1):
        grad = torch.full((4096,), 0.5)
        store.step([grad.clone()], lr=LR, step=step)
        m.lerp_(grad, 0.1)
        v.lerp_(grad * grad, 0.05)
        delta = LR * (m / (1 - 0.9 ** step)) / ((v / (1 - 0.95 ** step)).sqrt() + 1e-8)
        plain = (plain.float() - delta).bfloat16()
        exact -= delta
    assert torch.equal(plain, torch.ones_like(plain)), "round-to-nearest should lose every step"
    assert abs(w.float().mean().item() - exact.mean().item()) < 2e-3  # exact: 1 - 0.2
    assert store.states["exp_avg"][0].dtype == torch.bfloat16


def _storage_bytes(store: DeviceStateStore, exclude: list[torch.Tensor]) -> int:
    """A census of the distinct storages the store's attributes reach, less the params' own."""
    seen, total = {t.untyped_storage().data_ptr() for t in exclude}, 0
    stack = list(vars(store).values())
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            s = x.untyped_storage()
            if s.data_ptr() not in seen and s.nbytes():
                seen.add(s.data_ptr())
                total += s.nbytes()
        elif isinstance(x, dict):
            stack += x.values()
        elif isinstance(x, (list, tuple)):
            stack += x
    return total


def test_state_bytes_halve_by_census():
    shapes = [(64, 48), (48,), (96, 64)]
    numel = sum(torch.Size(s).numel() for s in shapes)
    census = {}
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.randn(s).bfloat16() for s in shapes]  # bf16 compute params (stages 0-2 shards)
        store = _store(dtype, params)
        census[dtype] = _storage_bytes(store, params)
    # fp32 states: master 4 + exp_avg 4 + exp_avg_sq 4 bytes per element; bf16: the bf16 param is the
    # master (DeepSpeed's bf16 states come with bf16 masters) and the two moments take 2 + 2
    assert census[torch.float32] == 12 * numel
    assert census[torch.bfloat16] == 4 * numel
    moments = {d: census[d] - (4 * numel if d == torch.float32 else 0) for d in census}
    assert moments[torch.bfloat16] * 2 == moments[torch.float32]
