"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention), nanoGPT-direct.

The families that are this decoder with a switch share it (``models/<family>/`` holds their config
and HF adapter): q/k/v biases (Qwen2), an RMSNorm per q/k head before RoPE (Qwen3), a sliding
attention window (Mistral), an explicit ``head_dim`` (Qwen3, Mistral), Llama 3.1's ``llama3`` RoPE
scaling and tied embeddings (Llama 3.2).

Its norm, rotary, SwiGLU and loss run through ``deepshard.kernels``: ``kernels="triton"`` swaps
every one of them to the fused Triton kernels, ``"torch"`` to their exact PyTorch paths (the loss
is the chunked linear + cross-entropy either way, so the [tokens, vocab] logits never exist).

Its forward knows nothing of distribution: ZeRO, TP and pipelining are applied to it from outside,
by functions; a recipe whose layout reads the embedding or computes the head's loss its own way sets
``embed_fn``/``head_loss_fn`` (``models/parallelize.py``, ``models/vocab_tiling.py``).  One thing is
distribution-aware on purpose, its init: it writes each weight through core's ``copy_global`` (a
DTensor gets its own shard of the global tensor), so a ZeRO-3 or TP model built on the meta device
(each rank holding only its shards) gets exactly the single-process weights.
Module names follow HF Llama (``embed_tokens``, ``layers.N.self_attn.q_proj``, ...), so HF
checkpoints map onto it by adding or removing the ``model.`` prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepshard.core.dtensor_utils import copy_global
from deepshard.core.parallelize import IGNORE_INDEX
from deepshard.finetune.models.attention import (
    DocMask,
    attend,
    build_doc_mask,
    ulysses_heads,
    ulysses_tokens,
    use_flex,
)
from deepshard.finetune.models.tiled_mlp import tiled_mlp
from deepshard.kernels import RMSNorm, apply_rotary, linear_cross_entropy, swiglu


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 2048
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_hidden: int = 704
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    kernels: str = "torch"  # resolved backend: torch | triton
    loss_chunk_size: int = 1024  # tokens per chunk of the fused linear + cross-entropy; 0: plain logits
    vocab_tile_size: int = -1  # ZeRO-3: embedding/head in tiles of this many vocab rows (-1 auto, 0 off)
    mlp_tiles: int = 1  # the MLP in this many sequence tiles, recomputed per tile in backward (models/tiled_mlp.py)
    head_dim: int = 0  # per attention head; 0: dim / n_heads
    qkv_bias: bool = False  # biases on q/k/v (not o): Qwen2
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE: Qwen3
    sliding_window: int = 0  # > 0: a position attends to itself and the sliding_window - 1 before it (Mistral)
    # Llama 3.1's rope_type=llama3: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_scaling: tuple[float, ...] = ()
    rotary_dim: int = 0  # RoPE on the first rotary_dim of each head, the rest passed through (Phi-4-mini); 0: all
    # Phi-3's rope_type=longrope: a factor per frequency dividing it, the short set for rows of at most
    # rope_original_max positions, the long set beyond (chosen per forward, as HF does); cos/sin x attention factor
    rope_short_factor: tuple[float, ...] = ()
    rope_long_factor: tuple[float, ...] = ()
    rope_original_max: int = 0
    rope_attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.head_dim < 0:
            raise ValueError(f"model.head_dim={self.head_dim}: must be >= 0 (0: model.dim / model.n_heads)")
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ValueError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)  # frozen: resolved once, here
        object.__setattr__(self, "rope_scaling", tuple(float(v) for v in self.rope_scaling))
        if self.rope_scaling and (len(self.rope_scaling) != 4 or self.rope_scaling[2] <= self.rope_scaling[1]):
            raise ValueError(f"model.rope_scaling={list(self.rope_scaling)}: expected [factor, low_freq_factor, "
                             "high_freq_factor, original_max_position_embeddings] with high > low, or []")
        self._check_rotary()
        if self.sliding_window < 0:
            raise ValueError(f"model.sliding_window={self.sliding_window}: must be >= 0 (0: full attention)")
        if self.loss_chunk_size < 0:
            raise ValueError(f"model.loss_chunk_size={self.loss_chunk_size}: must be >= 0 (0: plain logits)")
        if self.vocab_tile_size < -1:
            raise ValueError(f"model.vocab_tile_size={self.vocab_tile_size}: must be -1 (auto), 0 (off) or "
                             "rows per tile")
        if self.mlp_tiles < 1:
            raise ValueError(f"model.mlp_tiles={self.mlp_tiles}: must be >= 1 (1: untiled)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}")

    def _check_rotary(self) -> None:
        """Partial rotary and longrope's factors, resolved and checked (frozen: once, here)."""
        if self.rotary_dim == 0:
            if self.head_dim % 2:
                raise ValueError(f"model.dim={self.dim} / model.n_heads={self.n_heads}: head_dim {self.head_dim} is odd; "
                                 "RoPE rotates pairs of dimensions, so head_dim must be even")
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"model.rotary_dim={self.rotary_dim}: must be even and in [2, head_dim={self.head_dim}] "
                             "(0: head_dim)")
        for key in ("rope_short_factor", "rope_long_factor"):
            object.__setattr__(self, key, tuple(float(v) for v in getattr(self, key)))
        if not (self.rope_short_factor or self.rope_long_factor or self.rope_original_max):
            return
        half = self.rotary_dim // 2
        if len(self.rope_short_factor) != half or len(self.rope_long_factor) != half:
            raise ValueError(f"model.rope_short_factor/rope_long_factor: longrope needs {half} factors each "
                             f"(rotary_dim / 2), got {len(self.rope_short_factor)} and {len(self.rope_long_factor)}")
        if self.rope_original_max < 1 or self.rope_scaling:
            raise ValueError(f"model.rope_original_max={self.rope_original_max}: longrope needs it >= 1, and no "
                             f"model.rope_scaling (got {list(self.rope_scaling)})")


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: float) -> torch.Tensor:
    """Llama 3.1's frequency scaling (Meta's reference): wavelengths longer than original/low are
    stretched by ``factor``, shorter than original/high kept, and the band between interpolated."""
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def rope_cache(cfg: LlamaConfig, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's convention: cos/sin of shape [seq, rotary_dim] with the two halves duplicated; under
    longrope [2, seq, rotary_dim], the short factors' tables then the long ones' (:func:`rope_rows`)."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, device=device).float() / dim))
    if cfg.rope_scaling:
        inv_freq = llama3_inv_freq(inv_freq, *cfg.rope_scaling)
    sets = [inv_freq]
    if cfg.rope_original_max:
        sets = [inv_freq / torch.tensor(f, device=device) for f in (cfg.rope_short_factor, cfg.rope_long_factor)]
    emb = [torch.outer(torch.arange(seq_len, device=device).float(), f) for f in sets]
    emb = torch.stack([torch.cat([e, e], dim=-1) for e in emb]).squeeze(0)
    return emb.cos() * cfg.rope_attention_factor, emb.sin() * cfg.rope_attention_factor


def rope_rows(cos: torch.Tensor, sin: torch.Tensor, seq: int, long_after: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables' first ``seq`` rows; under longrope (3-d tables) the long factors' when the row is
    longer than ``long_after`` positions, else the short ones' (HF picks by the forward's length too)."""
    if cos.dim() == 3:
        cos, sin = cos[int(seq > long_after)], sin[int(seq > long_after)]
    return cos[:seq], sin[:seq]


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.kernels = cfg.kernels
        self.sp_group = None  # Ulysses sequence parallelism's group, set from outside (models/ulysses.py)
        self.window = cfg.sliding_window
        self.long_after = cfg.rope_original_max
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, backend=cfg.kernels) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, backend=cfg.kernels) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: DocMask | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:  # per head, before RoPE (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.sp_group is not None:  # whole sequences for heads/sp heads; RoPE then sees global positions
            q, k, v = ulysses_heads(q, k, v, self.sp_group)
        cos, sin = rope_rows(cos, sin, q.shape[2], self.long_after)
        r = cos.shape[-1]
        if r < self.head_dim:  # partial rotary: the rest of each head passes through
            (q, q_pass), (k, k_pass) = q.split([r, self.head_dim - r], -1), k.split([r, self.head_dim - r], -1)
        q, k = apply_rotary(q, k, cos.to(q.dtype), sin.to(q.dtype), backend=self.kernels)
        if r < self.head_dim:
            q, k = torch.cat([q, q_pass], -1), torch.cat([k, k_pass], -1)
        out = attend(q, k, v, mask, window=self.window)  # causal; inside documents with a mask (flex on CUDA, dense SDPA else)
        if self.sp_group is not None:
            out = ulysses_tokens(out, self.sp_group)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.kernels = cfg.kernels
        self.tiles = cfg.mlp_tiles

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), backend=self.kernels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles > 1:  # one tile's [tokens, ffn_hidden] at a time
            return tiled_mlp(self._mlp, x, self.tiles, [p for p in self.parameters() if p.requires_grad])
        return self._mlp(x)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, backend=cfg.kernels)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, backend=cfg.kernels)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: DocMask | None = None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    """``forward(input_ids, labels=None, doc_ids=None, reduction="mean")``: the loss over labels != -100
    (``reduction="sum"``: the summed token loss, which the engine divides by the step's global
    valid-token count), else the logits.

    ``labels`` are already aligned with the positions (``labels[t]`` is the token after ``t``).
    ``doc_ids`` ([batch, seq], the document of each position) keeps attention inside documents of
    a packed row; RoPE is relative, so a document then computes exactly as if it stood alone.
    Any of ``embed_tokens``, ``norm``/``lm_head`` may be None (a pipeline stage drops them).
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, backend=cfg.kernels)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_cache(cfg, cfg.max_seq_len, torch.device("cpu"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Seams a parallelize recipe fills where its layout reads the embedding or computes the head's
        # loss its own way (vocabulary tiling, a vocabulary-sharded TP head); None: the modules' own
        # forward and the fused chunked loss.  This file stays ignorant of the layouts.
        self.embed_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.head_loss_fn: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor] | None = None

    @torch.no_grad()
    def init_weights(self, seed: int = 0, *, weights: bool = True) -> None:
        """GPT-2/Llama-style init (normal 0.02, residual projections scaled by depth), seeded.
        ``weights=False``: the buffers only (a checkpoint writes every weight next; drawing
        whole random tensors first would be the load's host peak)."""
        g = torch.Generator().manual_seed(seed)
        std = 0.02
        for name, p in self.named_parameters() if weights else ():
            if ".lora_" in name:  # LoRA adapters (models/lora.py) have their own init: the base's stays as is
                continue
            if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "norm.weight":
                p.fill_(1.0)
                continue
            if name.endswith(".bias"):  # as HF inits them
                p.zero_()
                continue
            s = std / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            copy_global(p, torch.randn(p.shape, generator=g) * s)
        cos, sin = rope_cache(self.cfg, self.cfg.max_seq_len, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
        h = input_ids
        if self.embed_tokens is not None:
            h = self.embed_tokens(input_ids) if self.embed_fn is None else self.embed_fn(input_ids)
        # one mask per forward, shared by every layer: a flex BlockMask on CUDA, the dense one elsewhere
        extra = () if doc_ids is None else (
            build_doc_mask(doc_ids, fused=use_flex(doc_ids.device, self.cfg.kernels), window=self.cfg.sliding_window),)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin, *extra)
        if self.lm_head is None:
            return h
        h = self.norm(h)
        if labels is not None and self.head_loss_fn is not None:
            return self.head_loss_fn(h, labels, reduction)
        if labels is None or self.cfg.loss_chunk_size == 0:  # logits wanted, or the fused loss switched off
            logits = self.lm_head(h)
            if labels is None:
                return logits
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction=reduction)
        return linear_cross_entropy(h.flatten(0, 1), self.lm_head.weight, labels.flatten(),
                                    ignore_index=IGNORE_INDEX, reduction=reduction,
                                    chunk_size=self.cfg.loss_chunk_size, backend=self.cfg.kernels)


PRESETS = {
    "tiny": LlamaConfig(),  # ~5.5M parameters
    "small": LlamaConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_hidden=2816),  # ~100M
}
