"""A page-aligned host buffer with one region per optimizer state and one for the gradient.

Shared by the NVMe optimizer store (:mod:`.nvme_store`, a buffer per sub-group) and ZeRO-Infinity's
deferred step (:mod:`.deferred_step`, a buffer per piece): both read a group's states into it with
O_DIRECT, update them in place and write them back.
"""

from __future__ import annotations

import torch

from .aio import align_up, aligned_empty, as_buffer

STATES = ("master", "exp_avg", "exp_avg_sq")
VEC = 16  # elements per work unit of torch's fused CPU AdamW (one 64-byte cache line of fp32)


def buffer_bytes(numel: int, states: tuple[str, ...] = STATES) -> int:
    """Bytes of one :class:`StateBuffer` of ``numel`` elements: a region per state and one for the
    gradient, each rounded up to the O_DIRECT alignment."""
    return (len(states) + 1) * align_up(max(numel, 1) * 4)


class StateBuffer:
    """One page-aligned host buffer with a region per optimizer state plus an fp32 gradient region.

    ``states``: the master and the update rule's states (``("master", *rule.states)``), AdamW's by default.
    """

    def __init__(self, numel: int, pin: bool, states: tuple[str, ...] = STATES) -> None:
        region = buffer_bytes(numel, states) // (len(states) + 1)
        self.raw = aligned_empty((len(states) + 1) * region, pin=pin)
        parts = {k: self.raw[i * region:(i + 1) * region] for i, k in enumerate(states + ("grad",))}
        self.f32 = {k: v.view(torch.float32)[:numel] for k, v in parts.items()}
        self.mv = {k: as_buffer(parts[k]) for k in states}
        self.state_bytes = len(states) * region
        self._grad_raw = parts["grad"]
        self.grads_landed: torch.cuda.Event | None = None  # device->host grad copies into this buffer
        self.uploaded: torch.cuda.Event | None = None  # host->device weight copies out of this buffer

    def staging(self, dtype: torch.dtype) -> torch.Tensor:
        """The gradient region viewed as ``dtype`` (free once the group's update has run)."""
        return self._grad_raw.view(dtype)

    def wait_grads(self) -> None:
        if self.grads_landed is not None:
            self.grads_landed.synchronize()
            self.grads_landed = None

    def wait_copies(self) -> None:
        """Before the host overwrites this buffer: every device copy into or out of it is done."""
        self.wait_grads()
        if self.uploaded is not None:
            self.uploaded.synchronize()
            self.uploaded = None
