"""ZeRO 1-2 after the optimizer step: all-gather each rank's updated Shard(0) chunks back into the
replicated parameters, in buckets of ``zero.allgather_bucket_size`` elements, double-buffered."""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepshard.core.zero.layout import BucketLayout, group_into_buckets, local_shard

__all__ = ["ShardGatherer"]


class ShardGatherer:
    """All-gather each rank's updated Shard(0) chunks back into the replicated params, in buckets."""

    def __init__(self, params: list[torch.Tensor], group: dist.ProcessGroup, *, allgather_bucket_size: int) -> None:
        self.params = params
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        groups = group_into_buckets([p.numel() for p in params], [p.dtype for p in params], allgather_bucket_size)
        self.buckets = [(idx, BucketLayout(idx, [params[i].shape for i in idx], self.world)) for idx in groups]

        self._buffers: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _pair(self, k: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Two reusable (send, recv) pairs, alternating: bucket k+1 gathers while k unpacks."""
        if dtype not in self._buffers:
            seg = max(layout.segment for _, layout in self.buckets)
            self._buffers[dtype] = [(torch.empty(seg, dtype=dtype, device=device),
                                     torch.empty(self.world * seg, dtype=dtype, device=device)) for _ in range(2)]
        return self._buffers[dtype][k % 2]

    def gather(self) -> None:
        pending = None
        for k, (idx, layout) in enumerate(self.buckets):
            full = [self.params[i] for i in idx]
            send, recv = self._pair(k, full[0].dtype, full[0].device)
            send, recv = send[:layout.segment], recv[:self.world * layout.segment]
            layout.pack_local([local_shard(t, self.world, self.rank) for t in full], send)
            work = dist.all_gather_single(recv, send, group=self.group, async_op=True)
            if pending is not None:
                self._unpack(*pending)
            pending = (work, layout, recv, full)
        if pending is not None:
            self._unpack(*pending)

    @staticmethod
    def _unpack(work: dist.Work, layout: BucketLayout, recv: torch.Tensor, full: list[torch.Tensor]) -> None:
        work.wait()
        layout.unpack_full(recv, full)

    def buffer_bytes(self) -> int:
        """Bytes of the reusable send/receive buffers (allocated on the first gather)."""
        return sum(t.nbytes for pairs in self._buffers.values() for pair in pairs for t in pair)
