"""Which decoder layers each pipeline stage owns: DeepSpeed's ``partition_method`` values.

- ``uniform``: the same number of layers per stage (earlier stages take the remainder).
- ``parameters``: balance parameter counts, the first stage charged with the embedding and the
  last with the final norm and head, so a large vocabulary pulls layers off the end stages.
  Frozen parameters count too (a LoRA run's base costs a stage compute as a trained one does; only
  counting the trainable ones, as DeepSpeed does, would weigh a layer by its adapters against a
  whole frozen embedding).
- ``type:REGEX``: balance the number of modules (each layer and its submodules) whose class name
  matches REGEX, e.g. ``type:Block`` or ``type:Attention``.

Every stage gets at least one layer: a stage of nothing would only add a pipeline hop.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn

__all__ = ["check_method", "layer_weights", "partition_balanced", "partition_layers", "partition_uniform"]


def partition_uniform(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous, equal-sized ranges; the first ``num_layers % num_stages`` stages get one more."""
    _check_counts(num_layers, num_stages)
    per, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        end = start + per + (1 if s < extra else 0)
        out.append(range(start, end))
        start = end
    return out


def partition_balanced(weights: Sequence[float], num_stages: int, *, first_extra: float = 0.0,
                       last_extra: float = 0.0) -> list[range]:
    """Contiguous ranges, each non-empty, minimizing the heaviest stage (exact, by dynamic programming).

    ``first_extra``/``last_extra`` are weights the first/last stage carry besides their layers.
    Ties prefer earlier cut points, so equal weights give :func:`partition_uniform`'s answer.
    """
    n = len(weights)
    _check_counts(n, num_stages)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))

    def cost(s: int, i: int, j: int) -> float:  # stage s owns layers [i, j)
        c = prefix[j] - prefix[i]
        if s == 0:
            c += first_extra
        if s == num_stages - 1:
            c += last_extra
        return c

    inf = float("inf")
    # best[s][j]: minimal max-cost placing layers [0, j) on stages [0, s]
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            for i in range(j - 1, s - 1, -1):  # the last stage owns [i, j)
                c = max(best[s - 1][i], cost(s, i, j))
                if c < best[s][j] - 1e-9 * max(1.0, abs(c)):
                    best[s][j], cut[s][j] = c, i
    bounds, j = [], n
    for s in range(num_stages - 1, 0, -1):
        i = cut[s][j]
        bounds.append(range(i, j))
        j = i
    bounds.append(range(0, j))
    return bounds[::-1]


def layer_weights(layers: Sequence[nn.Module], method: str) -> list[float]:
    """The per-layer weight a partition method balances (1 per layer for ``uniform``)."""
    if method == "uniform":
        return [1.0] * len(layers)
    if method == "parameters":
        return [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
    if method.startswith("type:"):
        pattern = _compile(method)
        return [float(sum(1 for m in layer.modules() if pattern.search(type(m).__name__))) for layer in layers]
    raise ValueError(f"pipeline.partition={method!r}: valid values are 'uniform', 'parameters', 'type:REGEX'")


def partition_layers(layers: Sequence[nn.Module], num_stages: int, method: str = "uniform", *,
                     first_extra: Sequence[nn.Module | None] = (),
                     last_extra: Sequence[nn.Module | None] = ()) -> list[range]:
    """The layer range of each of ``num_stages`` stages by ``method`` (see the module docstring).

    ``first_extra``/``last_extra``: modules outside the layers that sit on the first/last stage
    (embedding; final norm and head), counted by the ``parameters`` method only.
    """
    check_method(method)
    weights = layer_weights(layers, method)
    if method == "uniform":
        return partition_uniform(len(layers), num_stages)
    if method.startswith("type:") and sum(weights) == 0:
        raise ValueError(f"pipeline.partition={method!r}: no module class name in the layers matches; "
                         f"the layers are {sorted({type(m).__name__ for layer in layers for m in layer.modules()})}")
    first = last = 0.0
    if method == "parameters":
        first = float(sum(p.numel() for m in first_extra if m is not None for p in m.parameters()))
        last = float(sum(p.numel() for m in last_extra if m is not None for p in m.parameters()))
    return partition_balanced(weights, num_stages, first_extra=first, last_extra=last)


def check_method(method: str) -> None:
    """ValueError unless ``method`` is a known partition method (with a valid regex)."""
    if method in ("uniform", "parameters"):
        return
    if method.startswith("type:"):
        _compile(method)
        return
    raise ValueError(f"pipeline.partition={method!r}: valid values are 'uniform', 'parameters', 'type:REGEX'")


def _compile(method: str) -> re.Pattern[str]:
    try:
        return re.compile(method[len("type:"):], re.IGNORECASE)
    except re.error as e:
        raise ValueError(f"pipeline.partition={method!r}: invalid regular expression ({e})") from e


def _check_counts(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"pipeline stages={num_stages}: must be >= 1")
    if num_stages > num_layers:
        raise ValueError(f"parallel.pp x pipeline.virtual_stages = {num_stages} stages > model.n_layers="
                         f"{num_layers}: every stage needs at least one layer; lower pp or virtual stages")
