"""``model.mlp_tiles``: the MLP in sequence tiles computes what the untiled MLP computes, and keeps
less for backward.

Reference: the same Llama with ``mlp_tiles=1`` (plain autograd through the MLP).  Each tile computes
the untiled rows, but the BLAS may pick another kernel (another summation order inside a dot product)
for fewer rows: on this CPU 5 tiles of 8 rows differ in the last bit, 3 or 7 tiles do not; and
gradients are the same sums taken tile by tile.  So: within 1e-6, not bit for bit.  Memory: the bytes autograd saves in forward, counted with
saved-tensor hooks, drop by the MLP's [tokens, ffn_hidden] intermediates.  Single process, ~3 s.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepshard.finetune.models.llama import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=256, max_seq_len=64,
                  loss_chunk_size=0)


def _run(tiles: int, ids: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor):
    torch.manual_seed(0)
    m = Llama(dataclasses.replace(CFG, mlp_tiles=tiles))
    m.init_weights(0)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = m(ids, labels, doc_ids=doc_ids, reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}, sum(saved)


@pytest.mark.parametrize("tiles", [3, 7])  # 3 does not divide the 2 x 48 tokens; 7 tiles of 13-14
def test_tiled_mlp_matches_untiled_and_saves_less(tiles):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (2, 48), generator=g)
    labels = torch.randint(0, CFG.vocab_size, (2, 48), generator=g)
    labels[:, :10] = -100  # a masked prompt
    doc_ids = (torch.arange(48) >= 20).long().expand(2, 48)  # two documents per row
    loss, grads, saved = _run(1, ids, labels, doc_ids)
    loss_t, grads_t, saved_t = _run(tiles, ids, labels, doc_ids)
    assert torch.allclose(loss_t, loss, rtol=1e-6, atol=0)
    for n, g_ref in grads.items():
        assert torch.allclose(grads_t[n], g_ref, rtol=1e-6, atol=1e-7), n
    # the untiled MLP saves gate, up, and their SwiGLU product: 3 x [tokens, ffn_hidden] fp32 per layer
    mlp_bytes = 3 * ids.numel() * CFG.ffn_hidden * 4 * CFG.n_layers
    assert saved - saved_t >= 0.9 * mlp_bytes, (saved, saved_t, mlp_bytes)


def test_tiled_mlp_without_grad_matches_the_untiled_forward():
    ids = torch.randint(0, CFG.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    plain, tiled = Llama(CFG), Llama(dataclasses.replace(CFG, mlp_tiles=5))
    plain.init_weights(0)
    tiled.init_weights(0)
    with torch.no_grad():
        assert torch.allclose(tiled(ids), plain(ids), rtol=1e-6, atol=1e-7)
