"""The test seam for faults in a running job: ``DEEPSHARD_TEST_FAULT`` as a step hook.

The training loop runs its ``step_hooks`` (``hook(step, model)``) at the start of every step; the run's
assembly installs the hook below only when the variable is set, so the loop itself holds no test
code.  ``nan@K``: from step K on the embedding's output is NaN, so a real NaN flows through the loss
into every gradient; ``nan@K:N``: for the N steps K..K+N-1 only (a transient fault the run recovers
from).  ``error@K``: the last rank raises at step K (a worker error the launcher must report).  ``oom@K``:
the last rank allocates at step K until its memory cgroup's OOM killer takes it (refused outside a
cgroup with a limit: it would fill the host).

The NaN is put into the first decoder layer's input, which is the embedding's output in every layout
(whole, tensor-parallel, or read in vocabulary tiles under ZeRO-3, where the embedding module's own
forward is never called and a hook on it would never fire).  A layout without a model on the rank (a
pipeline's stages) is refused at step K rather than silently testing nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

FAULT_ENV = "DEEPSHARD_TEST_FAULT"

StepHook = Callable[[int, "torch.nn.Module | None"], None]


def step_hooks_from_env(env: Mapping[str, str]) -> list[StepHook]:
    """The hooks ``DEEPSHARD_TEST_FAULT`` asks for (none when it is unset)."""
    spec = env.get(FAULT_ENV, "")
    if not spec:
        return []
    kind, _, at = spec.partition("@")
    first, _, count = at.partition(":")
    if kind not in ("nan", "error", "oom") or not first.isdigit() or (count and not count.isdigit()):
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected nan@K, nan@K:N, error@K or oom@K")
    return [InjectTestFault(kind, int(first), int(count) if count else None, spec)]


class InjectTestFault:
    """One fault, at its step (see the module docstring)."""

    def __init__(self, kind: str, first: int, count: int | None, spec: str) -> None:
        self.kind, self.first, self.count, self.spec = kind, first, count, spec
        self.hook: torch.utils.hooks.RemovableHandle | None = None

    def __call__(self, step: int, model: torch.nn.Module | None) -> None:
        if self.hook is not None and self.count is not None and step == self.first + self.count:
            self.hook.remove()
            self.hook = None
        if step != self.first:
            return
        if self.kind == "nan":
            self.hook = first_layer(model, self.spec).register_forward_pre_hook(
                lambda mod, args: (args[0] * float("nan"), *args[1:]))
        elif self.kind == "error" and dist.get_rank() == dist.get_world_size() - 1:
            inject_test_fault(step, self.spec)
        elif self.kind == "oom" and dist.get_rank() == dist.get_world_size() - 1:
            exhaust_memory(self.spec)


def exhaust_memory(spec: str) -> None:
    """Touch 64 MiB after 64 MiB, up to 1.5 x this process's memory cgroup limit (the kernel kills
    first); a process without a limit is refused."""
    from deepshard.launch.memory import OomWatch

    limit = OomWatch().limit()
    if limit is None:
        raise ValueError(f"{FAULT_ENV}={spec}: needs a memory cgroup with a limit (it would fill the host)")
    held = [torch.ones(2**24) for _ in range(int(1.5 * limit) // 2**26)]
    raise RuntimeError(f"{FAULT_ENV}={spec}: {len(held) * 64} MiB held and not killed")


def first_layer(model: torch.nn.Module | None, spec: str) -> torch.nn.Module:
    """The first decoder layer (of ``layers``, ours or a transformers model's), whose input is the
    embedding's output however that is computed."""
    layers = next((m for name, m in model.named_modules() if name.split(".")[-1] == "layers"
                   and isinstance(m, torch.nn.ModuleList) and len(m)), None) if model is not None else None
    if layers is None:
        raise ValueError(f"{FAULT_ENV}={spec}: this layout has no decoder layers on this rank to put the NaN into "
                         f"(pipeline stages are not supported)")
    return layers[0]


def inject_test_fault(step: int, spec: str) -> None:
    raise RuntimeError(f"injected test fault at step {step} ({FAULT_ENV}={spec})")
