"""``ac_offload``: the checkpointed blocks' saved inputs go to host memory (``save_on_cpu``, pinned on
GPUs) and come back for the recompute; the training math is bit-identical to ``ac=full`` without it.

On this CPU host the device is the host, so the bytes do not move; what is checked is that every
block's input is handed to the offload hooks (and nothing from inside the blocks: the checkpoint's own
hooks win there), and that losses and gradients are bit-identical.  Single process, ~2 s.
"""

from __future__ import annotations

import dataclasses

import torch

from deepshard.core.activation_checkpoint import apply_ac
from deepshard.finetune.models.llama import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=72, max_seq_len=64)


class _Recording(torch.autograd.graph.save_on_cpu):
    packed: list[tuple[int, ...]] = []

    def __init__(self, pin_memory: bool = False) -> None:
        super().__init__(pin_memory=pin_memory)
        pack, unpack = self.pack_hook, self.unpack_hook

        def record(t: torch.Tensor):
            _Recording.packed.append(tuple(t.shape))
            return pack(t)

        self.pack_hook, self.unpack_hook = record, unpack


def _run(offload: bool, ids, labels, doc_ids):
    torch.manual_seed(0)
    m = Llama(dataclasses.replace(CFG, loss_chunk_size=16))
    m.init_weights(0)
    apply_ac(m.layers, "full", offload=offload)
    loss = m(ids, labels, doc_ids=doc_ids, reduction="sum")
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in m.parameters()]


def test_offloaded_checkpoints_are_bit_identical_and_offload_the_block_inputs(monkeypatch):
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", _Recording)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (2, 40), generator=g)
    labels = torch.randint(0, CFG.vocab_size, (2, 40), generator=g)
    labels[:, :7] = -100
    doc_ids = (torch.arange(40) >= 25).long().expand(2, 40)
    _Recording.packed = []
    loss, grads = _run(False, ids, labels, doc_ids)
    assert _Recording.packed == []
    loss_off, grads_off = _run(True, ids, labels, doc_ids)
    assert torch.equal(loss_off, loss)
    assert all(torch.equal(a, b) for a, b in zip(grads_off, grads))
    # per block: its input [2, 40, dim], the RoPE tables and the document mask; nothing from inside
    hidden = [s for s in _Recording.packed if s == (2, 40, CFG.dim)]
    assert len(hidden) == CFG.n_layers, _Recording.packed
    assert len(_Recording.packed) == 4 * CFG.n_layers, _Recording.packed
