"""``deepspeed.pipe``: ``PipelineModule`` with ``LayerSpec`` / ``TiedLayerSpec`` on ``deepshard.pipeline``.

A ``PipelineModule`` is a sequence of layers (``x = layer(x)``, a tuple passed on as one value);
``deepspeed.initialize(model=PipelineModule(...))`` returns a :class:`~.pipe_engine.PipelineEngine`
whose ``train_batch(data_iter)`` / ``eval_batch(data_iter)`` run deepshard's pipeline schedule (1F1B,
DeepSpeed's) over ``num_stages`` stages split by ``partition_method`` (``parameters``, ``uniform``,
``type:REGEX``), data-parallel over the rest of the world.

Differences from DeepSpeed, said here once: every rank builds the whole layer list (DeepSpeed
builds only its own stage's layers), then keeps its stage's copy; the ``parameters`` method counts
frozen parameters too; ``activation_checkpoint_interval`` is refused (use the ds_config's
``activation_checkpointing``-free path or checkpoint inside the layers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]


class LayerSpec:
    """DeepSpeed's: a layer's class and constructor arguments, built when the module is."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not issubclass(typename, nn.Module):
            raise ValueError(f"LayerSpec({typename!r}): expected an nn.Module subclass")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """DeepSpeed's: every spec with the same ``key`` is one module (built once); ``forward_fn(module, x)``
    replaces its forward where given (an embedding reused as the output head)."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] = "weight", **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


class FunctionLayer(nn.Module):
    """A plain callable in ``layers`` (``lambda x: x.view(...)``, ``torch.flatten``): no parameters."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Any) -> Any:
        return self.fn(x)


class TiedLayer(nn.Module):
    """One occurrence of a tied module; occurrences with the same ``key`` share ``module``."""

    def __init__(self, key: str, module: nn.Module, forward_fn: Callable | None, attrs: list[str]) -> None:
        super().__init__()
        self.key = key
        self.module = module
        self.forward_fn = forward_fn
        self.attrs = attrs

    def forward(self, x: Any) -> Any:
        return self.forward_fn(self.module, x) if self.forward_fn is not None else self.module(x)


class PipelineModule(nn.Module):
    """DeepSpeed's ``PipelineModule(layers, num_stages, loss_fn, partition_method, ...)``."""

    def __init__(self, layers: list[Any], num_stages: int | None = None, topology: Any = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Any = None, checkpointable_layers: Any = None,
                 dynamic_shape: bool = False) -> None:
        super().__init__()
        if topology is not None:
            raise ValueError("PipelineModule(topology=...): not supported; give num_stages= (data parallelism takes "
                             "the rest of the world)")
        if num_stages is None or num_stages < 1:
            raise ValueError(f"PipelineModule(num_stages={num_stages!r}): give the number of pipeline stages (>= 1)")
        if activation_checkpoint_interval:
            raise ValueError(f"PipelineModule(activation_checkpoint_interval={activation_checkpoint_interval}): not "
                             f"supported; checkpoint inside your layers (torch.utils.checkpoint, use_reentrant=False)")
        if seed_layers:
            raise ValueError("PipelineModule(seed_layers=True): not supported; every rank builds every layer from "
                             "the same torch seed, so stages start from the same weights as a one-process build")
        self.num_stages = num_stages
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        tied: dict[str, nn.Module] = {}
        built: list[nn.Module] = []
        for i, spec in enumerate(layers):
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in tied:
                    tied[spec.key] = spec.build()
                built.append(TiedLayer(spec.key, tied[spec.key], spec.forward_fn, spec.tied_weight_attr))
            elif isinstance(spec, LayerSpec):
                built.append(spec.build())
            elif isinstance(spec, nn.Module):
                built.append(spec)
            elif callable(spec):
                built.append(FunctionLayer(spec))
            else:
                raise ValueError(f"PipelineModule(layers[{i}]={spec!r}): expected a LayerSpec, TiedLayerSpec, "
                                 f"nn.Module or callable")
        self.layers = nn.ModuleList(built)

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x

    def tied_keys(self) -> list[str]:
        return sorted({layer.key for layer in self.layers if isinstance(layer, TiedLayer)})
