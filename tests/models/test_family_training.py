"""Each native family trained by its own recipe at world 2 equals transformers' own model trained
by plain torch (3 steps of AdamW on masked chat-like rows, fp32): ZeRO-3 for every family (Qwen3's
embedding and head in vocabulary tiles), tp=2 (Qwen2, Qwen3, Mistral, Phi-3, Gemma 3), pp=2 (Mistral
with rows longer than its window, Qwen2, Qwen3, Phi-3, Llama and Gemma 3 with their heads tied to the embedding:
the last stage's copy trained as one tensor with it; Llama's checkpoint resumed at pp=1), Ulysses sp=2 (Gemma 2 and 3 with sliding and
global layers, Qwen2, Qwen3, Mistral, Phi-3), CPU offload of parameters and optimizer state (Qwen2,
Qwen3, Mistral, Phi-3, Gemma 3), LoRA at ZeRO-3 on every projection against PEFT's (Qwen2, Qwen3,
Mistral) and against plain-torch LoRA on the rows of Phi-3's fused projections: losses and every
parameter within 1e-5 (``train_harness.CASES``; one launch).  The ZeRO-3 checkpoints export to HF
folders that transformers loads with our trained model's logits, the LoRA ones (``export --adapter``)
to adapter folders that PEFT loads onto transformers' model with our logits (Phi-3's: ``--merge``,
``--adapter`` refused); the estimator's offloaded model-state figure is held against the bytes each
offloaded case's ranks held."""

from __future__ import annotations

import pytest
import torch

from deepshard.finetune.models import registry
from deepshard.launch.local import launch_local
from tests.models.hf_refs import FAMILIES, SEQ, VOCAB, hf_config, hf_model, save_hf
from tests.models.train_harness import (
    CASES,
    LORA,
    OFFLOAD,
    RESUME,
    STEPS,
    check_offloaded_figure,
    reference,
    worker,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for family in dict.fromkeys([*FAMILIES, *(case[0] for case in CASES.values())]):
        save_hf(family, root / family)
        dirs[family] = str(root / family)
    return launch_local(worker, 2, dirs, str(root / "ckpt")), dirs


@pytest.fixture(scope="module")
def references():
    """One plain-torch run per family (and per LoRA): the layout does not change what it trains."""
    runs = {key: reference(*key) for key in dict.fromkeys((CASES[name][0], name in LORA) for name in CASES)}
    return {name: runs[CASES[name][0], name in LORA] for name in CASES}


def _merged(ranks: list[dict], name: str) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = {}
    for rank in ranks:
        params.update(rank[name]["params"])
    return params


@pytest.mark.parametrize("name", [name for name in CASES if name not in RESUME])
def test_the_family_recipe_trains_as_transformers_does(runs, references, name):
    ranks, _ = runs
    family = CASES[name][0]
    ref_losses, ref_params = references[name]
    losses = ranks[-1][name]["losses"]  # the pipeline's losses exist on its last stage
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5, (losses, ref_losses)
    ours = _merged(ranks, name)
    if "lm_head.weight" in ours and hf_config(family).tie_word_embeddings:  # pp: the last stage's copy
        assert torch.equal(ours.pop("lm_head.weight"), ours["embed_tokens.weight"])  # trained as one tensor
    # as the family's HF tensors (Phi-3's fused ones: their pieces concatenated, as the export writes them)
    hf = {name: torch.cat([ours[n] for n in pieces]) for name, pieces in registry.get(family).hf.tensors(list(ours))}
    assert set(hf) == set(ref_params)
    worst = max(((hf[n] - ref_params[n]).abs().max().item(), n) for n in hf)
    assert worst[0] < 1e-5, worst
    start = dict(hf_model(family).named_parameters())
    moved = {n for n, p in ref_params.items() if n not in start or (p - start[n]).abs().max() > 1e-3}
    assert moved == ({n for n in ref_params if ".lora_" in n} if name in LORA else set(ref_params))


@pytest.mark.parametrize("name", sorted(RESUME))
def test_a_checkpoint_saved_under_one_layout_resumes_under_another(runs, references, name):
    """A tied Llama's checkpoint saved at pp=2 after step 2 (its embedding and the last stage's copy of it
    saved as one tensor, the embedding's) resumed at pp=1 x dp=2, where the head is the embedding: the
    last step's loss and every parameter as the uninterrupted run's (transformers' own, plain torch)."""
    ranks, _ = runs
    family = CASES[name][0]
    ref_losses, ref_params = references[name]
    losses = ranks[-1][name]["losses"]
    assert len(losses) == 1 and abs(losses[0] - ref_losses[STEPS - 1]) < 1e-5, (losses, ref_losses)
    assert abs(ranks[-1][RESUME[name]]["losses"][-1] - losses[0]) < 1e-5  # the run that saved it, uninterrupted
    ours = _merged(ranks, name)
    hf = {name: torch.cat([ours[n] for n in pieces]) for name, pieces in registry.get(family).hf.tensors(list(ours))}
    assert set(hf) == set(ref_params)
    worst = max(((hf[n] - ref_params[n]).abs().max().item(), n) for n in hf)
    assert worst[0] < 1e-5, worst


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_with_our_logits(runs, tmp_path, family):
    from transformers import AutoModelForCausalLM

    from deepshard.finetune.tools.hf_export import export_checkpoint

    ranks, dirs = runs
    name = f"zero3_{family}"
    export_checkpoint(ranks[0][name]["checkpoint"], tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    spec = registry.for_hf(tmp_path / "hf")
    assert spec.name == family
    ours = spec.build(spec.hf.config_from_hf(dirs[family]))
    ours.init_weights(0)
    ours.load_state_dict(_merged(ranks, name), strict=False)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(ids).logits - ours.eval()(ids)).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", sorted(LORA - {"zero3_phi3_lora"}))
def test_lora_adapter_export_loads_in_peft_with_our_logits(runs, tmp_path, name):
    """``export --adapter`` of the adapters-only checkpoint: PEFT's ``PeftModel.from_pretrained`` on
    transformers' base gives the logits of the base with ``alpha / r * B @ A`` of our trained factors
    added to each target weight (merged here, in plain torch)."""
    from deepshard.finetune.tools.adapter_export import export_adapter
    from tests.models.train_harness import TARGETS, check_adapter_in_peft

    ranks, _ = runs
    family = CASES[name][0]
    info = export_adapter(ranks[0][name]["checkpoint"], tmp_path / "adapter")
    assert info["tensors"] == 2 * len(TARGETS) * 2  # A and B per target per layer (2 layers)
    check_adapter_in_peft(tmp_path / "adapter", _merged(ranks, name), lambda: hf_model(family))


def test_phi3_lora_on_fused_pieces_exports_merged_and_refuses_the_adapter_format(runs, tmp_path):
    """Phi-3's adapters on q/k/v and gate/up (pieces of its fused projections): ``export --merge`` writes
    a folder transformers loads with the logits of the base plus ``alpha / r * B @ A`` of our trained
    factors on each piece's rows (merged here, in plain torch); ``export --adapter`` refuses, naming them."""
    from transformers import AutoModelForCausalLM

    from deepshard.finetune.tools.adapter_export import export_adapter, export_merged
    from tests.models.train_harness import ALPHA, RANK

    ranks, _ = runs
    name = "zero3_phi3_lora"
    with pytest.raises(ValueError, match="q_proj"):
        export_adapter(ranks[0][name]["checkpoint"], tmp_path / "adapter")
    export_merged(ranks[0][name]["checkpoint"], tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    ours, merged = _merged(ranks, name), hf_model("phi3")
    weights = dict(merged.named_parameters())
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}
    with torch.no_grad():
        deltas: dict[str, list[torch.Tensor]] = {}
        for n in [n for n in ours if n.endswith(".lora_A.weight")]:  # our order: q, k, v and gate, up (HF's rows)
            stem = n.removesuffix(".lora_A.weight")
            module, leaf = stem.rsplit(".", 1)
            target = f"model.{module}.{fused.get(leaf, leaf)}.weight"
            deltas.setdefault(target, []).append(ALPHA / RANK * ours[stem + ".lora_B.weight"] @ ours[n])
        for target, pieces in deltas.items():
            weights[target] += torch.cat(pieces)
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
        want = merged(ids).logits
        assert (loaded(ids).logits - want).abs().max().item() < 1e-5
        assert (hf_model("phi3")(ids).logits - want).abs().max().item() > 1e-3  # the adapters changed it


@pytest.mark.parametrize("name", sorted(OFFLOAD))
def test_the_estimators_offloaded_model_states_are_what_the_run_holds(runs, name):
    """The estimator's host figure (``tools/estimate``'s "model states (offloaded)") for the case's
    layout, its parameter count from the family's config (Phi-3's split q/k/v and gate/up, Gemma 3's
    tied head once), against the bytes the ranks held (``train_harness.check_offloaded_figure``)."""
    from deepshard.finetune.models.memory_plan import model_counts
    from deepshard.finetune.models.working_set import RunShape, working_set
    from deepshard.offload import OffloadConfig

    ranks, dirs = runs
    family = CASES[name][0]
    cfg = registry.get(family).hf.config_from_hf(dirs[family])
    theirs = hf_model(family)
    num_params = sum(p.numel() for p in theirs.parameters())  # transformers' count (tied: once)
    counts = model_counts(cfg, world=len(ranks))
    assert counts.num_params == num_params
    shape = RunShape(stage=3, dp=len(ranks), offload=OffloadConfig(device="cpu", params="cpu"), seq_len=SEQ)
    figure = working_set(cfg, counts, shape, baseline=0).host["model states (offloaded)"]
    check_offloaded_figure(figure, [rank[name]["memory"] for rank in ranks], theirs)
