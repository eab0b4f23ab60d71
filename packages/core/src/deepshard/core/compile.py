"""Per-block ``torch.compile`` (``compile=true``): applied after TP and activation checkpointing,
before precision and ZeRO, as torchtitan orders it.

Each block's ``forward`` is replaced by its compiled twin (``fullgraph=True``: a graph break is an
error, not a silent fall back to eager).  The module keeps its class and names, so checkpoints, the
TP plan and ZeRO see the same model; the hooks ZeRO registers later (FSDP2's all-gather and
reduce-scatter) run around the compiled forward, in eager, as DeepSpeed's compiled ZeRO-3 does too.

Recompiles are bounded by dynamo's automatic dynamic shapes: the first sequence length compiles
with static shapes; the first *different* length recompiles once with the changed dims symbolic,
and every later length reuses that graph (no bucketing, so no padding is added).  Eval (no grad)
and the end-of-run sample add one graph each.  ``recompile_limit`` caps the graphs per block code;
past it the run stops with :class:`RecompileStorm`, one line naming the block and dynamo's reason,
instead of running on in eager.

Tensor-parallel blocks (DTensor weights) compile with ``dynamic=False``: one static graph per
sequence length.  On torch 2.13 the symbolic graph of a changed length fails while AOT autograd
traces its backward over DTensor (``BackendCompilerFailed``: ``RecursionError`` in
``proxy_tensor._compute_proxy``, the lazy proxies of the symbolic sizes recursing in the row-parallel
``down_proj``'s ``ViewBackward0``); static graphs are exact, and ``data.pad_to_multiple_of`` bounds
the lengths (config/compile_check.py refuses more buckets than the recompile limit holds).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["RECOMPILE_LIMIT", "CompileStats", "RecompileStorm", "apply_compile", "compile_stats",
           "configure_compile"]

RECOMPILE_LIMIT = 8  # graphs per block code (train, variable length, eval, sample, ... leave room)


class RecompileStorm(RuntimeError):
    """A compiled block hit the recompile limit: its inputs change in a way each step (shape, dtype,
    grad mode) that a bounded number of graphs cannot cover."""


@dataclass
class CompileStats:
    """What compiling cost this process: graphs handed to inductor and the seconds spent in it."""

    graphs: int = 0
    compile_s: float = 0.0
    blocks: list[str] = field(default_factory=list)

    def graph_breaks(self) -> int:
        """Graph breaks dynamo counted (0 under ``fullgraph=True``, where a break raises)."""
        from torch._dynamo.utils import counters

        return sum(counters["graph_break"].values())


_STATS = CompileStats()
_CONFIGURED: list[bool] = []  # configure_compile ran in this process (apply_compile's defaults otherwise)


def compile_stats() -> CompileStats:
    """This process's compile counters (every compiled block shares them)."""
    return _STATS


def _counting_inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """Inductor, counted: one call per graph dynamo hands over (a first compile or a recompile)."""
    from torch._inductor.compile_fx import compile_fx

    t0 = time.perf_counter()
    try:
        return compile_fx(gm, example_inputs)
    finally:
        _STATS.graphs += 1
        _STATS.compile_s += time.perf_counter() - t0


def configure_compile(*, recompile_limit: int = RECOMPILE_LIMIT, cache_dir: str | None = None) -> None:
    """Dynamo's limits for compiled blocks and, when given, inductor's cache dir (compiled kernels and
    FX graphs reused by a restart of the same run: pass a directory inside the run dir)."""
    if recompile_limit < 1:
        raise ValueError(f"recompile_limit={recompile_limit}: must be >= 1")
    torch._dynamo.config.recompile_limit = recompile_limit
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # a storm stops the run; never silently eager
    torch._dynamo.config.automatic_dynamic_shapes = True  # a changed length recompiles once, symbolic
    _CONFIGURED.append(True)
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir


def _signature(args: tuple, kwargs: dict) -> str:
    """What dynamo guards on that changes between steps: tensor shapes and dtypes, and grad mode."""
    shapes = [f"{list(a.shape)} {str(a.dtype).removeprefix('torch.')}"
              for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return f"{', '.join(shapes)}{'' if torch.is_grad_enabled() else ' (no grad)'}"


def _storm_line(name: str, seen: list[str], now: str) -> str:
    before = seen[-1] if seen else "?"
    return (f"compile=true: block {name} hit torch._dynamo.config.recompile_limit="
            f"{torch._dynamo.config.recompile_limit} ({len(seen)} input signatures so far; the last change: "
            f"{before} -> {now}); its inputs change step after step: keep sequence lengths, dtypes and "
            f"batch sizes steady, or set compile=false")


def _settled(a: Any) -> Any:
    """A block input still waiting on an async collective as a plain tensor.

    Tensor parallelism hands the first block the embedding's all-reduced output as an
    ``AsyncCollectiveTensor`` (torch's Rowwise style redistributes with ``async_op=True``).  Fed to a
    compiled graph as it is, the graph's backward returns no gradient for it (torch 2.13), so the
    embedding would stop training; ``clone`` waits for the collective and gives autograd a plain
    node (one copy of the first block's input)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return a.clone() if isinstance(a, AsyncCollectiveTensor) else a


def _compiled_forward(forward: Callable[..., Any], name: str, dynamic: bool | None) -> Callable[..., Any]:
    compiled = torch.compile(forward, fullgraph=True, dynamic=dynamic, backend=_counting_inductor)
    seen: list[str] = []  # distinct input signatures, for the storm's one line

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        run.calls += 1  # type: ignore[attr-defined]
        args = tuple(_settled(a) for a in args)
        try:
            return compiled(*args, **kwargs)
        except Exception as e:  # dynamo's limit error types moved between releases: match on the name
            if "RecompileLimit" in type(e).__name__ or "recompile_limit" in str(e):
                raise RecompileStorm(_storm_line(name, seen, _signature(args, kwargs))) from None
            raise
        finally:
            sig = _signature(args, kwargs)
            if not seen or seen[-1] != sig:
                seen[:] = [*seen[-7:], sig]

    run._deepshard_compiled = compiled  # type: ignore[attr-defined]  # tests and engine.compile() look for it
    run.calls = 0  # type: ignore[attr-defined]
    return run


def is_compiled(block: nn.Module) -> bool:
    """Whether :func:`apply_compile` compiled this block's forward (or, under offloaded AC, its inner one)."""
    inner = getattr(block, "_checkpoint_wrapped_module", None)
    return any(hasattr(m.__dict__.get("forward"), "_deepshard_compiled") for m in (block, inner) if m is not None)


def apply_compile(blocks: nn.Module, *, inside_checkpoint: bool = False, dynamic: bool | None = None) -> None:
    """Compile every block of ``blocks`` (a ModuleList, or a pipeline stage's ModuleDict) in place:
    its forward becomes ``torch.compile(forward, fullgraph=True)`` with inductor.  A checkpointed
    block is compiled with its checkpoint (traced into the graph, as torchtitan does), except with
    ``inside_checkpoint`` (AC offload: ``save_on_cpu``'s hooks cannot be traced; tensor parallelism:
    traced with the checkpoint, torch 2.13's AOT autograd saves a DTensor's DeviceMesh as a tensor for
    backward and fails): then the block inside the checkpoint is compiled and the checkpoint runs
    eagerly around it.  Blocks already
    compiled are left as they are (``engine.compile()`` after the config's ``compile``).
    ``dynamic``: torch.compile's (None: automatic dynamic shapes; False: a static graph per length,
    what tensor-parallel blocks need on torch 2.13, see the module's docstring)."""
    if not _CONFIGURED:
        configure_compile()
    for key, block in blocks.named_children():
        if is_compiled(block):
            continue
        target = getattr(block, "_checkpoint_wrapped_module", block) if inside_checkpoint else block
        target.forward = _compiled_forward(target.forward, key, dynamic)
        _STATS.blocks.append(key)
