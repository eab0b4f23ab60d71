"""Each native family against transformers' own model of it: a tiny random checkpoint written by
transformers' ``save_pretrained`` imports through the registry (model_type -> family) with logits
and masked loss equal within 1e-5, the case's switch matters (off, the logits differ), and what a
family cannot represent is refused by key."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from deepshard.finetune.models import registry
from tests.models.hf_refs import (
    FAMILIES,
    PHI3_ORIGINAL,
    SEQ,
    VOCAB,
    WINDOW,
    chat_rows,
    reference_loss,
    save_hf,
)

SWITCH = {"qwen2": {"qkv_bias": False}, "qwen3": {"qk_norm": False}, "mistral": {"sliding_window": 0},
          "llama": {"rope_scaling": ()}, "phi3": {"rope_short_factor": (), "rope_long_factor": (), "rope_original_max": 0, "rope_attention_factor": 1.0},
          "gemma3": {"final_softcap": 0.0}}


def _ours(spec, cfg, path):
    model = spec.build(cfg)
    model.init_weights(0)  # RoPE tables (and anything the checkpoint lacks would stay seeded: refused below)
    spec.hf.load_weights(model, path)
    return model.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_imports_with_equal_logits_and_loss(tmp_path, family):
    hf = save_hf(family, tmp_path)
    spec = registry.for_hf(tmp_path)
    cfg = spec.hf.config_from_hf(tmp_path)
    assert spec.name == family and registry.spec_of(cfg) is spec
    if family == "mistral":
        assert cfg.sliding_window == WINDOW < SEQ
    ours = _ours(spec, cfg, tmp_path)
    ids, labels = chat_rows()
    with torch.no_grad():
        theirs = hf(ids[0]).logits
        logits = ours(ids[0])
        loss = ours(ids[0], labels[0])
        switched = spec.build(dataclasses.replace(cfg, **SWITCH[family]))  # the same weights, switch off
        switched.init_weights(0)
        switched.load_state_dict(ours.state_dict(), strict=False)
        without = switched.eval()(ids[0])
    assert (logits - theirs).abs().max().item() < 1e-5
    assert abs(loss.item() - reference_loss(theirs, labels[0]).item()) < 1e-5
    assert (without - theirs).abs().max().item() > 1e-3  # the case is one that needs its switch


def test_qwen2_biases_load_and_matter(tmp_path):
    save_hf("qwen2", tmp_path)
    spec = registry.for_hf(tmp_path)
    model = _ours(spec, spec.hf.config_from_hf(tmp_path), tmp_path)
    names = {n for n, _ in model.named_parameters() if n.endswith("bias")}
    assert names == {f"layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv"}
    assert min(model.get_parameter(n).abs().max().item() for n in names) > 0


@pytest.mark.parametrize(("family", "key", "value"), [
    ("qwen2", "use_sliding_window", True), ("qwen3", "attention_bias", True), ("qwen3", "layer_types", ["x"]),
    ("llama", "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
    ("mistral", "hidden_act", "gelu"), ("phi3", "resid_pdrop", 0.1),
    ("phi3", "rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})])
def test_what_a_family_cannot_represent_is_refused_by_key(tmp_path, family, key, value):
    save_hf(family, tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**c, key: value}))
    with pytest.raises(ValueError, match=key.replace("rope_parameters", "rope_type")):
        registry.for_hf(tmp_path).hf.config_from_hf(tmp_path)


def test_fewer_kv_heads_than_tp_ranks_is_refused_with_the_reason():
    cfg = registry.get("qwen3").config(n_heads=4, n_kv_heads=1, dim=32, ffn_hidden=48, head_dim=16)
    with pytest.raises(ValueError, match=r"parallel.tp=2 is more than model.n_kv_heads=1.*replicating"):
        registry.spec_of(cfg).check_tp(cfg, 2)
    registry.spec_of(cfg).check_tp(cfg, 1)


def test_export_configs_name_their_family():
    """A config with a switch its family's HF class cannot express is refused at export, by key."""
    for family, arch in (("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM"),
                         ("mistral", "MistralForCausalLM"), ("llama", "LlamaForCausalLM"), ("phi3", "Phi3ForCausalLM")):
        spec = registry.get(family)
        assert spec.hf.config_dict(spec.config(dim=32, n_heads=4, n_kv_heads=2))["architectures"] == [arch]
    with pytest.raises(ValueError, match="model.qk_norm"):
        registry.get("llama").hf.config_dict(registry.get("llama").config(qk_norm=True))


def test_the_estimator_counts_each_family_s_switches():
    """The registry's activation memory of a family: Qwen3's q/k norms keep their inputs and outputs,
    Mistral's window shorter than the sequence keeps a [seq, seq] mask of the compute dtype per block; equal otherwise."""
    from deepshard.finetune.models.working_set import RunShape

    shape = RunShape(stage=3, dp=2, micro_batch_size=2, seq_len=64)
    base = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, head_dim=8)

    def device_bytes(family: str, **kw) -> int:
        cfg = registry.get(family).config(**{**base, **kw})
        return registry.spec_of(cfg).activation_memory(cfg, shape)[0]

    llama = device_bytes("llama")
    tokens, q, kv = 2 * 64, 4 * 8, 2 * 8
    assert device_bytes("qwen3") - llama == 2 * 2 * tokens * 4 * (q + kv)  # 2 blocks x (input, normed) fp32
    assert device_bytes("mistral", sliding_window=16) - llama == 2 * 64 * 64 * 4  # SDPA's fp32 additive copy
    assert device_bytes("mistral", sliding_window=64) == llama  # a window as long as the rows costs nothing
    assert device_bytes("qwen2") == llama


def test_mistral_window_through_flex_equals_the_dense_mask(monkeypatch):
    """CUDA's path (a flex BlockMask holding documents and the window), run unfused on CPU without
    grad, equals the dense mask SDPA gets; without the window the logits differ."""
    cfg = registry.get("mistral").config(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96,
                                         max_seq_len=160, sliding_window=7)
    model = registry.spec_of(cfg).build(cfg)
    model.init_weights(1)
    ids = torch.randint(0, 97, (2, 140), generator=torch.Generator().manual_seed(0))
    doc_ids = torch.cat([torch.zeros(2, 60, dtype=torch.long), torch.ones(2, 80, dtype=torch.long)], 1)
    full = registry.spec_of(cfg).build(dataclasses.replace(cfg, sliding_window=0))
    full.load_state_dict(model.state_dict())
    with torch.no_grad():
        dense, unwindowed = model(ids, doc_ids=doc_ids), full(ids, doc_ids=doc_ids)
        monkeypatch.setattr("deepshard.finetune.models.llama.model.use_flex", lambda device, backend: True)
        fused = model(ids, doc_ids=doc_ids)
    assert (fused - dense).abs().max().item() < 1e-5
    assert (unwindowed - dense).abs().max().item() > 1e-2


def test_phi3_splits_its_fused_weights_and_picks_rope_factors_by_length(tmp_path):
    """Phi-3's qkv_proj/gate_up_proj load as our q/k/v and gate/up; a row of at most
    original_max_position_embeddings positions takes the short factors (equal to transformers' too),
    longer rows the long ones (with the short ones there, the logits differ); config.json round-trips."""
    hf = save_hf("phi3", tmp_path)
    spec = registry.for_hf(tmp_path)
    cfg = spec.hf.config_from_hf(tmp_path)
    assert (cfg.rotary_dim, cfg.rope_original_max, cfg.sliding_window) == (6, PHI3_ORIGINAL, 2 * WINDOW)
    ours = _ours(spec, cfg, tmp_path)
    names = {n for n, _ in ours.named_parameters()}
    assert "layers.1.self_attn.k_proj.weight" in names and "layers.1.mlp.up_proj.weight" in names
    # what PEFT cannot adapt on Phi3ForCausalLM (export --adapter refuses LoRA there; --merge writes it)
    assert spec.hf.split_modules(sorted(names)) == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert registry.get("llama").hf.split_modules(sorted(names)) == set()
    ids = chat_rows()[0][0]
    with torch.no_grad():
        assert (ours(ids[:, :PHI3_ORIGINAL]) - hf(ids[:, :PHI3_ORIGINAL]).logits).abs().max().item() < 1e-5
        theirs = hf(ids).logits
        for change in ({"rope_long_factor": cfg.rope_short_factor},  # the long factors matter past the original
                       {"rotary_dim": 8, "rope_short_factor": (*cfg.rope_short_factor, 1.0),  # so does partial rotary
                        "rope_long_factor": (*cfg.rope_long_factor, 1.0)}):
            other = spec.build(dataclasses.replace(cfg, **change))
            other.init_weights(0)
            other.load_state_dict(ours.state_dict())
            assert (other.eval()(ids) - theirs).abs().max().item() > 1e-3, change
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "config.json").write_text(json.dumps(spec.hf.config_dict(cfg), default=str))
    assert spec.hf.config_from_hf(tmp_path / "again") == cfg
