"""Where this rank's fp32 master weights and optimizer states live (the update rule is separate).

This is the seam between ZeRO and offload (docs/architecture.md): every ZeRO stage hands its optimizer
work to a ``StateStore``; :class:`DeviceStateStore` keeps the state beside the params, and the
offload package provides stores on pinned host memory and on NVMe.  Stage code never branches
on where the state lives.  What the update does is the store's :class:`~deepshard.core.update_rule.UpdateRule`
(AdamW by default): a store allocates the states the rule names and calls it on them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from deepshard.core.update_rule import UpdateRule


class StateStore(ABC):
    """Owns the fp32 master copy and the update rule's states (``rule.states``) of a list of local shards.

    ``params`` are the tensors the model computes with (this rank's shards: local tensors of
    DTensors, or slices of replicated params), in compute dtype, on the compute device.  After
    :meth:`step` they hold the updated values.  ``weight_decays`` holds one decay per param.
    """

    def __init__(self, params: list[torch.Tensor], weight_decays: list[float], rule: UpdateRule) -> None:
        assert len(params) == len(weight_decays)
        self.params = params
        self.weight_decays = weight_decays
        self.rule = rule

    @abstractmethod
    def step(self, grads: list[torch.Tensor], *, lr: float, step: int, grad_scale: float = 1.0) -> None:
        """Apply one update of the store's rule with ``grads * grad_scale`` and write the result into ``params``.

        ``step`` is the 1-based count of applied updates (for bias correction); ``grad_scale``
        folds loss-scale removal and clipping into the update so no store needs a grad copy.
        The grads are consumed: a store may overwrite them.
        """

    def grad_ready(self, index: int, grad: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Called when ``grads[index]`` is final for this step, while backward may still run.

        Stores that move gradients elsewhere (host memory) start the copy here so it overlaps
        backward; the default keeps the gradient where it is.
        """

    @abstractmethod
    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        """``{"master", *rule.states}``: one tensor per param, shaped like it, fp32 (checkpoints keep
        these names: ``model.<param>`` for the master, ``optim.<state>.<param>`` for each state)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Inverse of :meth:`state_dict`; also refreshes ``params`` from the loaded masters."""

    @abstractmethod
    def state_bytes(self) -> dict[str, int]:
        """Bytes of master + the rule's states by residence: ``{"device": .., "host": .., "nvme": ..}``."""

    def buffer_bytes(self) -> dict[str, int]:
        """Named staging buffers the store holds beyond the state itself (none by default)."""
        return {}

    # True for a store whose update reaches ``params`` after :meth:`step` returns (offload's deferred NVMe
    # update, run at each unit's next use): the norm of the params is then its :meth:`applied_param_sq`
    defers_update = False

    def applied_param_sq(self, *, settle: bool = False) -> tuple[int, list[float]] | None:
        """A store that defers its update: the step of the newest update applied in full and each param's sum
        of squares after it (taken where it was applied); ``settle`` applies any update still owed first,
        and reads the params when none was applied since they were made or loaded.  None: nothing to say
        (a store that does not defer: measure ``params`` after :meth:`step`)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files and buffers (stores with scratch files remove them here)."""


class StoreFactory(Protocol):
    """What decides where optimizer state lives: a store class, or a function that builds one.

    ``masters`` (fp32, one per param, shaped like it) are the values the fp32 master weights start
    from, taken before the params were cast to a 16-bit compute dtype (``apply_mixed_precision``);
    None: the params themselves.  A store is built from them directly, never patched afterwards.
    """

    def __call__(self, params: list[torch.Tensor], weight_decays: list[float], rule: UpdateRule, *,
                 masters: list[torch.Tensor] | None = None) -> StateStore: ...


class DeviceStateStore(StateStore):
    """State beside the params.  With fp32 params the master *is* the param: no extra bytes.
    ``masters`` (see :class:`StoreFactory`) become the store's own: it keeps them, no copy.

    With a rule whose ``state_dtype`` is bf16 the states are bf16 and so are the masters where the
    params are (stages 0-2 under bf16 precision: the param shard is the master, no fp32 copy at all;
    DeepSpeed's rule that bf16 states come with bf16 masters); fp32 params (stage 3's shards) stay
    the masters.  Checkpoints still hold fp32 (:meth:`state_dict` upcasts), so any run can resume them.
    """

    def __init__(self, params: list[torch.Tensor], weight_decays: list[float], rule: UpdateRule, *,
                 masters: list[torch.Tensor] | None = None) -> None:
        super().__init__(params, weight_decays, rule)
        lowp = rule.state_dtype
        if lowp != torch.float32 and any(p.dtype not in (torch.float32, lowp) for p in params):
            raise ValueError(f"optim.state_dtype={lowp}: the params are {params[0].dtype}; bf16 states need "
                             "bf16 (or fp32) params to be their masters (use precision=bf16)")
        self.aliased = all(p.dtype in (torch.float32, lowp) for p in params)
        if self.aliased:
            assert masters is None or lowp != torch.float32, "fp32 params are their own masters"
            self.masters = list(params)
        elif masters is not None:
            assert all(m.dtype == torch.float32 and m.shape == p.shape for m, p in zip(masters, params, strict=True))
            self.masters = list(masters)
        else:
            self.masters = [p.detach().float().clone() for p in params]
        self.states = {name: [torch.zeros_like(m, dtype=lowp) if rule.holds(name, i) else m.new_zeros(0, dtype=lowp)
                              for i, m in enumerate(self.masters)] for name in rule.states}

    def step(self, grads: list[torch.Tensor], *, lr: float, step: int, grad_scale: float = 1.0) -> None:
        g32 = [g.float() if g.dtype != torch.float32 else g for g in grads]
        self.rule.apply(self.masters, g32, self.states, self.weight_decays, lr=lr, step=step, grad_scale=grad_scale)
        if not self.aliased:
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        # bf16 storage is saved as fp32 copies (checkpoints stay fp32 whatever the run keeps); a state
        # the rule does not hold for a param is an empty placeholder, which checkpoints skip
        return {"master": [m.float() for m in self.masters],
                **{k: [s.float() for s in ts] for k, ts in self.states.items()}}

    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        live = {"master": self.masters, **self.states}
        for key, dst in live.items():
            for i, (d, s) in enumerate(zip(dst, state[key])):
                if key == "master" or self.rule.holds(key, i):
                    d.copy_(s)
        if not self.aliased:
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def state_bytes(self) -> dict[str, int]:
        owned = [t for ts in self.states.values() for t in ts] + ([] if self.aliased else self.masters)
        return {"device": sum(t.numel() * t.element_size() for t in owned), "host": 0, "nvme": 0}
