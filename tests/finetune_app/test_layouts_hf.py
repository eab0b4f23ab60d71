"""A user's HF Llama trains under every layout (tp, pp, pp x dp, tp x dp) through the one recipe, with
gradient accumulation, eval and a sample, and matches plain single-process torch.

The reference shares no code with the app: transformers' own ``LlamaForCausalLM`` loaded from the same
folder, the rows built here from the same JSONL (prompt tokens masked, variable lengths, truncated at
``data.seq_len``), ``torch.optim.AdamW`` with decay on matrices and ``clip_grad_norm_``.  The train set
holds exactly one step's rows over all ranks, so every step sees every row, whatever order the app's
loader deals them in; the step's loss is the token-weighted sum over the global batch.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.checkpoint.hf_fixtures import save_tiny_hf_llama  # noqa: E402
from tests.finetune_app.app_harness import prompt_response_rows, run_app, scalars, write_jsonl

pytestmark = pytest.mark.slow

SEQ, STEPS, LR, WD, SEED = 64, 3, 0.01, 0.1, 0
NUM_DOCS, EVAL_FRACTION = 11, 0.25  # ceil(11 * 0.25) = 3 held out, 8 rows to train on
# name -> (world, overrides): 8 rows per step in every layout (rows per rank x dp)
LAYOUTS = {
    "tp2_zero1": (2, ["parallel.tp=2", "+zero=stage1", "train.micro_batch_size=4"]),
    "pp2_zero3": (2, ["parallel.pp=2", "+zero=stage3", "train.micro_batch_size=2", "pipeline.microbatches=2",
                      "pipeline.schedule=1f1b"]),
    "pp2_dp2_zero1": (4, ["parallel.pp=2", "+zero=stage1", "train.micro_batch_size=1", "pipeline.microbatches=2",
                          "pipeline.schedule=gpipe"]),
    "tp2_dp2_zero3": (4, ["parallel.tp=2", "+zero=stage3", "train.micro_batch_size=2"]),
}


@pytest.fixture(scope="module")
def user_files(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hf_layouts")
    save_tiny_hf_llama(root / "hf")
    data = write_jsonl(root / "pr.jsonl", prompt_response_rows(NUM_DOCS, seed=11))
    return root / "hf", data


def _rows(hf: Path, records: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each record as one row: prompt + response + eos, prompt labels masked, truncated or padded."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids, labels = [], []
    for r in records:
        p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        resp = tok(r["response"], add_special_tokens=False)["input_ids"]
        i, lab = (p + resp + [tok.eos_token_id])[:SEQ + 1], ([-100] * len(p) + resp + [tok.eos_token_id])[:SEQ + 1]
        ids.append(i + [pad] * (SEQ + 1 - len(i)))
        labels.append(lab + [-100] * (SEQ + 1 - len(lab)))
    ids_t, labels_t = torch.tensor(ids), torch.tensor(labels)
    return ids_t[:, :-1], labels_t[:, 1:]


def _token_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


@pytest.fixture(scope="module")
def reference(user_files) -> dict:
    """Plain torch on one process: the step losses, then the held-out loss after the last step."""
    from transformers import LlamaForCausalLM

    hf, data = user_files
    records = [__import__("json").loads(line) for line in data.read_text().splitlines()]
    order = list(range(len(records)))  # the held-out split the README documents: seeded, by document
    random.Random(SEED).shuffle(order)
    held = set(order[:math.ceil(len(records) * EVAL_FRACTION)])
    train = _rows(hf, [r for i, r in enumerate(records) if i not in held])
    held_out = _rows(hf, [r for i, r in enumerate(records) if i in held])
    assert train[0].shape[0] == 8
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    count = (train[1] != -100).sum()
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _token_loss(model, *train) / count
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        eval_loss = (_token_loss(model, *held_out) / (held_out[1] != -100).sum()).item()
    return {"losses": losses, "eval": eval_loss}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hf_llama_under_every_layout_matches_plain_torch(tmp_path, user_files, reference, name):
    world, layout = LAYOUTS[name]
    hf, data = user_files
    proc = run_app(tmp_path, "model=hf", f"model.path={hf}", "data=jsonl", f"data.path={data}", "data.pack=false",
                   f"data.seq_len={SEQ}", f"data.eval_fraction={EVAL_FRACTION}", f"data.seed={SEED}",
                   f"launcher.nproc_per_node={world}", *layout, "train.grad_accum=2", f"train.max_steps={STEPS}",
                   "scheduler=constant", f"optim.lr={LR}", f"optim.weight_decay={WD}", "train.log_every=1",
                   "train.sample_prompt=alice has", "train.sample_tokens=3", timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    logged = scalars(tmp_path / "run/tensorboard")
    assert logged["train/loss"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-5), out[-2000:]
    assert logged["eval/loss"][-1] == pytest.approx(reference["eval"], rel=1e-5, abs=1e-5)
    assert "sample: 'alice has' -> " in out
