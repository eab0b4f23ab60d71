"""Tiled LM head + loss and tiled embedding on one rank, against plain torch written here (fp32, 1e-5):
odd vocabularies whose last tile is partial, ignored labels, both reductions, token chunks smaller
than the batch.  The world-2 (Shard(0) over gloo) half is tests/offload/test_tiled_vocab_world2.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepshard.core.zero.tiled_vocab import tiled_embedding, tiled_linear_cross_entropy


def _data(n: int, h: int, v: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.3
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = -100  # prompt tokens / padding
    return hidden, weight, targets


@pytest.mark.parametrize("vocab,tile,chunk,reduction", [(1001, 100, 7, "mean"), (1001, 4096, 1024, "sum"),
                                                       (997, 333, 16, "mean")])
def test_tiled_head_loss_matches_torch(vocab: int, tile: int, chunk: int, reduction: str) -> None:
    hidden, weight, targets = _data(37, 24, vocab)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy(h1 @ w1.t(), targets, ignore_index=-100, reduction=reduction)
    ref.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got = tiled_linear_cross_entropy(h2, w2, targets, reduction=reduction, tile_size=tile, chunk_size=chunk)
    (got * 1.7).backward()  # a non-unit incoming gradient
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h2.grad, h1.grad * 1.7, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w2.grad, w1.grad * 1.7, rtol=1e-5, atol=1e-5)


def test_tiled_head_no_grad_and_all_ignored() -> None:
    hidden, weight, targets = _data(9, 8, 1001)
    with torch.no_grad():
        got = tiled_linear_cross_entropy(hidden, weight, targets, tile_size=64)
    torch.testing.assert_close(got, F.cross_entropy(hidden @ weight.t(), targets), rtol=1e-5, atol=1e-5)
    w = weight.clone().requires_grad_()
    loss = tiled_linear_cross_entropy(hidden, w, torch.full_like(targets, -100), reduction="sum", tile_size=64)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(w.grad) == 0


@pytest.mark.parametrize("vocab,tile", [(1001, 100), (1001, 5000), (13, 4)])
def test_tiled_embedding_matches_torch(vocab: int, tile: int) -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(vocab, 16, generator=g)
    ids = torch.randint(0, vocab, (3, 11), generator=g)
    ids[0, :4] = ids[1, 0]  # repeated ids accumulate their gradients
    grad_out = torch.randn(3, 11, 16, generator=g)
    w1, w2 = weight.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.embedding(ids, w1)
    ref.backward(grad_out)
    got = tiled_embedding(ids, w2, tile_size=tile)
    got.backward(grad_out)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-5, atol=1e-5)


def test_tiled_bad_arguments_name_the_value() -> None:
    hidden, weight, targets = _data(4, 8, 11)
    with pytest.raises(ValueError, match="tile_size=0"):
        tiled_linear_cross_entropy(hidden, weight, targets, tile_size=0)
    with pytest.raises(ValueError, match="reduction='none'"):
        tiled_linear_cross_entropy(hidden, weight, targets, reduction="none")
    with pytest.raises(ValueError, match="grad_reduce='max'"):
        tiled_embedding(targets.clamp(min=0), weight, grad_reduce="max")
