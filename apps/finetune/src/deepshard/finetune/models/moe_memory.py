"""The MoE families' activation memory (their spec's ``activation_memory``): Llama's attention per block,
a dense MLP where a layer is dense, and per sparse layer what ``models/moe.py`` keeps for backward and
the buffers its dispatch (``models/moe_ep.py``) exchanges, as ``models/working_set.py`` adds them up.

A sparse layer on ``T`` tokens routes ``R = T x top_k`` (token, slot) rows (dropless: capacity only ever
lowers it); under ``parallel.ep`` a balanced router sends and receives about ``R`` rows per rank, so the
figures below hold for every ep (the grouped GEMM's rows are the rows received).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from deepshard.core.memory import DTYPE_BYTES
from deepshard.finetune.models.llama.memory import activation_memory as llama_activation_memory
from deepshard.finetune.models.working_set import RunShape

INDEX_BYTES = 8  # int64 row indices (the sort order, the token of each row, the inverse permutation)


@dataclass(frozen=True)
class SparseLayerBytes:
    """One sparse layer's bytes for ``tokens`` tokens: ``saved`` until its backward, ``dispatch`` the
    all-to-all's send and receive buffers (0 without ep), ``transient`` the most its backward adds."""

    saved: int
    dispatch: int
    transient: int


def sparse_layer_bytes(*, tokens: int, top_k: int, num_experts: int, dim: int, hidden: int, dtype: str,
                       ep: int = 1, routing: str = "softmax_topk", norm_topk_prob: bool = False,
                       shared_hidden: int = 0) -> SparseLayerBytes:
    """Saved for backward (``R = tokens x top_k`` rows; a census of the tensors autograd keeps agrees, to
    the byte, summed over an ep group: tests/models/test_moe_ep.py): the router's fp32 probabilities
    (the balance statistics', and softmax_topk's routing ones, with its renormalized top-k weights and
    their sum), the top-k ids (int64) and the token mask; per row the expert GEMM's input, the rows back
    from the experts and the weighted rows ``index_add_`` takes, [R, dim] each, ``gate_up``'s output
    [R, 2 x hidden], silu(gate) and the product [R, hidden] each, two int64 row indices and the routing
    weight; the local experts' group offsets (int32); under ep two int64 permutations more (to the experts' order and back).
    The dispatch: one layer's all-to-all send and receive buffers, [R, dim] each, in forward (and their
    gradients' in backward).  Backward's transient: the ``gate_up`` gradient [R, 2 x hidden] beside the
    output's [R, dim] (two under ep: before and after the exchange).  Qwen2-MoE's shared expert keeps a
    dense SwiGLU's tensors and its gate."""
    b, rows = DTYPE_BYTES[dtype], tokens * top_k
    router = tokens * num_experts * 4 + tokens * top_k * INDEX_BYTES + tokens * 4  # balance probs, ids, mask
    if routing == "softmax_topk":
        router += tokens * num_experts * 4 + (tokens * (top_k + 1) * 4 if norm_topk_prob else 0)
    else:  # topk_softmax: the softmax over the k logits
        router += tokens * top_k * 4
    saved = router + rows * b * (3 * dim + 4 * hidden) + rows * (2 * INDEX_BYTES + 4) + num_experts // ep * 4
    if ep > 1:
        saved += 2 * rows * INDEX_BYTES
    if shared_hidden:
        saved += tokens * b * (4 * shared_hidden + 1)
    dispatch = 2 * rows * dim * b if ep > 1 else 0
    return SparseLayerBytes(saved=saved, dispatch=dispatch,
                            transient=rows * b * (2 * hidden + (2 if ep > 1 else 1) * dim))


def activation_memory(cfg, s: RunShape) -> tuple[int, int, int]:
    """(device, host, transient) of one micro-batch, as Llama's (``models/llama/memory.py``) with each
    layer's MLP counted as that layer has it: a dense layer's SwiGLU of ``ffn_hidden``, a sparse layer's
    :func:`sparse_layer_bytes`.  Under ``ac`` the recomputed blocks keep only their inputs (Llama's part);
    the MLPs of the blocks that are not recomputed stay, and one layer's at most is recomputed at a time."""
    b = DTYPE_BYTES[s.dtype]
    tokens = s.micro_batch_size * s.seq_len
    device, host, transient = llama_activation_memory(dataclasses.replace(cfg, ffn_hidden=0), s)
    layers = []  # (saved, transient) of each layer's MLP beyond its input (Llama's part counts that)
    for i in range(cfg.n_layers):
        if cfg.sparse(i):
            m = sparse_layer_bytes(tokens=tokens, top_k=cfg.num_experts_per_tok, num_experts=cfg.num_experts,
                                   dim=cfg.dim, hidden=cfg.moe_hidden, dtype=s.dtype, ep=s.ep, routing=cfg.routing,
                                   norm_topk_prob=cfg.norm_topk_prob, shared_hidden=cfg.shared_expert_hidden)
            layers.append((m.saved, max(m.dispatch, m.transient)))
        else:
            layers.append((tokens * b * 4 * cfg.ffn_hidden, tokens * b * cfg.ffn_hidden))
    most = max((t for _, t in layers), default=0)
    if s.ac == "none":
        return device + sum(v for v, _ in layers) + most, host, transient + most
    every = int(s.ac.split("_")[1]) if s.ac.startswith("every_") else 1
    kept = sum(v for i, (v, _) in enumerate(layers) if i % every)  # (core's activation_checkpoint's choice)
    again = max((v for v, _ in layers), default=0)
    return device + kept + again + most, host, transient + again + most
