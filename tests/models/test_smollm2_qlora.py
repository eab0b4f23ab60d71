"""QLoRA on SmolLM2-135M's real weights through the app (``apps/finetune/main.py``), ZeRO-3 at world 2.

One base, two runs with the same data, seed, steps, global batches and adapters: LoRA on the base as a
bf16 checkpoint holds it (the SmolLM2 folder's weights rounded to bf16, the form models are published in),
and QLoRA (``peft.base_quant=nf4``) on the same bf16 checkpoint, its block weights stored as NF4, at
ZeRO-3 x2.  Compute is fp32 in both (bf16 arithmetic is emulated on this CPU, 4-5x slower), so what
differs is the base's storage, 16 bits against 4, and the layout: the LoRA reference runs as one process
with both rows of each step in one micro-batch (the same rows per step: the sampler deals rank r every
second index of one permutation), which costs half the CPU of a second ZeRO-3 x2 run and moves its
eval loss by summation order only (~1e-6, far inside the 5% compared).

- QLoRA's eval loss after 30 steps of chat data (story continuations) is within 5% of LoRA's, and both
  fell while training.
- The QLoRA checkpoint's adapter (``export --adapter``) loads with ``PeftModel.from_pretrained`` onto
  transformers' LlamaForCausalLM of the bf16 checkpoint whose block Linear weights are replaced by the
  NF4 round trip of a quantizer written in the test (tests/models/test_qlora.py's, QLoRA's definition
  at the run's world 2): the base the adapters were trained on.  Its loss over the app's own eval rows
  equals the app's last logged eval loss within 1e-4 (fp32 on both sides over the same dequantized
  weights: what remains is summation order through 30 layers, ~1e-5 here, as the real-weights test
  of tests/models/test_smollm2.py finds for the base model).
Kept fast: rows of <= SEQ tokens, one per rank per step, params kept gathered from forward to backward.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tests.finetune_app.app_harness import run_app, scalars
from tests.models.smollm2 import eval_loss_on_app_rows
from tests.models.test_qlora import ref_roundtrip

SYSTEM = {"role": "system", "content": "Be brief."}
SEQ = 48  # the longest chat row below (43 tokens), whole (padding is compute too)
STEPS = 30
WORLD = 2
LR = 1e-3  # LoRA's usual order (r=8, alpha=16: peft's defaults in conf/peft/lora.yaml)


def _chats(path: Path, num: int, seed: int) -> Path:
    """Chat rows: the user gives a story's first sentence, the assistant continues with the next one
    (the app's generated stories: counting, giving, colours, places; names and numbers drawn at
    random, so the loss keeps a floor that both bases share).  One sentence, not two: 43 tokens at most
    instead of 51, a sixth of each step's compute."""
    from deepshard.finetune.data.corpus import generate

    rows = []
    for story in generate(num, seed=seed):
        first, *rest = story.split(". ")
        answer = rest[0].rstrip(".") + "."
        rows.append({"messages": [SYSTEM, {"role": "user", "content": f"Continue the story: {first}."},
                                  {"role": "assistant", "content": answer}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _bf16_copy(src: Path, dst: Path) -> Path:
    """The SmolLM2 folder as a bf16 checkpoint: every tensor rounded to bf16 (config and tokenizer copied)."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    for f in src.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, dst / f.name, metadata={"format": "pt"})
    return dst


# (world, micro-batch rows, ZeRO overrides): two rows per step in both
ZERO3_X2 = (WORLD, 1, ("+zero=stage3", "zero.reshard_after_forward=false"))
ONE_PROCESS = (1, WORLD, ("+zero=stage0",))


def _run(tmp: Path, base: Path, train: Path, evals: Path, layout: tuple, *extra: str) -> dict:
    world, rows, zero = layout
    tmp.mkdir()
    start = time.perf_counter()
    proc = run_app(tmp, "model=hf", f"model.path={base}", "data=chat", f"data.path={train}",
                   f"data.eval_path={evals}", "data.pack=false", f"data.seq_len={SEQ}", *zero, "+peft=lora", *extra,
                   f"launcher.nproc_per_node={world}", f"train.max_steps={STEPS}", f"train.micro_batch_size={rows}",
                   f"train.eval_every={STEPS // 3}", f"train.log_every={STEPS // 3}", "scheduler=constant",
                   f"optim.lr={LR}", f"checkpoint.dir={tmp / 'ck'}", "checkpoint.resume=none")
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    (ckpt,) = sorted((tmp / "ck").glob("step-*"))
    return {"seconds": seconds, "eval": scalars(tmp / "run" / "tensorboard")["eval/loss"], "ckpt": ckpt,
            "stdout": proc.stdout[-600:]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2) -> dict:
    root = tmp_path_factory.mktemp("smollm2_qlora")
    base = _bf16_copy(smollm2, root / "bf16")
    train, evals = _chats(root / "train.jsonl", 60, seed=7), _chats(root / "eval.jsonl", 8, seed=8)
    out = {"base": base, "evals": evals,
           "lora": _run(root / "lora", base, train, evals, ONE_PROCESS),
           "qlora": _run(root / "qlora", base, train, evals, ZERO3_X2, "peft.base_quant=nf4")}
    for kind, layout in (("lora", "one process"), ("qlora", f"ZeRO-3 x{WORLD}")):
        print(f"\nSmolLM2 {layout} {kind} ({STEPS} steps): {out[kind]['seconds']:.1f}s, "
              f"eval loss {out[kind]['eval']}\n{out[kind]['stdout']}")
    return out


@pytest.mark.slow
def test_qlora_eval_loss_is_within_5_percent_of_lora_on_the_bf16_base(runs):
    lora, qlora = runs["lora"]["eval"], runs["qlora"]["eval"]
    assert len(lora) == len(qlora) == 3
    assert lora[-1] < lora[0] and qlora[-1] < qlora[0]  # both learned
    assert abs(qlora[-1] - lora[-1]) <= 0.05 * lora[-1], (qlora, lora)


@pytest.mark.slow
def test_the_qlora_adapter_loads_in_peft_on_the_dequantized_base_with_the_apps_eval_loss(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from deepshard.finetune.tools.adapter_export import export_adapter

    export_adapter(runs["qlora"]["ckpt"], tmp_path / "adapter")
    model = AutoModelForCausalLM.from_pretrained(runs["base"], dtype=torch.float32)
    with torch.no_grad():  # the base QLoRA trained on: each block Linear weight's NF4 round trip at world 2
        for module in model.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(ref_roundtrip(module.weight, WORLD))
    peft = PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    ours = eval_loss_on_app_rows(runs["base"], runs["evals"], peft, seq_len=SEQ)
    app = runs["qlora"]["eval"][-1]
    print(f"\npeft on the dequantized base: eval loss {ours:.6f}, the app's {app:.6f}")
    assert abs(ours - app) <= 1e-4, (ours, app)
