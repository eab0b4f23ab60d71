"""A ds_config's ``expert_parallel`` section (DeepSpeed 0.19.8's AutoEP for HF MoE models), key by key.

DeepSpeed reads it in ``deepspeed/module_inject/auto_ep_config.py`` ``parse_autoep_config`` (the keys below
are every key that function reads) and swaps each MoE block of a HF model for its ``AutoEPMoELayer``.  Here
the MoE families are native (``qwen3_moe``, ``mixtral``, ``qwen2_moe``, from the checkpoint's config.json), so:

- ``enabled`` + ``autoep_size`` -> ``parallel.ep`` (ep groups of consecutive ranks, as AutoEP's; AutoEP runs
  ZeRO 0-2 only, ``parallel.ep`` any stage);
- routing is the checkpoint's (``top_k``, ``route_norm``, ``score_func``, ``routed_scaling_factor`` at their
  "auto"/unset values, which in DeepSpeed also mean "from the model's config"): a value that would route
  differently is refused naming the key, as are DeepSeek's group-limited and sigmoid routing, scaled or
  pre-applied scores, other expert activations, DeepEP, expert tensor parallelism, a load-balance
  coefficient (DeepSpeed 0.19.8 refuses that one too), and the module patterns for custom models;
- ``preset_model``: a family built here is noted (the family comes from config.json), another refused;
- how DeepSpeed's kernels do the same arithmetic (grouped GEMM or loop, combine, row weighting, fused
  gate/up, the split plan's host sync, DeepEP's buffers, folding validation) changes nothing: noted.

``use_data_before_expert_parallelism`` (top level, DeepSpeed's E/D rank order): false is ours; true refused.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AUTOEP_KEYS", "translate_autoep", "translate_expert_data_order"]

SECTION = "expert_parallel"
FAMILIES = ("qwen3_moe", "mixtral")  # AutoEP presets that are native families here
# implementation choices with the same arithmetic (DeepSpeed's kernels and buffers): noted, no effect
SAME_MATH = {
    "use_grouped_mm": "the local experts run as one torch._grouped_mm (model.moe_impl=loop is the reference)",
    "disable_triton_grouped_mm": "the local experts run as one torch._grouped_mm",
    "combine_impl": "the routed rows are weighted and index_add-ed back (one implementation)",
    "row_weighting_impl": "rows are weighted after the experts (one implementation)",
    "gate_up_impl": "gate and up run as one grouped GEMM on the stacked gate_up_proj",
    "async_split_plan": "the dispatch syncs the split sizes to the host once per layer",
    "validate_folding_routing": "no AutoTP folding here (parallel.tp=1 with experts)",
    "comm_num_sm": "DeepEP only", "comm_qp_margin": "DeepEP only", "comm_max_tokens_per_rank": "DeepEP only",
}
# the module patterns AutoEP finds a custom model's MoE blocks with
DISCOVERY = ("moe_layer_pattern", "expert_pattern", "router_pattern", "expert_w1", "expert_w2", "expert_w3",
             "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern",
             "shared_experts_gate_pattern")
# key -> (the values that mean "as the checkpoint's config says" / what the families do, why another is refused)
ROUTING = {
    "top_k": (("auto",), "the experts per token are the checkpoint's num_experts_per_tok"),
    "route_norm": ((None,), "top-k renormalization is the checkpoint's norm_topk_prob"),
    "score_func": (("auto", "softmax"), "the families route by softmax (sigmoid scores: DeepSeek-V3, not built)"),
    "routed_scaling_factor": (("auto", 1, 1.0), "routed outputs are not scaled (DeepSeek's factor, not built)"),
    "route_scale": ((1, 1.0), "routed outputs are not scaled"),
    "score_apply": (("auto", "post"), "scores weight the experts' outputs (post), not their inputs"),
    "num_expert_groups": ((None,), "group-limited routing (DeepSeek) is not built"),
    "num_limited_groups": ((None,), "group-limited routing (DeepSeek) is not built"),
    "load_balance_coeff": ((None,), "DeepSpeed 0.19.8 refuses it too; the aux loss is the checkpoint's "
                                    "router_aux_loss_coef"),
    "expert_activation": ((None, "swiglu"), "the experts are SwiGLU (silu gate)"),
    "expert_tensor_parallel_size": ((1,), "experts are not split over tensor-parallel ranks"),
    "comm_backend": (("comm",), "tokens travel by all_to_all_single (DeepEP is not built)"),
}
AUTOEP_KEYS = ("enabled", "autoep_size", "preset_model", *SAME_MATH, *DISCOVERY, *ROUTING)


def translate_autoep(section: dict[str, Any], tr: Any) -> None:
    """Map ``section`` onto ``tr`` (ds_config's ``_Translator``); ValueError, one line naming the key, for what
    would not train the same."""
    t = tr.t
    enabled = section.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"{SECTION}.enabled={enabled!r}: must be true or false")
    if not enabled:  # DeepSpeed reads nothing else of a disabled section
        t.notes.append(f"{SECTION}: enabled=false, nothing to do")
        return
    for key, value in section.items():
        dotted = f"{SECTION}.{key}"
        if key == "enabled":
            continue
        if key == "autoep_size":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{dotted}={value!r}: expected a positive integer (the expert-parallel size)")
            tr.set("parallel.ep", value, dotted)
        elif key == "preset_model":
            if value is not None and value not in FAMILIES:
                raise ValueError(f"{dotted}={value!r}: not a model family built here (valid: {list(FAMILIES)} or "
                                 f"null); the family is read from the checkpoint's config.json")
            t.notes.append(f"{dotted}: the family comes from the checkpoint's config.json")
        elif key in SAME_MATH:
            t.notes.append(f"{dotted}: {SAME_MATH[key]}")
        elif key in DISCOVERY:
            if value is not None:
                raise ValueError(f"{dotted}={value!r}: AutoEP's module patterns for custom models are not built; "
                                 f"MoE models run as native families ({list(FAMILIES)}, qwen2_moe) with model=hf "
                                 f"(leave it out or null)")
        elif key in ROUTING:
            valid, why = ROUTING[key]
            if value not in valid or isinstance(value, bool) != any(isinstance(v, bool) for v in valid):
                raise ValueError(f"{dotted}={value!r}: valid here: {list(valid)}; {why}")
        else:
            t.unsupported.append(dotted)


def translate_expert_data_order(value: Any, tr: Any) -> None:
    """``use_data_before_expert_parallelism``: DeepSpeed's rank order of the expert and data groups."""
    if value not in (False, None):
        raise ValueError(f"use_data_before_expert_parallelism={value!r}: expert groups are consecutive ranks here "
                         f"(DeepSpeed's default order); use false")
