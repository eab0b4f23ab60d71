"""``data.pad_to_multiple_of``: padded rows (``data.pack=false``) batched to their longest row rounded up to
a multiple instead of to ``data.seq_len``, through the app's own stream and collator, in process.

The reference for the loss is plain torch on each row without any padding: the sum of its token losses
(``F.cross_entropy`` over the row's own logits) over every learned token of the batch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from deepshard.finetune.config import register, validate
from deepshard.finetune.data.collate import PadToMultiple, batch_collator
from deepshard.finetune.data.packing import PaddedDataset
from deepshard.finetune.data.resumable import ResumableStream

CONF = Path(__file__).resolve().parents[2] / "conf"
SEQ_LEN, MULTIPLE, EOS, PAD, VOCAB = 48, 8, 2, 0, 64
register()


def _chat_docs(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Chat-like documents: a masked prompt, a learned reply; some longer than the window (truncated),
    one with nothing learned inside the window."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20 if i % 7 else 60))]
        reply = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 15))]
        docs.append(([1, *prompt, *reply], [-100] * (1 + len(prompt)) + reply))
    return docs


def _stream(docs, collate_fn, rows: int = 3) -> ResumableStream:
    return ResumableStream(PaddedDataset(docs, SEQ_LEN, EOS, PAD), dp_rank=0, dp_size=1, micro_batch_size=rows,
                           seed=0, collate_fn=collate_fn)


def test_batches_pad_to_the_multiple_above_their_longest_learned_row_and_off_keeps_seq_len():
    docs = _chat_docs(42)
    off = _stream(docs, None)
    on = _stream(docs, PadToMultiple(MULTIPLE, SEQ_LEN))
    order = off.sampler.permutation()
    lengths = set()
    for b in range(len(docs) // 3):
        full, cut = next(off), next(on)
        assert full["input_ids"].shape == (3, SEQ_LEN)  # off: today's batches
        # the longest row of the batch, up to its last learned label (its eos), by the documents themselves
        rows = [docs[i] for i in order[3 * b:3 * b + 3]]
        ends = [max((j for j, y in enumerate([*labels[1:], EOS][:SEQ_LEN]) if y != -100), default=-1) + 1
                for _, labels in rows]
        want = min(SEQ_LEN, -(-max(max(ends), 1) // MULTIPLE) * MULTIPLE)
        assert cut["input_ids"].shape == cut["labels"].shape == (3, want), (b, ends)
        for key in ("input_ids", "labels"):  # a prefix of today's batch, and nothing learned is cut
            assert torch.equal(cut[key], full[key][:, :want])
        assert (full["labels"][:, want:] == -100).all()
        lengths.add(want)
    assert len(lengths) >= 3 and SEQ_LEN in lengths  # several buckets, the truncated rows at the cap
    assert len(lengths) <= -(-SEQ_LEN // MULTIPLE)  # the bound compile=true relies on
    assert all(n % MULTIPLE == 0 or n == SEQ_LEN for n in lengths)


def test_padding_adds_nothing_to_the_loss_or_the_gradients():
    from deepshard.finetune.models.llama.model import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=32,
                              max_seq_len=SEQ_LEN))
    model.init_weights(0)
    docs = _chat_docs(12, seed=3)
    stream = _stream(docs, PadToMultiple(MULTIPLE, SEQ_LEN), rows=4)
    order = stream.sampler.permutation()
    for b in range(3):
        batch = next(stream)
        assert batch["input_ids"].shape[1] < SEQ_LEN or b  # something was cut
        model.zero_grad()
        loss = model(batch["input_ids"], batch["labels"], reduction="sum")
        loss.backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        # reference: each row alone, unpadded (its document + eos, truncated to the window), plain torch CE
        model.zero_grad()
        ref, count = torch.zeros(()), 0
        for i in order[4 * b:4 * b + 4]:
            ids, labels = docs[i][0] + [EOS], docs[i][1] + [EOS]
            ids, labels = ids[:SEQ_LEN + 1], labels[:SEQ_LEN + 1]
            x, y = torch.tensor(ids[:-1])[None], torch.tensor(labels[1:])
            logits = model(x)[0]
            ref = ref + F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
            count += int((y != -100).sum())
        ref.backward()
        assert int((batch["labels"] != -100).sum()) == count
        assert loss.item() == pytest.approx(ref.item(), rel=1e-6, abs=1e-5)
        for n, p in model.named_parameters():
            assert torch.allclose(got[n], p.grad, atol=1e-6, rtol=1e-5), n


def _settings(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=["launcher.nproc_per_node=2", *overrides])
    return validate(OmegaConf.to_container(cfg, resolve=True))


def test_the_key_is_off_by_default_and_reaches_the_collator():
    assert _settings([]).data.pad_to_multiple_of is None and batch_collator(_settings([]).data) is None
    assert batch_collator(_settings(["data.pack=false", "data.pad_to_multiple_of=0"]).data) is None
    s = _settings(["data.pack=false", "data.pad_to_multiple_of=16", "parallel.sp=2"])
    collate = batch_collator(s.data)
    assert (collate.multiple, collate.seq_len) == (16, 128)


@pytest.mark.parametrize(("overrides", "line"), [
    (["data.pad_to_multiple_of=-8"], r"^data.pad_to_multiple_of=-8: must be null or 0 \(off: every row padded to "
                                     r"data.seq_len\) or an integer from 1 to data.seq_len=128$"),
    (["data.pad_to_multiple_of=129"], r"^data.pad_to_multiple_of=129: must be null or 0 .* from 1 to data.seq_len=128$"),
    (["data.pack=true", "data.pad_to_multiple_of=8"], r"^data.pad_to_multiple_of=8 with data.pack=true: "),
    (["parallel.pp=2", "data.pad_to_multiple_of=8"], r"^data.pad_to_multiple_of=8 with parallel.pp=2: "),
    (["parallel.sp=2", "data.pad_to_multiple_of=3"], r"^data.pad_to_multiple_of=3 is not divisible by parallel.sp=2"),
    (["model.mlp_tiles=4", "data.pad_to_multiple_of=2"], r"^data.pad_to_multiple_of=2 with model.mlp_tiles=4: "),
])
def test_bad_values_stop_before_start_naming_the_key(overrides, line):
    pack = [] if "data.pack=true" in overrides else ["data.pack=false"]
    with pytest.raises(ValueError, match=line) as err:
        _settings([*pack, *overrides])
    assert "\n" not in str(err.value)
