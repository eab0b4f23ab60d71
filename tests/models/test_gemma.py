"""Gemma 2 and Gemma 3 against transformers' own models (world 1, fp32, tiny random configs made by
transformers' config classes): logits and the masked loss (plain and in chunks, the soft-cap inside
them) within 1e-5 with rows longer than the sliding window and soft-capping on and off; a Gemma 3
vision-language checkpoint's text part; our weights exported with our config.json load in
transformers with equal logits; what Gemma cannot run or express is refused by key.  (Gemma 3 at
ZeRO-3 and tp=2 at world 2, and its export from a checkpoint: tests/models/test_family_training.py.)"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from deepshard.finetune.models import registry
from tests.models.hf_refs import COMMON, GEMMA3, SEQ, VOCAB, WINDOW, chat_rows, reference_loss

NO_CAPS = dict(attn_logit_softcapping=None, final_logit_softcapping=None)
CASES = {  # name -> (transformers config class, keyword arguments)
    "gemma2_capped": ("Gemma2Config", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=12,
                                           attn_logit_softcapping=3.0, final_logit_softcapping=2.0)),
    "gemma2_uncapped": ("Gemma2Config", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=12, **NO_CAPS)),
    "gemma3_capped": ("Gemma3TextConfig", GEMMA3),
    "gemma3_uncapped": ("Gemma3TextConfig", {**GEMMA3, "final_logit_softcapping": None}),
}


def _hf(name: str, seed: int = 0) -> torch.nn.Module:
    """transformers' model of the case, its (1 + w) norms moved off zero so that a missing one shows."""
    import transformers as tf

    cls, kw = CASES[name]
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(getattr(tf, cls)(**{**COMMON, **kw}), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def _load(path):
    spec = registry.for_hf(path)
    cfg = spec.hf.config_from_hf(path)
    model = spec.build(cfg)
    model.init_weights(0)
    spec.hf.load_weights(model, path)
    return spec, cfg, model.eval()


@pytest.mark.parametrize("name", list(CASES))
def test_gemma_equals_transformers(tmp_path, name):
    hf = _hf(name)
    hf.save_pretrained(str(tmp_path))
    spec, cfg, ours = _load(tmp_path)
    assert spec.name == name.split("_")[0] and cfg.sliding_window == WINDOW < SEQ
    assert "sliding_attention" in cfg.layer_types and (cfg.final_softcap > 0) == name.endswith("_capped")
    ids, labels = chat_rows()
    with torch.no_grad():
        theirs = hf(ids[0]).logits
        assert (ours(ids[0]) - theirs).abs().max().item() < 1e-5
        want = reference_loss(theirs, labels[0]).item()
        for chunk in (0, 7, 1024):  # plain logits, several chunks (each soft-capped), one chunk
            model = spec.build(dataclasses.replace(cfg, loss_chunk_size=chunk))
            model.load_state_dict(ours.state_dict(), strict=False)
            assert abs(model.eval()(ids[0], labels[0]).item() - want) < 1e-5, chunk
        if name.endswith("_capped"):  # the same weights without the caps: the case needs them
            uncapped = spec.build(dataclasses.replace(cfg, attn_softcap=0.0, final_softcap=0.0))
            uncapped.load_state_dict(ours.state_dict(), strict=False)
            assert (uncapped.eval()(ids[0]) - theirs).abs().max().item() > 1e-3


def test_the_chunked_soft_capped_loss_has_the_plain_gradient():
    from deepshard.finetune.models.gemma.model import softcap_cross_entropy

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(30, 8, generator=g, requires_grad=True), torch.randn(50, 8, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (30,), generator=g)
    y[::4] = -100
    logits = torch.tanh(h @ w.t() / 2.0) * 2.0
    torch.nn.functional.cross_entropy(logits, y, ignore_index=-100).backward()
    want = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    softcap_cross_entropy(h, w, y, cap=2.0, chunk_size=7, reduction="mean").backward()
    assert max((a - b).abs().max().item() for a, b in zip((h.grad, w.grad), want, strict=True)) < 1e-6


def test_a_gemma3_vision_language_checkpoint_trains_its_text_part(tmp_path):
    """Gemma3ForConditionalGeneration saved by transformers: its text weights (under
    ``language_model.model.``) load with equal text logits; its vision tower is left out, said once."""
    import transformers as tf
    from safetensors import safe_open

    # no final soft-cap: Gemma3ForConditionalGeneration never applies it (its text model, exported as
    # Gemma3ForCausalLM, does); Gemma 3's checkpoints set it null
    text = tf.Gemma3TextConfig(**{**COMMON, **GEMMA3, "final_logit_softcapping": None})
    vision = tf.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14)
    torch.manual_seed(0)
    hf = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(text_config=text, vision_config=vision,
                                                           mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                                                           boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3))
    hf.save_pretrained(str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as st:
        names = list(st.keys())  # transformers writes the hub's layout: language_model.model.*, vision_tower.*
    assert any(n.startswith("vision_tower.") for n in names) and any(n.startswith("language_model.") for n in names)
    with pytest.warns(UserWarning, match="vision tower and multi_modal_projector are not loaded"):
        spec, cfg, ours = _load(tmp_path)
    assert spec.name == "gemma3" and cfg.layer_types == tuple(GEMMA3["layer_types"]) and cfg.rope_factor == 2.0
    ids = torch.randint(3, VOCAB - 3, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids) - hf.eval()(input_ids=ids).logits).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", ["gemma2_capped", "gemma3_capped"])
def test_our_weights_and_config_load_in_transformers(tmp_path, name):
    """Our model (seeded, not from a checkpoint) written by our names and config.json: transformers
    loads it with equal logits (the same writers as the checkpoint export's)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    _hf(name).save_pretrained(str(tmp_path / "src"))
    spec, cfg, _ = _load(tmp_path / "src")
    ours = spec.build(cfg)
    ours.init_weights(7)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "norm" in n:
                p.normal_(0, 0.3)
    out = tmp_path / "out"
    out.mkdir()
    save_file({spec.hf.to_hf_name(n): p.detach().contiguous() for n, p in ours.named_parameters()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(spec.hf.config_dict(cfg)))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(ids).logits - ours.eval()(ids)).abs().max().item() < 1e-5


@pytest.mark.parametrize(("name", "key", "value"), [
    ("gemma3_capped", "attn_logit_softcapping", 20.0), ("gemma2_capped", "tie_word_embeddings", False),
    ("gemma2_capped", "hidden_activation", "silu"), ("gemma3_capped", "use_bidirectional_attention", True),
    ("gemma2_capped", "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})])
def test_what_gemma_cannot_represent_is_refused_by_key(tmp_path, name, key, value):
    _hf(name).save_pretrained(str(tmp_path))
    c = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**c, key: value}))
    with pytest.raises(ValueError, match=key):
        registry.for_hf(tmp_path).hf.config_from_hf(tmp_path)


def test_layouts_gemma_cannot_run_are_refused_before_start():
    cfg = registry.get("gemma3").config(vocab_size=130, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=48)
    spec = registry.spec_of(cfg)
    spec.check_parallel(cfg, pp=2)  # the last stage's copy of the tied head (test_family_training's pp2_gemma3)
    with pytest.raises(ValueError, match=r"^parallel.pp=4: Gemma ties its head to its embedding; the first and last "
                                         r"stages sum their two copies' gradients at parallel.pp=2 only; use "
                                         r"parallel.pp=2$"):
        spec.check_parallel(cfg, pp=4)
    with pytest.raises(ValueError, match=r"^parallel.pp=2 with parallel.tp=2: Gemma's stages are not tensor-parallel"):
        spec.check_parallel(cfg, pp=2, tp=2)
    spec.check_parallel(cfg, tp=2, sp=2)
    with pytest.raises(ValueError, match="parallel.tp=4 does not divide model.vocab_size=130"):
        spec.check_tp(cfg, 4)
    spec.check_tp(cfg, 2)
    with pytest.raises(ValueError, match="model.tie_embeddings=False"):
        registry.get("gemma2").config(tie_embeddings=False)


def test_the_estimator_counts_gemma_s_extra_norms_and_capped_scores():
    from deepshard.finetune.models.working_set import RunShape

    shape = RunShape(stage=3, dp=2, micro_batch_size=2, seq_len=64)
    base = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, head_dim=8)
    llama = registry.get("llama").config(**base)
    gemma = registry.get("gemma3").config(**base, qk_norm=False, sliding_window=0)
    tokens = 2 * 64
    extra = (registry.spec_of(gemma).activation_memory(gemma, shape)[0]
             - registry.spec_of(llama).activation_memory(llama, shape)[0])
    assert extra == 2 * 4 * tokens * 4 * 32  # 2 blocks x the post norms' inputs and outputs, fp32
    capped = dataclasses.replace(gemma, attn_softcap=50.0)
    more = registry.spec_of(capped).activation_memory(capped, shape)[0] - registry.spec_of(gemma).activation_memory(
        gemma, shape)[0]
    assert more == 2 * (2 * 4 + 4) * 2 * 4 * 64 * 64  # 2 blocks x scores, capped, fp32 probs [b, heads, s, s]


def test_gemma_lora_equals_peft_on_transformers(tmp_path):
    """Our LoRA on every projection of Gemma 3 against PEFT's on transformers' model, factors equal:
    the loss and every adapter's gradient (the base frozen) within 1e-5."""
    from deepshard.finetune.models.lora import apply_lora
    from tests.models.train_harness import ALPHA, RANK, TARGETS, _peft, adapter_value, hf_name

    hf = _hf("gemma3_capped")
    hf.save_pretrained(str(tmp_path))
    _, _, ours = _load(tmp_path)
    apply_lora(ours, r=RANK, alpha=ALPHA, target_modules=TARGETS, seed=None)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if ".lora_" in n:
                p.copy_(adapter_value(n.replace(".weight", ""), tuple(p.shape)))
    theirs = _peft(hf)
    ours.double(), theirs.double()  # fp64 on both sides: in fp32 the rounding alone reached 2.7e-5 on one host
    ids, labels = chat_rows()
    loss = ours(ids[0], labels[0])
    loss.backward()
    ref = reference_loss(theirs(ids[0]).logits, labels[0])
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-10
    grads = {hf_name(n): p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    mine = {"model." + n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    assert set(mine) == set(grads) and len(mine) == 2 * 7 * 2
    # 1e-5 as every family's gradients.  "fp64" is not fp64 everywhere: both models compute the norms and the
    # attention softmax in fp32 (transformers' Gemma3RMSNorm casts x.float(), its eager attention softmaxes in
    # float32; ours the same), so the forwards agree (the same fp32 ops: 1e-10) while the two backward graphs
    # round differently in fp32: gaps up to 5.8e-6 of the largest gradient, growing towards the input
    assert max((mine[n] - grads[n]).abs().max().item() for n in mine) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's own attention paths (bench/gpu_check.sh runs it)")
@pytest.mark.parametrize("name", ["gemma2_capped", "gemma3_capped"])
def test_gemma_on_cuda_equals_the_cpu_path(tmp_path, name):
    """On CUDA with the fused kernels: a flex BlockMask per kind of layer (documents, the sliding
    window), Triton RMS/rotary/loss, Gemma 2's capped scores on the math path; logits and loss equal
    the CPU's (fp32) with packed documents, and the gradients flow."""
    _hf(name).save_pretrained(str(tmp_path))
    spec, cfg, cpu = _load(tmp_path)
    gpu = spec.build(dataclasses.replace(cfg, kernels="triton", loss_chunk_size=16)).cuda()
    gpu.load_state_dict(cpu.state_dict(), strict=False)
    ids, labels = chat_rows()
    doc_ids = (torch.arange(SEQ) >= SEQ // 2).long().expand(ids.shape[1], SEQ)
    with torch.no_grad():
        want_logits = cpu(ids[0], doc_ids=doc_ids)
        want = cpu(ids[0], labels[0], doc_ids=doc_ids)
    loss = gpu.train()(ids[0].cuda(), labels[0].cuda(), doc_ids=doc_ids.cuda())
    loss.backward()
    with torch.no_grad():
        logits = gpu.eval()(ids[0].cuda(), doc_ids=doc_ids.cuda()).cpu()
    assert abs(loss.item() - want.item()) < 1e-4 and (logits - want_logits).abs().max().item() < 1e-4
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gpu.parameters())
