"""The estimator's MoE terms at world 1, in process (the ep=2/4 census is in tests/models/test_moe_ep.py's
world-4 launch): each sparse layer's ``sparse_layer_bytes`` against a census of the tensors autograd saved
(Qwen3-MoE's renormalized softmax-top-k and Mixtral's top-k-softmax routing), and the working set's model
states under ``parallel.ep`` against a plain formula: the experts 1/ep per rank, ZeRO over dp / ep."""

from __future__ import annotations

import pytest
import torch

from tests.models.moe_census import saved_census

DIMS = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, head_dim=8, num_experts=8,
            num_experts_per_tok=2, moe_hidden=20, router_aux_loss_coef=0.02)


@pytest.mark.parametrize(("family", "norm"), [("qwen3_moe", True), ("mixtral", True), ("qwen3_moe", False)])
def test_sparse_layer_bytes_equal_what_autograd_saves(family, norm):
    from deepshard.finetune.models import registry
    from deepshard.finetune.models.moe_memory import sparse_layer_bytes

    cfg = registry.get(family).config(**DIMS, norm_topk_prob=norm)
    model = registry.spec_of(cfg).build(cfg)
    model.init_weights(0)
    ids = torch.randint(0, 96, (3, 14), generator=torch.Generator().manual_seed(0))
    census = saved_census(model, lambda: model(ids, ids, reduction="sum"))
    assert [c["tokens"] for c in census] == [42, 42]
    est = sparse_layer_bytes(tokens=42, top_k=2, num_experts=8, dim=32, hidden=20, dtype="fp32", routing=cfg.routing,
                             norm_topk_prob=norm).saved
    assert census[0]["saved"] == est, (census, est)
    assert 0 <= census[1]["saved"] - est <= 64  # the last layer also keeps the aux loss's few scalars


def test_model_states_under_ep_are_the_experts_over_the_dp_left():
    from deepshard.finetune.models import registry
    from deepshard.finetune.models.memory_plan import model_counts
    from deepshard.finetune.models.working_set import RunShape, working_set

    cfg = registry.get("qwen3_moe").config(**DIMS)
    experts = 2 * 8 * 3 * 32 * 20
    whole = model_counts(cfg, world=8)
    dense = whole.num_params - experts
    for ep in (2, 4):
        counts = model_counts(cfg, world=8, ep=ep)
        assert (counts.num_params, counts.experts) == (dense + experts // ep, experts // ep)
        states = {stage: working_set(cfg, counts, RunShape(stage=stage, dp=8, ep=ep), baseline=0).device["model states"]
                  for stage in (1, 3)}
        x = experts // ep
        assert states[1] == 8 * (dense + x) + 8 * dense // 8 + 8 * x // (8 // ep)
        assert states[3] == 16 * dense // 8 + 16 * x // (8 // ep)  # ZeRO-3: the same bytes as every expert over dp
    # under ep each of the 2 layers keeps two int64 permutations of its R = 128 x 2 rows more and half the group
    # offsets, and backward's exchange holds one more [R, dim] gradient buffer at a time
    shape = RunShape(stage=3, dp=8, micro_batch_size=2, seq_len=64)
    spec, rows = registry.spec_of(cfg), 2 * 64 * 2
    assert spec.activation_memory(cfg, RunShape(**{**shape.__dict__, "ep": 2}))[0] - spec.activation_memory(
        cfg, shape)[0] == 2 * (2 * rows * 8 - 4 * 4) + rows * 32 * 4
