"""Document masking: the flex BlockMask path (used on CUDA) computes what the dense-mask SDPA path does.

The oracle is written here with plain torch: per row, every document attends causally on its own
(softmax over its earlier positions only).  flex_attention runs on CPU unfused and without
backward (torch 2.13), so its checks here are forward-only under no_grad; on CUDA the same
BlockMask goes to the compiled kernel (bench/gpu_check.sh trains through it).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_mask

from deepshard.finetune.models import attention
from deepshard.finetune.models.attention import (
    attend,
    build_doc_mask,
    doc_causal_mask,
    document_causal_mask_mod,
    use_flex,
)
from deepshard.finetune.models.llama import Llama, LlamaConfig


def packed_doc_ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Rows of consecutive documents of random lengths, some crossing 128-position blocks, one a single doc."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(batch):
        ids, doc = [], 0
        while len(ids) < seq:
            n = seq if r == 0 else int(torch.randint(1, 200, (1,), generator=g))
            ids += [doc] * n
            doc += 1
        rows.append(ids[:seq])
    return torch.tensor(rows)


def reference(q, k, v, doc_ids):
    """Each document alone: plain softmax attention over its own prefix, GQA by head groups."""
    b, hq, s, d = q.shape
    rep = hq // k.shape[1]
    out = torch.zeros_like(q)
    for i in range(b):
        for doc in doc_ids[i].unique():
            pos = (doc_ids[i] == doc).nonzero().flatten()
            for h in range(hq):
                qq, kk, vv = q[i, h, pos], k[i, h // rep, pos], v[i, h // rep, pos]
                scores = qq @ kk.T / math.sqrt(d)
                scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
                out[i, h, pos] = scores.softmax(-1) @ vv
    return out


@pytest.mark.parametrize("seq", [300, 256])
def test_block_mask_equals_dense_mask(seq):
    doc_ids = packed_doc_ids(3, seq, seed=seq)
    dense = doc_causal_mask(doc_ids)
    assert torch.equal(create_mask(document_causal_mask_mod(doc_ids), 3, 1, seq, seq), dense)
    block = build_doc_mask(doc_ids, fused=True)
    assert isinstance(block, BlockMask)
    assert torch.equal(create_mask(block.mask_mod, 3, 1, seq, seq), dense)
    assert block.sparsity() > 0  # blocks no document spans are skipped, not masked


@torch.no_grad()
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2)])
def test_flex_path_equals_dense_sdpa_and_reference(hq, hkv):
    b, s, d = 3, 300, 16
    g = torch.Generator().manual_seed(hq)
    q, k, v = torch.randn(b, hq, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g), \
        torch.randn(b, hkv, s, d, generator=g)
    doc_ids = packed_doc_ids(b, s, seed=hkv)
    fused = attend(q, k, v, build_doc_mask(doc_ids, fused=True))
    dense = attend(q, k, v, build_doc_mask(doc_ids, fused=False))
    want = reference(q, k, v, doc_ids)
    torch.testing.assert_close(dense, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-5)


def test_flex_is_chosen_on_cuda_with_fused_kernels_only():
    assert use_flex(torch.device("cuda", 0), "triton")
    assert not use_flex(torch.device("cuda", 0), "torch")  # kernels=torch: the exact reference path
    assert not use_flex(torch.device("cpu"), "triton")  # TRITON_INTERPRET on CPU: flex has no CPU backward


@torch.no_grad()
def test_model_logits_same_through_either_mask(monkeypatch):
    cfg = LlamaConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=320)
    model = Llama(cfg)
    model.init_weights(seed=1)
    ids = torch.randint(0, 97, (2, 300), generator=torch.Generator().manual_seed(0))
    doc_ids = packed_doc_ids(2, 300, seed=5)
    dense = model(ids, doc_ids=doc_ids)
    monkeypatch.setattr("deepshard.finetune.models.llama.model.use_flex", lambda device, backend: True)
    seen = []
    real = attention.attend
    monkeypatch.setattr("deepshard.finetune.models.llama.model.attend",
                        lambda q, k, v, mask=None, **kw: seen.append(type(mask)) or real(q, k, v, mask, **kw))
    fused = model(ids, doc_ids=doc_ids)
    assert seen == [BlockMask] * cfg.n_layers  # one mask, built once, reaches every layer
    torch.testing.assert_close(fused, dense, rtol=1e-4, atol=1e-4)
