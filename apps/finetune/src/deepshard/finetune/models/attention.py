"""Causal attention, optionally kept inside the documents of a packed row (``data.doc_mask``).

A dense [batch, 1, seq, seq] boolean mask rules out flash attention (SDPA falls back to a kernel
that reads the whole mask, or to the math path that materializes the scores), and its memory
grows with seq^2.  So with CUDA and the fused kernels (``kernels=auto|triton``) document masking
runs through ``flex_attention`` (compiled: a Triton flash-style kernel) with a ``BlockMask`` built
once per forward from ``doc_ids``: blocks of 128 x 128 positions that no document spans are
skipped outright, blocks inside one document run unmasked, and only blocks on a document edge
evaluate the mask.  Everywhere else (CPU, ``kernels=torch``) the dense mask and SDPA remain the
reference path; both compute the same attention (tests/app/test_attention_docmask.py).

flex_attention has no backward on CPU in torch 2.13 (eager or compiled), hence the CUDA-only choice.

Under Ulysses sequence parallelism (``parallel.sp``) :func:`ulysses_heads` and :func:`ulysses_tokens`
surround the attention: each rank attends over whole sequences for its share of the heads, so the
masks above (built from the whole sequence's ``doc_ids``) and RoPE (global positions) apply as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from deepshard.core.sequence_parallel import expand_kv_heads, heads_to_seq, seq_to_heads
from deepshard.kernels.backend import compile_quietly

DocMask = torch.Tensor | BlockMask  # dense bool [b, 1, s, s] (SDPA) or a flex BlockMask

_compiled: dict[str, Callable] = {}


def doc_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] bool: position t sees s <= t of its own document (block-diagonal causal)."""
    s = doc_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    return (doc_ids[:, None, :, None] == doc_ids[:, None, None, :]) & causal


def window_mask(s: int, window: int, device: torch.device) -> torch.Tensor:
    """[seq, seq] bool: causal, and at most ``window - 1`` positions back (HF's sliding window)."""
    i = torch.arange(s, device=device)
    back = i[:, None] - i[None, :]
    return (back >= 0) & (back < window)


def document_causal_mask_mod(doc_ids: torch.Tensor, window: int = 0) -> Callable:
    """flex's ``mask_mod`` for :func:`doc_causal_mask`: same document and not in the future (and
    within ``window`` when it is > 0)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        keep = (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)
        return keep & (q_idx - kv_idx < window) if window > 0 else keep

    return mask_mod


def use_flex(device: torch.device, backend: str) -> bool:
    """The fused document-masked kernel: CUDA with the fused kernels on (``kernels`` resolved to triton)."""
    return device.type == "cuda" and backend == "triton"


def _fn(name: str, fn: Callable, device: torch.device) -> Callable:
    """``fn`` compiled once per process on CUDA (the fused kernel); eager elsewhere (the tests'
    no-grad CPU check, where flex runs unfused)."""
    if device.type != "cuda":
        return fn
    if name not in _compiled:
        _compiled[name] = compile_quietly(fn, dynamic=False)
    return _compiled[name]


def build_doc_mask(doc_ids: torch.Tensor, *, fused: bool, window: int = 0) -> DocMask:
    """The mask for ``doc_ids`` ([batch, seq]): a flex BlockMask when ``fused`` (holding the sliding
    ``window`` too), else the dense one (:func:`attend` adds the window)."""
    if not fused:
        return doc_causal_mask(doc_ids)
    b, s = doc_ids.shape
    make = _fn("create_block_mask", create_block_mask, doc_ids.device)
    return make(document_causal_mask_mod(doc_ids, window), b, None, s, s, device=doc_ids.device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocMask | None = None,
           window: int = 0) -> torch.Tensor:
    """Causal attention of q [b, hq, s, d] over k, v [b, hkv, s, d] (hq a multiple of hkv: GQA),
    inside documents when ``mask`` is given, within a sliding ``window`` when it is > 0 and shorter
    than the sequence (a BlockMask holds it already); returns [b, hq, s, d]."""
    if window and q.shape[2] > window and not isinstance(mask, BlockMask):  # the dense band: SDPA's mask
        band = window_mask(q.shape[2], window, q.device)
        mask = band if mask is None else mask & band
    if isinstance(mask, BlockMask):
        flex = _fn("flex_attention", flex_attention, q.device)
        return flex(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if mask is None:  # the fast path: the kernel's own causal mask (flash attention on CUDA)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def ulysses_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: ProcessGroup
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [b, hq, s/N, d], k, v [b, hkv, s/N, d] of this rank's tokens -> the whole sequence for hq/N
    heads (and their kv heads: repeated first when N does not divide hkv, so grouping stays aligned)."""
    n = group.size()
    k, v = expand_kv_heads(k, v, num_q_heads=q.shape[1], sp=n)
    return seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group)


def ulysses_tokens(out: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Attention's output [b, hq/N, s, d] back to this rank's tokens [b, hq, s/N, d]."""
    return heads_to_seq(out, group)
