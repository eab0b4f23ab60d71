"""HF weights read as per-rank slices (``models/hf.read_local``) equal safetensors' own ``load_file``,
exactly: for a plain model and a ZeRO-3 model built on meta (world 1, a real 1-rank group), with
Llama 3.2's tied head and Phi-3's fused qkv/gate_up read as row pieces.  The sharded case at world 2
(uneven last shard) is ``test_load_memory``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from deepshard.finetune.models.materialize import to_empty_tied
from tests.models.hf_refs import save_hf


def expected(path) -> dict[str, torch.Tensor]:
    """Our parameters from ``load_file``, written here from HF's layout: ``model.`` dropped, Phi-3's
    qkv_proj rows as q | k | v and gate_up_proj as gate | up."""
    c = json.loads((path / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        for k, t in load_file(str(f)).items():
            name = k.removeprefix("model.")
            if name.endswith("qkv_proj.weight"):
                stem = name.removesuffix("qkv_proj.weight")
                out.update({stem + "q_proj.weight": t[:q], stem + "k_proj.weight": t[q:q + kv],
                            stem + "v_proj.weight": t[q + kv:]})
            elif name.endswith("gate_up_proj.weight"):
                stem, half = name.removesuffix("gate_up_proj.weight"), t.shape[0] // 2
                out.update({stem + "gate_proj.weight": t[:half], stem + "up_proj.weight": t[half:]})
            else:
                out[name] = t
    return out


def _meta_model(path):
    from deepshard.finetune.models import registry

    spec = registry.for_hf(str(path))
    with torch.device("meta"):
        model = spec.build(spec.hf.config_from_hf(str(path)))
    return spec, model


def _check(model, want: dict[str, torch.Tensor]) -> None:
    got = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    assert set(got) == set(want), set(got) ^ set(want)
    for n, t in want.items():
        assert torch.equal(got[n], t), n


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_sliced_reads_equal_load_file(tmp_path, family):
    from functools import partial

    from deepshard.core import ParallelDims, ZeroConfig, build_mesh, init_distributed

    save_hf(family, tmp_path)
    want = expected(tmp_path)
    spec, plain = _meta_model(tmp_path)
    to_empty_tied(plain, torch.device("cpu"))  # as the app does: the tied head stays the embedding
    plain.init_weights(0, weights=False)  # as the app does for model=hf: every weight comes from the file
    spec.hf.load_weights(plain, str(tmp_path))
    _check(plain, want)

    init_distributed()  # a 1-rank group (the conftest removes it): ZeRO-3's DTensors, built on meta
    spec, sharded = _meta_model(tmp_path)
    partial(spec.parallelize, mesh=build_mesh(ParallelDims()), zero=ZeroConfig(stage=3), dtype="fp32", ac="none")(sharded)
    to_empty_tied(sharded, torch.device("cpu"))
    sharded.init_weights(0, weights=False)
    spec.hf.load_weights(sharded, str(tmp_path))
    assert all(hasattr(p, "full_tensor") for p in sharded.parameters())
    _check(sharded, want)


def test_the_estimator_counts_the_load_peak(tmp_path):
    """``load_peak``: at ZeRO-3 over 2 ranks, the checkpoint's bytes / 2 kept and half its largest
    tensor read at once (fp32, from the file here); stages 0-2 keep and read whole tensors."""
    from deepshard.finetune.models import registry
    from deepshard.finetune.models.memory_plan import model_counts
    from deepshard.finetune.models.working_set import RunShape, load_peak

    save_hf("llama", tmp_path)
    sizes = [t.numel() * 4 for f in tmp_path.glob("*.safetensors") for t in load_file(str(f)).values()]
    cfg = registry.for_hf(str(tmp_path)).hf.config_from_hf(str(tmp_path))
    counts = model_counts(cfg, world=2)
    assert load_peak(counts, RunShape(stage=3, dp=2)) == (sum(sizes) // 2, max(sizes) // 2)
    assert load_peak(counts, RunShape(stage=2, dp=2)) == (sum(sizes), max(sizes))
