"""Single-process checks: partition methods, stage splitting (FQNs, values, meta init), and the
ValueErrors raised before any process group work."""

from __future__ import annotations

import pytest
import torch

from deepshard.finetune.models.llama import Llama, LlamaConfig
from deepshard.finetune.models.llama.parallelize import check_tp, llama_stage_init, llama_tp_plan
from deepshard.pipeline import StageLayers, partition_layers, split_model, validate_pipeline
from deepshard.pipeline.partition import partition_balanced, partition_uniform
from tests.pipeline.pipeline_harness import MICRO, build_model

# ---- partition -------------------------------------------------------------------------------


def test_uniform_gives_remainder_to_first_stages():
    assert partition_uniform(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert partition_uniform(4, 4) == [range(i, i + 1) for i in range(4)]


def test_balanced_minimizes_heaviest_stage():
    assert partition_balanced([1, 1, 1, 1, 4], 2) == [range(0, 4), range(4, 5)]
    assert partition_balanced([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    # the head charged to the last stage pulls layers off it
    assert partition_balanced([1] * 6, 2, last_extra=2) == [range(0, 4), range(4, 6)]


def test_parameters_counts_embedding_and_head():
    cfg = LlamaConfig(vocab_size=4096, dim=32, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden=64)
    with torch.device("meta"):
        model = Llama(cfg)
    ranges = partition_layers(list(model.layers), 2, "parameters", first_extra=[model.embed_tokens],
                              last_extra=[model.norm, model.lm_head])
    assert [len(r) for r in ranges] == [3, 3]  # embedding and head weigh the same
    ranges = partition_layers(list(model.layers), 2, "parameters", first_extra=[model.embed_tokens])
    assert len(ranges[0]) < len(ranges[1])  # only the first stage carries a big extra


def test_type_regex_counts_matching_modules():
    with torch.device("meta"):
        model = Llama(MICRO)
    layers = list(model.layers)
    assert partition_layers(layers, 2, "type:Block") == [range(0, 2), range(2, 4)]
    assert partition_layers(layers, 2, "type:^Linear$") == [range(0, 2), range(2, 4)]
    with pytest.raises(ValueError, match="type:Conv"):
        partition_layers(layers, 2, "type:Conv")
    with pytest.raises(ValueError, match="pipeline.partition='random'"):
        partition_layers(layers, 2, "random")


# ---- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(schedule="dualpipe"), "pipeline.schedule='dualpipe'"),
    (dict(pp=8), r"parallel.pp=8 .* model.n_layers=4"),
    (dict(pp=2, virtual_stages=4, schedule="interleaved_1f1b"), "model.n_layers=4"),
    (dict(schedule="1f1b", pp=4, microbatches=2), r"pipeline.microbatches=2 .* >= parallel.pp=4"),
    (dict(schedule="interleaved_1f1b", virtual_stages=2, microbatches=3), "multiple of parallel.pp=2"),
    (dict(schedule="zero_bubble", virtual_stages=2, microbatches=6, pp=4), "multiple of parallel.pp=4"),
    (dict(schedule="gpipe", virtual_stages=2), "pipeline.virtual_stages=2"),
    (dict(microbatches=0), "pipeline.microbatches=0"),
    (dict(partition="balanced"), "pipeline.partition='balanced'"),
    (dict(partition="type:(unclosed"), "invalid regular expression"),
])
def test_validation_errors_name_the_key(kwargs, match):
    args = dict(schedule="gpipe", pp=2, microbatches=4, virtual_stages=1, num_layers=4) | kwargs
    with pytest.raises(ValueError, match=match):
        validate_pipeline(**args)


def test_tp_must_divide_heads():
    with pytest.raises(ValueError, match="parallel.tp=3 does not divide model.n_heads=4"):
        check_tp(MICRO, 3)
    with pytest.raises(ValueError, match="model.n_kv_heads=2"):
        check_tp(MICRO, 4)
    check_tp(MICRO, 2)


def test_tied_embeddings_refused_across_stages():
    model = Llama(LlamaConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=72,
                              tie_embeddings=True))
    with pytest.raises(ValueError, match="tie_embeddings"):
        split_model(model, [range(0, 1), range(1, 2)], [0])


# ---- splitting -------------------------------------------------------------------------------


def test_split_keeps_fqns_and_values():
    full = build_model()
    ranges = [range(0, 1), range(1, 3), range(3, 4)]
    stages = split_model(full, ranges, [0, 1, 2])
    ref = dict(full.named_parameters())
    seen = []
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.equal(p, ref[name]) and p.data_ptr() != ref[name].data_ptr()
            seen.append(name)
    assert sorted(seen) == sorted(ref)  # every parameter on exactly one stage
    assert stages[0].lm_head is None and stages[1].embed_tokens is None and stages[2].norm is not None
    assert isinstance(stages[1].layers, StageLayers) and list(stages[1].layers.keys()) == ["1", "2"]
    assert full.layers[0].mlp.up_proj.weight.shape == ref["layers.0.mlp.up_proj.weight"].shape  # untouched


def test_stages_chain_to_the_full_forward():
    full = build_model()
    stages = split_model(full, [range(0, 2), range(2, 4)], [0, 1])
    ids = torch.randint(0, MICRO.vocab_size, (2, 8))
    torch.testing.assert_close(stages[1](stages[0](ids)), full(ids), rtol=0, atol=0)


def test_meta_split_with_stage_init_matches_full_model():
    with torch.device("meta"):
        meta = Llama(MICRO)
    stages = split_model(meta, [range(0, 2), range(2, 4)], [0, 1], init_fn=llama_stage_init(0))
    full = build_model()
    ref = dict(full.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.equal(p, ref[name]), name
        assert torch.equal(stage.rope_cos, full.rope_cos)
    with pytest.raises(ValueError, match="init_fn"):
        split_model(meta, [range(0, 4)], [0])


def test_tp_plan_names_only_existing_parts():
    full = build_model()
    first, last = split_model(full, [range(0, 2), range(2, 4)], [0, 1])
    assert "embed_tokens" in llama_tp_plan(first) and "lm_head" not in llama_tp_plan(first)
    assert "lm_head" in llama_tp_plan(last) and "embed_tokens" not in llama_tp_plan(last)
