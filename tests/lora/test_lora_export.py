"""LoRA end to end through the app: chat data on a HF base, adapter-only checkpoints that resume at
another world size, and exports that PEFT and transformers load with our logits.

Two app runs (world 2 at ZeRO-3, then a resume at world 1, ZeRO-1) serve every test here.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from deepshard.core.checkpoint.consolidate import iter_full_tensors, tensor_infos
from tests.app_runner import run_main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
R, ALPHA, SAVE = 4, 16.0, ["lm_head"]
PROMPT = "bob has two keys. how many keys?"


def _save_base(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from deepshard.finetune.data.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    tok.save_pretrained(str(path))  # with the embedded chat template


def _chats(path: Path, n: int = 48) -> Path:
    from deepshard.finetune.data.corpus import generate

    rows = []
    for story in generate(n, seed=5):
        parts = story.split(". ")
        rows.append({"messages": [{"role": "system", "content": "you tell stories."},
                                  {"role": "user", "content": ". ".join(parts[:2]) + ". what next?"},
                                  {"role": "assistant", "content": ". ".join(parts[2:])}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _app(cwd: Path, name: str, *overrides: str) -> subprocess.CompletedProcess:
    proc = run_main([*overrides, f"hydra.run.dir={cwd / name}"], cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _losses(out: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in re.finditer(r"step\s+(\d+)\s+loss (\S+)", out)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_app")
    base = tmp / "base"
    _save_base(base)
    data = _chats(tmp / "chats.jsonl")
    common = ["+peft=lora", f"peft.r={R}", f"peft.alpha={ALPHA}", f"peft.modules_to_save=[{','.join(SAVE)}]",
              "model=hf", f"model.path={base}", "data=chat", f"data.path={data}", "data.seq_len=64",
              "data.eval_fraction=0", "train.global_batch_size=4", "train.micro_batch_size=0", "train.grad_accum=1",
              "train.max_steps=4", "train.log_every=1", "optim.lr=0.01", "scheduler=constant",
              "checkpoint.every_steps=2", "checkpoint.keep_last=0"]
    first = _app(tmp, "run1", *common, "+zero=stage3", "launcher.nproc_per_node=2",
                 f"train.sample_prompt='{PROMPT}'", "train.sample_tokens=8")
    ckpts = tmp / "run1" / "checkpoints"
    second = _app(tmp, "run2", *common, "+zero=stage1", "launcher.nproc_per_node=1",
                  f"checkpoint.resume={ckpts / 'step-00000002'}", f"checkpoint.dir={tmp / 'run2ckpt'}")
    return {"tmp": tmp, "base": base, "ckpt": ckpts / "step-00000004", "first": first.stdout + first.stderr,
            "second": second.stdout + second.stderr}


def _ours(base: Path, ckpt: Path):
    """Our Llama on the HF base, the checkpoint's adapters (and head) copied in by name."""
    from deepshard.finetune.models.hf import load_hf_weights
    from deepshard.finetune.models.llama import Llama
    from deepshard.finetune.models.llama.hf import llama_config_from_hf
    from deepshard.finetune.models.lora import apply_lora

    model = Llama(llama_config_from_hf(base))
    load_hf_weights(model, base)
    apply_lora(model, r=R, alpha=ALPHA, modules_to_save=SAVE)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for info, t in iter_full_tensors(ckpt, "model."):
            params[info.key[len("model."):]].copy_(t)
    return model.eval()


def _prompts() -> torch.Tensor:
    return torch.randint(0, 2048, (3, 19), generator=torch.Generator().manual_seed(4))


def test_run_trains_lora_on_chat_and_samples_through_the_template(runs):
    out = runs["first"]
    assert "zero stage 3" in out and "trainable (LoRA) params" in out
    losses = _losses(out)
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    assert re.search(r"sample: '.*how many keys\?' -> ", out), out[-2000:]


def test_checkpoint_holds_adapters_and_their_state_only(runs):
    ckpt = runs["ckpt"]
    keys = [i.key for i in tensor_infos(ckpt)]
    model_keys = {k[len("model."):] for k in keys if k.startswith("model.")}
    assert model_keys and all(".lora_A." in k or ".lora_B." in k or k == "lm_head.weight" for k in model_keys)
    assert "lm_head.weight" in model_keys and not any(k.endswith("proj.weight") and "lora_" not in k for k in keys)
    for kind in ("optim.exp_avg.", "optim.exp_avg_sq."):
        assert {k[len(kind):] for k in keys if k.startswith(kind)} == model_keys
    assert len(keys) == 3 * len(model_keys)  # nothing else: the frozen base is not in it
    meta = json.loads((ckpt / "manifest.json").read_text())["meta"]
    assert meta["peft"]["r"] == R and meta["base"] == {"model": "hf", "path": str(runs["base"]), "seed": 0}


def test_resume_at_another_world_size_and_stage_continues_the_run(runs):
    first, second = _losses(runs["first"]), _losses(runs["second"])
    assert sorted(second) == [3, 4]
    for step in (3, 4):
        assert second[step] == pytest.approx(first[step], rel=1e-5), (step, first, second)


def test_exported_adapter_loads_in_peft_with_our_logits(runs, tmp_path):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from deepshard.finetune.tools.export import main

    out = tmp_path / "adapter"
    assert main([str(runs["ckpt"]), str(out), "--adapter"]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == R and config["base_model_name_or_path"] == str(runs["base"])
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as st:
        names = list(st.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(runs["base"]), dtype=torch.float32),
                                   str(out)).eval()
    ours = _ours(runs["base"], runs["ckpt"])
    with torch.no_grad():
        theirs, mine = hf(_prompts()).logits, ours(_prompts())
    assert (theirs - mine).abs().max().item() < 1e-4
    base = AutoModelForCausalLM.from_pretrained(str(runs["base"]), dtype=torch.float32).eval()
    with torch.no_grad():  # the adapters are not a no-op: the comparison means something
        assert (base(_prompts()).logits - mine).abs().max().item() > 1e-3


def test_merged_export_loads_in_transformers_with_our_logits(runs, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from deepshard.finetune.tools.export import main

    out = tmp_path / "merged"
    assert main([str(runs["ckpt"]), str(out), "--merge", "--max-shard-size", "200KB"]) == 0
    assert len(list(out.glob("*.safetensors"))) > 1
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (hf(_prompts()).logits - _ours(runs["base"], runs["ckpt"])(_prompts())).abs().max().item()
    assert diff < 1e-4
    capsys.readouterr()
    assert main([str(runs["ckpt"]), str(tmp_path / "plain")]) == 2  # a LoRA checkpoint needs a flag
    assert "holds LoRA adapters only (+peft=lora): pass --adapter" in capsys.readouterr().err


def test_init_from_a_peft_adapter_folder(runs, tmp_path):
    from deepshard.finetune.models.llama import Llama
    from deepshard.finetune.models.llama.hf import llama_config_from_hf
    from deepshard.finetune.models.lora import LoraConfig, apply_lora
    from deepshard.finetune.models.peft_adapter import check_init_from, load_peft_adapter
    from deepshard.finetune.tools.adapter_export import export_adapter

    out = tmp_path / "adapter"
    export_adapter(runs["ckpt"], out)
    check_init_from(str(out), LoraConfig(r=R, alpha=ALPHA, modules_to_save=tuple(SAVE)))
    with pytest.raises(ValueError, match=r"the adapter has r=4 but peft.r=8; set peft.r to match"):
        check_init_from(str(out), LoraConfig(r=8, alpha=ALPHA))
    with pytest.raises(ValueError, match=r"no adapter_config.json there"):
        check_init_from(str(tmp_path), LoraConfig())
    model = Llama(llama_config_from_hf(runs["base"]))
    apply_lora(model, r=R, alpha=ALPHA, modules_to_save=SAVE)
    assert load_peft_adapter(model, str(out)) == len(tensor_infos(runs["ckpt"], "model."))
    params = dict(model.named_parameters())
    for info, t in iter_full_tensors(runs["ckpt"], "model."):
        assert torch.equal(params[info.key[len("model."):]], t), info.key


def test_resume_refuses_a_mismatched_run(runs):
    from deepshard.core.checkpoint.manifest import CheckpointError
    from deepshard.finetune.recipe.checkpointing import check_lora_resume

    meta = json.loads((runs["ckpt"] / "manifest.json").read_text())["meta"]
    check_lora_resume(runs["ckpt"], meta)  # the same run's settings: fine
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters only but this run is without \+peft=lora"):
        check_lora_resume(runs["ckpt"], {"model": meta["model"]})
    other = {**meta, "base": {**meta["base"], "path": "/elsewhere"}}
    with pytest.raises(CheckpointError, match=r"its adapters were trained on the base .* resume with the same"):
        check_lora_resume(runs["ckpt"], other)
