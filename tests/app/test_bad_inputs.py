"""Bad input that used to surface inside the workers (a traceback wall, exit 1) is found by the launcher
before any worker starts: exit 2 and one line naming the file, the line or the key.

Each case runs the launcher's checks in this process; two of them also go through the CLI for real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.app.prelaunch import prelaunch_error
from tests.app_runner import run_main

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "apps/finetune/main.py"
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
        "data.seq_len=64"]
HF_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 2048, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def _hf_dir(tmp: Path, *, config: str | None = None, tokenizer: bool = True, weights: bool = True) -> Path:
    d = tmp / "hf"
    d.mkdir()
    (d / "config.json").write_text(config if config is not None else json.dumps(HF_CONFIG))
    if tokenizer:
        from deepshard.finetune.data.tokenizer import load_tokenizer

        load_tokenizer(None).save_pretrained(str(d))
    if weights:
        save_file({"model.embed_tokens.weight": torch.zeros(2048, 64)}, str(d / "model.safetensors"))
    return d


def no_tokenizer(tmp: Path) -> tuple[list[str], str]:
    d = _hf_dir(tmp, tokenizer=False)
    return ["model=hf", f"model.path={d}"], f"error: model.path='{d}': no tokenizer there"


def no_weights(tmp: Path) -> tuple[list[str], str]:
    d = _hf_dir(tmp, weights=False)
    return ["model=hf", f"model.path={d}"], f"error: model.path='{d}': no *.safetensors weights there"


def config_missing_key(tmp: Path) -> tuple[list[str], str]:
    d = _hf_dir(tmp, config=json.dumps({k: v for k, v in HF_CONFIG.items() if k != "hidden_size"}),
                tokenizer=False, weights=False)
    return ["model=hf", f"model.path={d}"], f"error: {d}/config.json: missing key 'hidden_size'"


def config_not_json(tmp: Path) -> tuple[list[str], str]:
    d = _hf_dir(tmp, config='{"vocab_size": 2048,,}', tokenizer=False, weights=False)
    return ["model=hf", f"model.path={d}"], f"error: {d}/config.json: not valid JSON (Expecting property name"


def micro_batch_over_dataset(tmp: Path) -> tuple[list[str], str]:
    return ["data.num_docs=20", "train.micro_batch_size=64"], "error: train.micro_batch_size=64: the dataset has"


def too_few_documents_for_eval(tmp: Path) -> tuple[list[str], str]:
    f = tmp / "story.txt"
    f.write_text("Once upon a time there was one document only.\n")
    return (["data=text", f"data.path={f}", "data.eval_fraction=0.1"],
            f"error: data.eval_fraction=0.1: data.path='{f}' (data.text_unit=file) holds 1 document(s)")


def jsonl_not_utf8(tmp: Path) -> tuple[list[str], str]:
    f = tmp / "rows.jsonl"
    f.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    return ["data=jsonl", f"data.path={f}"], f"error: {f}:2: not UTF-8 text (byte 0xe9 at column 14)"


def text_not_utf8(tmp: Path) -> tuple[list[str], str]:
    f = tmp / "notes.txt"
    f.write_bytes(b"first line\nsecond line\n" + "un caf\xe9\n".encode("latin-1"))
    return ["data=text", f"data.path={f}"], f"error: {f}:3: not UTF-8 text (byte 0xe9 at column 7)"


CHAT_ROW = {"messages": [{"role": "user", "content": "how many?"}, {"role": "assistant", "content": "three."}]}


def chat_without_assistant_turns(tmp: Path) -> tuple[list[str], str]:
    f = tmp / "prompts.jsonl"
    f.write_text((json.dumps({"messages": CHAT_ROW["messages"][:1]}) + "\n") * 50)
    return ["data=chat", f"data.path={f}"], f"error: {f}: no conversation has an assistant turn (50 row(s))"


def chat_template_refused(tmp: Path) -> tuple[list[str], str]:
    f = tmp / "chat.jsonl"
    f.write_text((json.dumps(CHAT_ROW) + "\n") * 50)
    t = tmp / "evil.jinja"
    t.write_text("{% for m in messages %}{{ m.content.__class__.__mro__ }}{% endfor %}")
    return (["data=chat", f"data.path={f}", f"data.chat_template={t}"],
            f"error: data.chat_template='{t}': refused by the Jinja sandbox while rendering {f}:1")


CASES = [no_tokenizer, no_weights, config_missing_key, config_not_json, micro_batch_over_dataset,
         too_few_documents_for_eval, jsonl_not_utf8, text_not_utf8, chat_without_assistant_turns,
         chat_template_refused]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_before_any_worker(tmp_path, case, monkeypatch):
    """Every case through the launcher's own checks, in this process (tests/app/prelaunch.py)."""
    overrides, expected = case(tmp_path)
    line = prelaunch_error([*TINY, *overrides], tmp_path / "run", monkeypatch)
    assert line.startswith(expected), line


@pytest.mark.slow  # the app's own process, twice; every case stays in the inner loop in-process (above)
@pytest.mark.parametrize("case", [no_tokenizer, micro_batch_over_dataset])
def test_bad_input_exits_2_with_one_line_before_any_worker(tmp_path, case):
    """The CLI for real: a model-file check and the last check before launch (the data fits the batch)."""
    overrides, expected = case(tmp_path)
    run_dir = tmp_path / "run"
    proc = run_main([*TINY, *overrides, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=180)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines[-1].startswith(expected), proc.stderr[-3000:]
    assert sum(line.startswith("error:") for line in lines) == 1 and "Traceback" not in proc.stderr
    assert not (run_dir / "heartbeat").exists()  # no worker was started
