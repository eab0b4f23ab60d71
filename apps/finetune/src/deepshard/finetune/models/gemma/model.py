"""Gemma 2 and Gemma 3 as one decoder of their own (not the Llama decoder with switches: its block,
norm, activation, attention and head all differ), written from the papers' and HF's definitions.

What sets it apart from Llama: the embedding is scaled by sqrt(dim) (in the embedding's dtype, as HF
does); every RMSNorm multiplies by (1 + w) in fp32 (its weight starts at zero); each block has four
norms (before and after attention, before and after the MLP); the MLP is GeGLU (tanh-approximated
GELU); attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` and may be soft-capped
(``cap * tanh(s / cap)``); layers are sliding (a window) or global by ``layer_types``, Gemma 3's
with a RoPE base of their own (``rope_local_theta``) and global layers' RoPE optionally stretched
linearly; Gemma 3 normalizes each q and k head; the logits may be soft-capped too.  The head is the
embedding (Gemma ties them always), so there is no ``lm_head`` module: under TP the embedding is
vocabulary-sharded and the head reads the same shard (see ``_logits``).  A pipeline names it
``lm_head`` (:func:`add_head_module`) so that the last stage holds its own copy.

The final soft-cap is applied inside the chunked loss (``softcap_cross_entropy``: each chunk's
logits capped, then its cross-entropy, recomputed in backward), so the [tokens, vocab] logits never
exist with it on either; with it off the chunked loss is ``deepshard.kernels``' fused one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from deepshard.core.dtensor_utils import copy_global
from deepshard.core.parallelize import IGNORE_INDEX
from deepshard.finetune.models.attention import (
    DocMask,
    attend,
    build_doc_mask,
    ulysses_heads,
    ulysses_tokens,
    use_flex,
    window_mask,
)
from deepshard.finetune.models.llama.model import LlamaConfig
from deepshard.finetune.models.tiled_mlp import tiled_mlp
from deepshard.kernels import apply_rotary, linear_cross_entropy

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    """LlamaConfig's fields (what the generic machinery reads) plus Gemma's; ``qkv_bias`` and
    ``rope_scaling`` stay off, ``tie_embeddings`` on."""

    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    sliding_window: int = 4096  # for the sliding layers only
    query_pre_attn_scalar: float = 256.0  # scores scaled by its -1/2 power (not head_dim's)
    attn_softcap: float = 0.0  # > 0: scores -> cap * tanh(scores / cap) (Gemma 2: 50)
    final_softcap: float = 0.0  # > 0: logits -> cap * tanh(logits / cap) (Gemma 2: 30)
    layer_types: tuple[str, ...] = ()  # () -> every ``sliding_pattern``-th layer global, the rest sliding
    sliding_pattern: int = 2
    rope_local_theta: float = 10000.0  # the sliding layers' RoPE base (Gemma 2: equal to rope_theta)
    rope_factor: float = 1.0  # the global layers' linear RoPE scaling (Gemma 3 4B and up: 8)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.layer_types:
            kinds = tuple(SLIDING if (i + 1) % self.sliding_pattern else FULL for i in range(self.n_layers))
            object.__setattr__(self, "layer_types", kinds)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.n_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"model.layer_types={list(self.layer_types)}: expected {self.n_layers} entries, "
                             f"each {SLIDING!r} or {FULL!r}")
        for key, off in (("qkv_bias", False), ("rope_scaling", ()), ("tie_embeddings", True)):
            if getattr(self, key) != off:
                raise ValueError(f"model.{key}={getattr(self, key)!r}: Gemma's must be {off!r}")
        for key in ("attn_softcap", "final_softcap"):
            if getattr(self, key) < 0:
                raise ValueError(f"model.{key}={getattr(self, key)}: must be >= 0 (0: off)")
        if self.query_pre_attn_scalar <= 0 or self.rope_factor <= 0:
            raise ValueError(f"model.query_pre_attn_scalar={self.query_pre_attn_scalar}, model.rope_factor="
                             f"{self.rope_factor}: both must be > 0")


def rope_tables(cfg: GemmaConfig, seq_len: int, device: torch.device, *, sliding: bool) -> torch.Tensor:
    """[2, seq, head_dim]: cos and sin (HF's rotate-half halves duplicated) of one kind of layer."""
    theta, factor = (cfg.rope_local_theta, 1.0) if sliding else (cfg.rope_theta, cfg.rope_factor)
    inv_freq = 1.0 / (theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim)) / factor
    freqs = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return torch.stack([emb.cos(), emb.sin()])


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), computed in fp32 and cast back (HF's order: not Llama's)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                      window: int, scale: float, cap: float) -> torch.Tensor:
    """Causal attention whose scores are soft-capped (the math path: no fused kernel takes the cap);
    ``mask``: the dense document mask or None; ``window`` > 0 limits how far back a position sees."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q.shape[2]
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    scores = torch.tanh(scores / cap) * cap
    keep = window_mask(s, window or s, q.device)
    if mask is not None:
        keep = keep & mask
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")).float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


class Attention(nn.Module):
    def __init__(self, cfg: GemmaConfig, sliding: bool) -> None:
        super().__init__()
        self.head_dim, self.kernels = cfg.head_dim, cfg.kernels
        self.sp_group = None  # Ulysses' group, set from outside (models/ulysses.py)
        self.window = cfg.sliding_window if sliding else 0
        self.scale, self.cap = cfg.query_pre_attn_scalar ** -0.5, cfg.attn_softcap
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocMask | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim)  # -1 heads: a tp rank's share
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:  # per head, before RoPE (Gemma 3)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.sp_group is not None:
            q, k, v = ulysses_heads(q, k, v, self.sp_group)
        n = q.shape[2]
        q, k = apply_rotary(q, k, rope[0, :n].to(q.dtype), rope[1, :n].to(q.dtype), backend=self.kernels)
        if self.cap:
            out = softcap_attention(q, k, v, mask, window=self.window, scale=self.scale, cap=self.cap)
        else:  # the fused kernels scale by head_dim ** -1/2: fold the rest of the scale into q
            out = attend(q * (self.scale * math.sqrt(self.head_dim)), k, v, mask, window=self.window)
        if self.sp_group is not None:
            out = ulysses_tokens(out, self.sp_group)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.tiles = cfg.mlp_tiles

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:  # GeGLU, HF's gelu_pytorch_tanh
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles > 1:
            return tiled_mlp(self._mlp, x, self.tiles, [p for p in self.parameters() if p.requires_grad])
        return self._mlp(x)


class Block(nn.Module):
    def __init__(self, cfg: GemmaConfig, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        self.input_layernorm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg, sliding)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocMask | None = None) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, mask))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def softcap_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, cap: float,
                          chunk_size: int, reduction: str) -> torch.Tensor:
    """Cross-entropy of ``cap * tanh(h @ weight.T / cap)`` over labels != -100, ``chunk_size`` tokens
    at a time, each chunk's logits recomputed in backward (never all of them at once)."""
    def chunk_loss(hc: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
        logits = (hc @ weight.t()).float()
        return F.cross_entropy(torch.tanh(logits / cap) * cap, yc, ignore_index=IGNORE_INDEX, reduction="sum")

    total = sum(checkpoint(chunk_loss, h[i:i + chunk_size], labels[i:i + chunk_size], use_reentrant=False)
                for i in range(0, h.shape[0], chunk_size))
    return total if reduction == "sum" else total / (labels != IGNORE_INDEX).sum().clamp(min=1)


class Gemma(nn.Module):
    """``forward(input_ids, labels=None, doc_ids=None, reduction="mean")`` as Llama's: the loss over
    labels != -100 (aligned with the positions) or the (soft-capped) logits."""

    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, kind == SLIDING) for kind in cfg.layer_types)
        self.norm = GemmaRMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None  # tied: the head is embed_tokens.weight (no module, so TP cannot untie it)
        for kind in (SLIDING, FULL):
            self.register_buffer(f"rope_{kind}", rope_tables(cfg, cfg.max_seq_len, torch.device("cpu"),
                                                             sliding=kind == SLIDING), persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, *, weights: bool = True) -> None:
        """Normal 0.02 for matrices (residual projections scaled by depth), zeros for the (1 + w) norms.
        ``weights=False``: the buffers only (a checkpoint writes every weight next; drawing
        whole random tensors first would be the load's host peak)."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters() if weights else ():
            if ".lora_" in name:
                continue
            if name.endswith("norm.weight"):
                p.zero_()
                continue
            std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            copy_global(p, torch.randn(p.shape, generator=g) * std)
        for kind in (SLIDING, FULL):
            getattr(self, f"rope_{kind}").copy_(rope_tables(self.cfg, self.cfg.max_seq_len, self.rope_full_attention.device,
                                                            sliding=kind == SLIDING))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The tied head (soft-capped): under TP the embedding's vocabulary shard gives this rank's
        columns of the logits, then all-gathered (the loss then sees every rank's vocabulary), as a
        column-parallel head does."""
        w = self.head_weight()
        if isinstance(w, DTensor):  # h enters as Replicate: its gradient is summed over the vocabulary shards
            hd = DTensor.from_local(h, w.device_mesh, [Replicate()], run_check=False)
            logits = torch.matmul(hd, w.t()).full_tensor()
        else:
            logits = h @ w.t()
        cap = self.cfg.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def head_weight(self) -> torch.Tensor:
        """The tied head's weight: the embedding's, or on a pipeline's last stage (no embedding) its own
        copy of it (``lm_head``, :func:`add_head_module`)."""
        return self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
        """A pipeline stage without the embedding takes hidden states as ``input_ids`` (the scale was
        applied on the first stage); one without the final norm returns hidden states."""
        if self.embed_tokens is None:
            h = input_ids
        else:
            h = self.embed_tokens(input_ids)
            h = h * h.new_tensor(self.cfg.dim ** 0.5)  # the scale rounded to the embedding's dtype first, as HF
        masks = {SLIDING: None, FULL: None}
        if doc_ids is not None:  # flex (CUDA) holds the window in its BlockMask; not with soft-capped scores
            fused = use_flex(doc_ids.device, self.cfg.kernels) and not self.cfg.attn_softcap
            masks = {kind: build_doc_mask(doc_ids, fused=fused, window=self.cfg.sliding_window if kind == SLIDING else 0)
                     for kind in set(self.cfg.layer_types)}
        for layer in self.layers:
            kind = SLIDING if layer.sliding else FULL
            h = layer(h, getattr(self, f"rope_{kind}"), masks[kind])
        if self.norm is None:
            return h
        h = self.norm(h)
        w = self.head_weight()
        if labels is None or self.cfg.loss_chunk_size == 0 or isinstance(w, DTensor):
            logits = self._logits(h)
            if labels is None:
                return logits
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction=reduction)
        if self.cfg.final_softcap:
            return softcap_cross_entropy(h.flatten(0, 1), w, labels.flatten(), cap=self.cfg.final_softcap,
                                         chunk_size=self.cfg.loss_chunk_size, reduction=reduction)
        return linear_cross_entropy(h.flatten(0, 1), w, labels.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction=reduction, chunk_size=self.cfg.loss_chunk_size, backend=self.cfg.kernels)


def add_head_module(model: Gemma) -> None:
    """Name the tied head ``lm_head`` (a module whose weight is the embedding's, no new tensor), so a
    pipeline split can give the last stage its own copy of it (``deepshard.pipeline.tied``)."""
    if model.lm_head is None:
        model.lm_head = nn.Linear(model.cfg.dim, model.cfg.vocab_size, bias=False, device="meta")
        model.lm_head.weight = model.embed_tokens.weight
