"""Recompiles over 100 steps of variable-length chat data are bounded by the length buckets.

A tiny Llama's blocks are compiled by ``deepshard.core.compile`` (the recipe's per-block
``torch.compile``, its dynamo settings: automatic dynamic shapes, the recompile limit) and trained
100 steps, in process at world 1, on chat rows whose lengths vary from row to row: a masked prompt,
a learned reply, an end token.  The app's own data path batches them (``PaddedDataset`` and the
stream of ``data.pack=false``, its collator under ``data.pad_to_multiple_of=8``): each batch is padded to
its longest row rounded up to a multiple of 8 (as HF's ``DataCollatorWithPadding(pad_to_multiple_of=8)``
does for a Trainer), so the block sees as many sequence lengths as there are buckets.

Dynamo's own compile events are counted (``torch._dynamo.callback_handler``: one per frame dynamo
traces, a first compile or a recompile), not our counter.  The bound: no more compiles than buckets
seen, and none after the warm-up (the first two distinct buckets: one static graph, then one with
the length symbolic that every later bucket reuses).
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.slow  # two compiles of a block (~20-30 s): the full suite only

STEPS, ROWS, MULTIPLE, VOCAB, SEQ_LEN, EOS = 100, 2, 8, 96, 96, 2


def _chat_docs(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) per conversation: prompt tokens masked (-100), the reply learned (the dataset adds the
    learned end token)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 40))]
        reply = [rng.randrange(3, 11) for _ in range(rng.randint(1, 40))]  # few reply tokens: learnable
        docs.append(([1, *prompt, *reply], [-100] * (1 + len(prompt)) + reply))
    return docs


def _bucketed(docs: list[tuple[list[int], list[int]]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS batches of ROWS through the app's stream and its ``data.pad_to_multiple_of`` collator."""
    from deepshard.finetune.data.collate import PadToMultiple
    from deepshard.finetune.data.packing import PaddedDataset
    from deepshard.finetune.data.resumable import ResumableStream

    stream = ResumableStream(PaddedDataset(docs, SEQ_LEN, EOS, 0), dp_rank=0, dp_size=1, micro_batch_size=ROWS,
                             seed=0, collate_fn=PadToMultiple(MULTIPLE, SEQ_LEN))
    return [(b["input_ids"], b["labels"]) for b in (next(stream) for _ in range(STEPS))]


def test_recompiles_over_100_chat_steps_are_bounded_by_the_length_buckets(inductor_cache, monkeypatch):
    import torch._dynamo
    from torch._dynamo.callback import CallbackTrigger

    from deepshard.core import compile as ds_compile
    from deepshard.finetune.models.llama.model import Llama, LlamaConfig

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_cache)
    docs = _chat_docs(STEPS * ROWS)
    batches = _bucketed(docs)
    lengths = [ids.shape[1] for ids, _ in batches]
    buckets = sorted(set(lengths))
    assert len(buckets) >= 8, buckets  # the data really varies: several buckets, in no order
    warmup = lengths.index(next(n for n in lengths if n != lengths[0]))  # the step of the second bucket

    cfg = LlamaConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                      max_seq_len=SEQ_LEN)
    torch.manual_seed(0)
    model = Llama(cfg)
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    events: list[tuple[int, str]] = []  # (step, dynamo compile id "frame/attempt")
    now = [0]  # the step running

    def on_compile(args) -> None:
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            events.append((now[0], str(args.compile_id)))

    dynamo = torch._dynamo.config
    with dynamo.patch(recompile_limit=dynamo.recompile_limit, automatic_dynamic_shapes=dynamo.automatic_dynamic_shapes,
                      fail_on_recompile_limit_hit=dynamo.fail_on_recompile_limit_hit):
        torch._dynamo.reset()
        torch._dynamo.callback_handler.register_start_callback(on_compile)
        try:
            ds_compile.configure_compile()
            ds_compile.apply_compile(model.layers)
            losses = []
            for step, (ids, labels) in enumerate(batches):
                now[0] = step
                loss = model(ids, labels)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
        finally:
            torch._dynamo.callback_handler.remove_start_callback(on_compile)
            torch._dynamo.reset()
            ds_compile._CONFIGURED.clear()

    calls = [b.__dict__["forward"].calls for b in model.layers]
    assert calls == [STEPS, STEPS]  # every step ran the compiled blocks
    assert sum(losses[-10:]) < sum(losses[:10])  # it trained
    assert 1 <= len(events) <= len(buckets), (events, buckets)
    assert [e for e in events if e[0] > warmup] == [], (events, warmup, lengths[:warmup + 1])
    padded = sum(ids.numel() for ids, _ in batches)
    real = sum(len(ids) for ids, _ in docs)  # each row's inputs: its document (the dataset's eos is a label)
    # what bucketing costs: its padding is below that of one fixed length for every row (the app's data.seq_len)
    assert 1 - real / padded < 1 - real / (len(docs) * max(buckets))
