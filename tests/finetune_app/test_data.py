"""User data: records, bad-data errors naming file and line, masking, padding, document attention."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from deepshard.finetune.config import DataConfig
from deepshard.finetune.data.build import build_datasets
from deepshard.finetune.data.records import hf_disk_records, jsonl_records, text_records
from deepshard.finetune.data.sources import check_records
from deepshard.finetune.data.tokenizer import load_tokenizer
from deepshard.finetune.models.llama import Llama, LlamaConfig
from tests.finetune_app.app_harness import prompt_response_rows, write_jsonl, write_save_to_disk

TOK = load_tokenizer()
SMALL = LlamaConfig(vocab_size=2048, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=128)


@pytest.mark.parametrize("content,message", [
    ('{"text": "a"}\n{"text": "b"\n', r":2: not valid JSON"),
    ('{"text": "a"}\n\n{"question": "b"}\n', r":3: missing field 'text' \(or 'prompt' and 'response'\)"),
    ('{"prompt": "a"}\n', r":1: missing field 'response'"),
    ('{"text": 5}\n', r":1: field 'text' must be a string"),
    ('[1, 2]\n', r":1: expected a JSON object"),
    ("", r": empty file"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=str(path) + message):
        check_records(DataConfig(name="jsonl", path=str(path)))


def test_missing_files_and_empty_text(tmp_path):
    with pytest.raises(ValueError, match=r"data\.path='.*nothing\*\.txt': no file matches"):
        list(text_records(str(tmp_path / "nothing*.txt")))
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.txt").write_text("  \n")
    with pytest.raises(ValueError, match=r"b\.txt: empty file"):
        list(text_records(str(tmp_path / "*.txt")))


def test_text_units(tmp_path):
    (tmp_path / "a.txt").write_text("one two\nthree\n\nfour five\n")
    assert [r["text"] for r in text_records(str(tmp_path / "a.txt"), text_unit="paragraph")] == \
        ["one two\nthree", "four five"]
    assert len(list(text_records(str(tmp_path / "a.txt"), text_unit="line"))) == 3
    assert len(list(text_records(str(tmp_path), text_unit="file"))) == 1  # a directory: every file in it


def test_hf_disk_dataset_datasetdict_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = prompt_response_rows(5)
    assert list(hf_disk_records(str(write_save_to_disk(tmp_path / "ds", rows)))) == rows
    assert list(hf_disk_records(str(write_save_to_disk(tmp_path / "dd", rows, split="train")))) == rows
    with pytest.raises(ValueError, match=r"data\.split='test'"):
        list(hf_disk_records(str(tmp_path / "dd"), split="test"))
    pq.write_table(pa.Table.from_pylist([{"text": "hello"}, {"text": None}]), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p\.parquet: row 1: missing field 'text'"):
        list(hf_disk_records(str(tmp_path / "*.parquet")))
    pq.write_table(pa.Table.from_pylist([{"body": "x"}]), tmp_path / "q.parquet")
    with pytest.raises(ValueError, match=r"q\.parquet: missing column 'text'.*found \['body'\]"):
        list(hf_disk_records(str(tmp_path / "q.parquet")))


def _data(path, **kw) -> DataConfig:
    return DataConfig(**{"name": "jsonl", "path": str(path), "seq_len": 64, **kw})


def test_prompt_tokens_are_masked_and_contribute_exactly_zero_gradient(tmp_path):
    rows = prompt_response_rows(8)
    train, _ = build_datasets(_data(write_jsonl(tmp_path / "pr.jsonl", rows), pack=False), TOK, 2048)
    item = train[0]
    n_prompt = len(TOK(rows[0]["prompt"], add_special_tokens=False)["input_ids"])
    # labels[t] is the target of position t: positions before the last prompt token predict prompt tokens
    assert (item["labels"][:n_prompt - 1] == -100).all()
    assert (item["labels"][n_prompt - 1:n_prompt + 3] != -100).all()
    torch.manual_seed(0)
    model = Llama(SMALL)
    model.init_weights(0)
    ids, labels = item["input_ids"][None], item["labels"][None]
    logits = model(ids)
    logits.retain_grad()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    masked = labels[0] == -100
    assert torch.count_nonzero(logits.grad[0, masked]) == 0
    assert logits.grad[0, ~masked].abs().sum(-1).min() > 0

    def grads(lbl):
        model.zero_grad()
        model(ids, lbl).backward()
        return [p.grad.clone() for p in model.parameters()]

    # the model's loss on the dataset's labels == a loss over the response positions alone, and changing
    # the targets at masked positions (to any token) while keeping them masked changes no gradient
    ref = grads(labels)
    other = labels.clone()
    other[0, masked] = torch.randint(0, 2048, (int(masked.sum()),))
    model.zero_grad()
    logits = model(ids)
    per_token = F.cross_entropy(logits.flatten(0, 1), other.flatten(), reduction="none")
    (per_token[~masked.flatten()].mean()).backward()
    for a, p in zip(ref, model.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-5, atol=1e-7)


def test_padding_mode_and_held_out_split(tmp_path):
    rows = [{"text": "alice has one red pen. " * 40}] + [{"text": f"bob has {i} cups."} for i in range(19)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    train, held = build_datasets(_data(path, pack=False, eval_fraction=0.2), TOK, 2048)
    assert len(train) == 16 and len(held) == 4  # document-level split
    long = next(i for i in range(len(train)) if (train[i]["labels"] != -100).all())
    assert train.num_truncated == 1 and train[long]["input_ids"].shape == (64,)
    short = train[(long + 1) % len(train)]
    assert (short["labels"][-10:] == -100).all()  # padding is never learned
    packed, _ = build_datasets(_data(path, pack=True), TOK, 2048)
    assert set(packed[0]) == {"input_ids", "labels", "doc_ids"}


def test_document_mask_keeps_attention_inside_documents():
    torch.manual_seed(0)
    model = Llama(SMALL)
    model.init_weights(0)
    a, b = torch.randint(0, 2048, (1, 9)), torch.randint(0, 2048, (1, 11))
    doc = torch.tensor([[0] * 9 + [1] * 11])
    packed = model(torch.cat([a, b], 1), doc_ids=doc)
    torch.testing.assert_close(packed[:, 9:], model(b), rtol=1e-4, atol=1e-5)  # as if b stood alone
    torch.testing.assert_close(model(torch.cat([a, b], 1), doc_ids=torch.zeros_like(doc)),
                               model(torch.cat([a, b], 1)))  # one document: the plain causal path


def test_jsonl_reads_text_and_prompt_records(tmp_path):
    path = tmp_path / "mix.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"prompt": "q", "response": "r"}) + "\n")
    assert list(jsonl_records(str(path))) == [{"text": "a"}, {"prompt": "q", "response": "r"}]


def test_the_worker_servers_preload_names_the_tokenizers_modules():
    import sys

    from transformers import AutoTokenizer

    from deepshard.finetune.data.tokenizer import AUTO_TOKENIZER_MODULE, TOKENIZER_MODULE, tokenizer_modules

    assert type(load_tokenizer()).__module__ == TOKENIZER_MODULE  # else the preload imports nothing useful
    assert AutoTokenizer.__module__ == AUTO_TOKENIZER_MODULE and AUTO_TOKENIZER_MODULE in sys.modules
    assert tokenizer_modules(None) == [TOKENIZER_MODULE]
    assert tokenizer_modules("/some/hf/dir") == [TOKENIZER_MODULE, AUTO_TOKENIZER_MODULE]


def test_datasets_reach_launched_workers_through_the_pipe_not_shared_memory():
    """The launcher hands its tokenized datasets to the workers: pickled by multiprocessing's pickler
    (which moves plain tensors into /dev/shm), they arrive equal and in private memory."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from deepshard.finetune.data.packing import PackedDataset, PaddedDataset

    docs = [([5, 6, 7], [-100, 6, 7]), ([8, 9], [8, 9]), ([], []), ([4] * 11, [4] * 11)]
    for ds in (PackedDataset(docs, 4, 2, with_doc_ids=True), PaddedDataset(docs, 6, 2, 0)):
        copy = pickle.loads(ForkingPickler.dumps(ds))
        assert len(copy) == len(ds) and copy.num_tokens == ds.num_tokens
        for i in range(len(ds)):
            for key, value in ds[i].items():
                assert torch.equal(copy[i][key], value) and not copy[i][key].is_shared()


def test_eval_path_is_the_eval_set_for_every_file_source(tmp_path):
    """data.eval_path: the eval rows are exactly that file's (their token count, by a tokenizer call
    written here), data.path trains whole; eval_fraction is not applied."""
    rows, held = prompt_response_rows(12), prompt_response_rows(3, seed=9)
    data = _data(write_jsonl(tmp_path / "train.jsonl", rows), pack=False, eval_fraction=0.2,
                 eval_path=str(write_jsonl(tmp_path / "eval.jsonl", held)))
    train, evals = build_datasets(data, TOK, 2048)
    assert len(train) == 12 and len(evals) == 3
    learned = sum(min(len(TOK(r["response"], add_special_tokens=False)["input_ids"]) + 1,
                      64 + 1 - len(TOK(r["prompt"], add_special_tokens=False)["input_ids"])) for r in held)
    assert sum(int((evals[i]["labels"] != -100).sum()) for i in range(3)) == learned  # the response + eos
    (tmp_path / "eval.txt").write_text("one line\nanother line\n")
    (tmp_path / "train.txt").write_text("\n".join(f"bob has {i} cups." for i in range(9)))
    text = DataConfig(name="text", path=str(tmp_path / "train.txt"), eval_path=str(tmp_path / "eval.txt"),
                      text_unit="line", seq_len=64, pack=False)
    train, evals = build_datasets(text, TOK, 2048)
    assert (len(train), len(evals)) == (9, 2)
    saved = write_save_to_disk(tmp_path / "saved", held)
    hf = DataConfig(name="hf_disk", path=str(write_save_to_disk(tmp_path / "tr", rows)), eval_path=str(saved),
                    seq_len=64, pack=False)
    assert len(build_datasets(hf, TOK, 2048)[1]) == 3
    chats = [{"messages": [{"role": "user", "content": f"how many cups has bob? {i}"},
                           {"role": "assistant", "content": f"bob has {i} cups."}]} for i in range(5)]
    chat = DataConfig(name="chat", path=str(write_jsonl(tmp_path / "c.jsonl", chats[:3])), seq_len=64, pack=False,
                      eval_path=str(write_jsonl(tmp_path / "ce.jsonl", chats[3:])))
    train, evals = build_datasets(chat, TOK, 2048)
    assert (len(train), len(evals)) == (3, 2)


@pytest.mark.parametrize(("data", "message"), [
    ({"name": "embedded"}, r"data\.eval_path='x\.jsonl': data=embedded generates its documents"),
    ({"name": "jsonl", "path": "t.jsonl"}, r"data\.eval_path='x\.jsonl': no file matches"),
])
def test_eval_path_refused_before_start_naming_the_key(data, message):
    from deepshard.finetune.config.settings import _validate_data

    with pytest.raises(ValueError, match=message):
        _validate_data({**DataConfig().__dict__, **data, "eval_path": "x.jsonl"})


def test_eval_file_of_another_format_is_refused_naming_the_key(tmp_path):
    (tmp_path / "eval.jsonl").write_text("plain text, not JSON\n")
    data = _data(write_jsonl(tmp_path / "t.jsonl", prompt_response_rows(3)), eval_path=str(tmp_path / "eval.jsonl"))
    with pytest.raises(ValueError, match=r"^data\.eval_path='.*eval\.jsonl': .*eval\.jsonl:1: not valid JSON"):
        check_records(data)
