"""The NVMe store's device-copy protocol, checked on CPU by recording its events.

On CUDA, group g+1's gradients travel device->host while the CPU steps group g, and a buffer is
overwritten only after the copies into and out of it are done.  Here ``_record`` (which returns
a CUDA event on a GPU host, None on CPU) hands out recording stand-ins, so the order of copy
starts, waits and Adam updates is visible; the values are checked bitwise against core's
DeviceStateStore by tests/offload/test_offload_stores.py on the same code path.
"""

from __future__ import annotations

import torch

from deepshard.core.update_rule import AdamW
from deepshard.offload import AioConfig, NvmeStateStore, OffloadConfig

ADAMW = AdamW(betas=(0.9, 0.95), eps=1e-8)


class FakeEvent:
    def __init__(self, log: list) -> None:
        self.log, self.id, self.synced = log, len(log), False
        log.append(("record", self.id))

    def synchronize(self) -> None:
        self.synced = True
        self.log.append(("wait", self.id))


def test_grad_copies_run_ahead_of_adam_and_buffers_wait_for_their_copies(tmp_path, monkeypatch):
    cfg = OffloadConfig(device="nvme", nvme_path=str(tmp_path), sub_group_size=256, buffer_size=256,
                        buffer_count=4, aio=AioConfig(block_size=4096))
    store = NvmeStateStore([torch.randn(1000), torch.randn(500)], [0.0, 0.0], ADAMW, config=cfg)
    num_groups = len(store.groups)
    assert num_groups == 6
    log: list = []
    events: list[FakeEvent] = []
    real_rule = store.rule

    class LoggedRule:  # the store's rule, each update logged
        states = real_rule.states

        def apply(self, *args, **kwargs):
            log.append(("adam", None))
            return real_rule.apply(*args, **kwargs)

    def record(self) -> FakeEvent:
        events.append(FakeEvent(log))
        return events[-1]

    monkeypatch.setattr(store, "rule", LoggedRule())
    monkeypatch.setattr(NvmeStateStore, "_record", record)
    try:
        for step in (1, 2):
            store.step([torch.randn(1000), torch.randn(500)], lr=1e-2, step=step)
    finally:
        store.close()
    assert all(ev.synced for ev in events)  # nothing left in flight once the store is closed
    first = log[:log.index(("adam", None)) + 1]
    step1 = log[:[i for i, e in enumerate(log) if e[0] == "adam"][num_groups - 1] + 2]
    adams = [i for i, e in enumerate(step1) if e[0] == "adam"]
    # the record right after an Adam is that group's upload; the other records are grad copies, in group order
    uploads = {step1[i + 1][1] for i in adams}
    grads = [e[1] for e in step1 if e[0] == "record" and e[1] not in uploads]
    assert len(adams) == len(grads) == len(uploads) == num_groups
    # 4 buffers: reads (and grad copies) run 2 groups ahead, so group 1's copy starts before group 0's Adam
    assert sum(e[0] == "record" for e in first) >= 2
    for g, a in enumerate(adams):
        assert ("wait", grads[g]) in step1[:a], f"group {g}: Adam before its gradients landed"
        if g + 1 < num_groups:
            assert ("record", grads[g + 1]) in step1[:a], f"group {g + 1}: grad copy not started during group {g}"
    # a buffer is handed to a new group only after its last upload finished: every upload of step 1
    # but the ones still in the pool at its end was waited for within step 1 or at step 2's reuse
    assert all(("wait", u) in log for u in uploads)
