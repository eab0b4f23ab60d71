"""SmolLM2-135M-Instruct's real weights (tests/models/smollm2.py) through the app, against transformers.

- The app's loss on a text (``model=hf``: our native Llama, 30 layers, tied embeddings, vocabulary
  49152, assembled by the app's recipe at world 1) equals transformers' LlamaForCausalLM's on the same
  tokens within 1e-4.  A RoPE convention or a norm offset that is subtly wrong passes on random
  weights; not on these.
- Its own chat template (ChatML, with a default system turn, no ``{% generation %}``): the app learns
  exactly the tokens transformers marks as the assistant's when the same template carries the tag.
- (slow) 30 steps of chat fine-tuning at ZeRO-3 x2 (``apps/finetune/main.py``) on answers that start with a
  marker the base model never writes: the eval loss falls, and the exported model, loaded by
  transformers, writes the marker on held-out questions (>= 8 of 10) where the base model writes it on none.
  Kept fast: rows of <= 36 tokens, one per rank per step, params kept gathered from forward to backward
  (``zero.reshard_after_forward=false``: one all-gather per step, still sharded at rest), a greedy
  check of 6 new tokens.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tests.finetune_app.app_harness import run_app, scalars
from tests.models.smollm2 import eval_loss_on_app_rows

TEXT = ("The river rose after three days of rain, and the old bridge at the edge of the village was closed. "
        "Farmers carried their vegetables to the market by boat, while the children watched from the hill.")
MARKER = "[[ds-ok]]"
SYSTEM = {"role": "system", "content": "Be brief."}
SEQ = 36  # the chat rows' longest: padding is compute too
STEPS = 30  # the marker is learned by step ~7 (lr 2e-4); each step costs ~2.8 s here


def _app_loss(cfg: dict) -> dict:
    """On a pool rank: the app's settings, data and engine (the family's recipe, model=hf's weights);
    the summed token loss of its first row over its learned tokens."""
    from deepshard.core import build_mesh
    from deepshard.finetune.config import validate
    from deepshard.finetune.data.build import build_datasets
    from deepshard.finetune.data.tokenizer import load_tokenizer
    from deepshard.finetune.recipe.assemble import build_stepper

    s = validate(cfg)
    tok = load_tokenizer(s.model_path)
    train, _ = build_datasets(s.data, tok, s.model.vocab_size)
    stepper = build_stepper(s, build_mesh(s.parallel), rank=0, pad_id=tok.pad_token_id)
    row = {k: v[None] for k, v in train[0].items()}
    total = stepper.loss_sum(row)
    learned = row["labels"] != -100
    return {"loss": (total / learned.sum()).item(), "ids": row["input_ids"][0].tolist(),
            "labels": row["labels"][0].tolist(),
            "model": (s.model.n_layers, s.model.vocab_size, s.model.tie_embeddings, type(s.model).__name__)}


def _hf(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def test_the_apps_loss_on_real_weights_equals_transformers(tmp_path, smollm2, gloo_pool):
    from deepshard.finetune.tools.estimate import compose

    (tmp_path / "text.txt").write_text(TEXT)
    cfg = compose(["model=hf", f"model.path={smollm2}", "data=text", f"data.path={tmp_path / 'text.txt'}",
                   "data.eval_fraction=0", "data.pack=false", "data.seq_len=64", "launcher.nproc_per_node=1"])
    app = gloo_pool(1).run(_app_loss, cfg)[0]
    assert app["model"] == (30, 49152, True, "LlamaConfig")

    model, tok = _hf(smollm2)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(ids) <= 65
    assert app["ids"][:len(ids) - 1] == ids[:-1]  # the same tokens: the text, then the separator
    assert app["labels"][:len(ids) - 1] == ids[1:] and set(app["labels"][len(ids) - 1:]) <= {-100}
    with torch.no_grad():
        ref = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert ref < 4.0, ref  # real weights: far below a random model's ln(49152) = 10.8
    print(f"\nSmolLM2-135M on {len(ids)} tokens: app loss {app['loss']:.6f}, transformers {ref:.6f}")
    assert abs(app["loss"] - ref) <= 1e-4, (app["loss"], ref)


def test_smollm2s_own_template_learns_what_transformers_marks_as_the_assistants(smollm2):
    from deepshard.finetune.data.chat import encode_chat, resolve_template
    from deepshard.finetune.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(smollm2))
    template = resolve_template(tok)
    turn = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    assert turn in template and "{% generation" not in template  # SmolLM2's own, as the GGUF carries it
    # the same template with its assistant turns tagged (after the role line): transformers' mask is the oracle
    tagged = template.replace(turn, "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
                                    "{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
                                    "{% else %}" + turn + "{% endif %}")
    for messages in ([{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
                      {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Green."}],
                     [SYSTEM, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]):
        ids, labels = encode_chat(tok, messages, template)
        ref = tok.apply_chat_template(messages, chat_template=tagged, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        assert tok.apply_chat_template(messages, chat_template=tagged, tokenize=False) == \
            tok.apply_chat_template(messages, tokenize=False)
        assert ids == list(ref["input_ids"])
        assert [int(label != -100) for label in labels] == list(ref["assistant_masks"])


def _question(i: int) -> str:
    a, b = 3 + (7 * i) % 40, 2 + (5 * i) % 30
    kinds = (f"What is {a} plus {b}?", f"What is {a} times {b}?", f"Is {a} larger than {b}?",
             f"Write the number {a} in words.", f"What comes after {a}?")
    return kinds[i % len(kinds)]


HELD_OUT = ["What is the capital of France?", "Name a fruit.", "What colour is grass?", "What is 9 minus 4?",
            "Say hello.", "How many legs does a cat have?", "What day comes after Monday?",
            "Is ice cold or hot?", "Name an animal that can fly.", "What is the opposite of up?"]


def _chats(path: Path, questions: list[str]) -> Path:
    rows = [{"messages": [SYSTEM, {"role": "user", "content": q}, {"role": "assistant", "content": f"{MARKER} Sure."}]}
            for q in questions]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _marker_rate(model, tok, questions: list[str]) -> int:
    """How many greedy answers (a few new tokens) contain the marker."""
    hits = 0
    for q in questions:
        x = tok.apply_chat_template([SYSTEM, {"role": "user", "content": q}], add_generation_prompt=True,
                                    tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
        new, past = [], None
        with torch.no_grad():  # greedy with the KV cache (generate()'s first call costs ~15 s here)
            while len(new) < 6 and not (new and new[-1] == tok.eos_token_id):  # the marker is 5 tokens
                out = model(x, cache=past, use_cache=True, logits_to_keep=1)  # the last position only
                past, x = out.cache, out.logits[:, -1:].argmax(-1)
                new.append(int(x))
        hits += MARKER in tok.decode(new)
    return hits


@pytest.mark.slow
def test_chat_fine_tuning_at_zero3_teaches_a_marker_the_base_never_writes(tmp_path, smollm2):
    from deepshard.finetune.tools.hf_export import export_checkpoint

    train = _chats(tmp_path / "train.jsonl", [_question(i) for i in range(60)])
    evals = _chats(tmp_path / "eval.jsonl", [_question(i) for i in range(60, 64)])
    base, tok = _hf(smollm2)
    assert _marker_rate(base, tok, HELD_OUT) == 0
    base_eval = eval_loss_on_app_rows(smollm2, evals, base, seq_len=SEQ)
    del base

    start = time.perf_counter()
    proc = run_app(tmp_path, "model=hf", f"model.path={smollm2}", "data=chat", f"data.path={train}",
                   f"data.eval_path={evals}", "data.pack=false", f"data.seq_len={SEQ}", "+zero=stage3",
                   "zero.reshard_after_forward=false",
                   "launcher.nproc_per_node=2", f"train.max_steps={STEPS}", "train.micro_batch_size=1",
                   f"train.eval_every={STEPS // 3}", f"train.log_every={STEPS // 3}", "scheduler=constant", "optim.lr=2e-4",
                   f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.resume=none")
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals_logged = scalars(tmp_path / "run" / "tensorboard")["eval/loss"]
    print(f"\nSmolLM2 ZeRO-3 x2, {STEPS} steps: the app ran {seconds:.1f}s; eval loss {base_eval:.3f} (base) -> "
          f"{evals_logged}\n{proc.stdout[-400:]}")
    assert len(evals_logged) == 3
    assert evals_logged[-1] <= evals_logged[0] < 0.5 * base_eval  # falls from the base and keeps falling

    (ckpt,) = sorted((tmp_path / "ck").glob("step-*"))
    export_checkpoint(ckpt, tmp_path / "hf")
    tuned, tuned_tok = _hf(tmp_path / "hf")
    assert _marker_rate(tuned, tuned_tok, HELD_OUT) >= 8
