"""Shared by the MoE tests: tiny random Qwen3-MoE and Mixtral models made by transformers' own
config classes (fp32): 3 layers, 5 experts, top-2; Qwen3-MoE with layer 1 dense (``mlp_only_layers``)
and ``norm_topk_prob``; router weights large enough that the routing varies across tokens."""

from __future__ import annotations

import torch

from tests.models.hf_refs import COMMON

FAMILIES = ("qwen3_moe", "mixtral")
# the in-process parity tests also cover Qwen2-MoE: 6 layers, decoder_sparse_step=2 (layers 1, 3, 5 sparse),
# mlp_only_layers=[3] (so 1 and 5), a shared expert with its sigmoid gate, norm_topk_prob off
PARITY_FAMILIES = (*FAMILIES, "qwen2_moe")
COEF = 0.02


def moe_hf_config(family: str):
    """transformers' own config class: 3 layers, 5 experts, top-2; Qwen3-MoE with layer 1 dense."""
    import transformers as tf

    # pad_token_id=None: transformers' embedding then has no padding_idx.  With one, the pad row's gradient
    # is zeroed there; ours (no padding_idx, like every family here) trains it, which shows under the aux
    # loss, whose statistics count padded positions when no attention mask is given.
    kw = {**COMMON, "num_hidden_layers": 3, "num_experts_per_tok": 2, "router_aux_loss_coef": COEF,
          "pad_token_id": None}
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**kw, head_dim=16, num_experts=5, moe_intermediate_size=20, norm_topk_prob=True,
                                 mlp_only_layers=[1])
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**{**kw, "num_hidden_layers": 6}, num_experts=5, moe_intermediate_size=20,
                                 shared_expert_intermediate_size=24, norm_topk_prob=False, decoder_sparse_step=2,
                                 mlp_only_layers=[3])
    return tf.MixtralConfig(**kw, num_local_experts=5)


def moe_hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """Seeded, fp32; router weights large (varied routing) and norms off one (a misplaced one shows)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_hf_config(family), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()
