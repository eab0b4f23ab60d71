"""How the Llama model is parallelized: its TP plan, handed to core's one recipe (TP -> AC -> compile -> precision -> ZeRO).

``parallelize_llama`` works on the whole model or on one pipeline stage (a stage lacks the
embedding or the head: the plan only names what exists), and is what ``pipeline_llama`` hands
to ``deepshard.pipeline.build_pipeline`` as its ``parallelize_fn``.

TP layout (no sequence parallelism): q/k/v and gate/up are column-parallel (each tp rank owns a
slice of the heads and of the hidden units: the attention's ``view(b, s, -1, head_dim)`` sees its
local heads), o/down are row-parallel (one all-reduce per sub-block), the embedding is row-parallel
over the vocabulary, the head column-parallel with its logits all-gathered (Replicate), so the
ordinary cross-entropy gives the exact loss (the recipe sets it as the model's ``head_loss_fn``: the
fused chunked loss takes no vocabulary-sharded weight).  Norms are replicated DTensors, so gradient clipping
counts them once per tp group.  Qwen3's q/k norms act on each rank's own heads: their input is taken as
sharded on the heads (``HeadNormParallel``), so their weights' gradients are summed over the tp ranks.
q/k/v biases (Qwen2) are sharded with their weights' output features.  Fewer kv heads than tp ranks
is refused (each rank would need a copy of a kv head it shares with another rank's queries).

LoRA (``+peft=lora``): the adapters are split with their base layer so the sum equals the
unsharded model's.  A column-parallel base (q/k/v, gate/up) takes ``lora_A`` replicated and
``lora_B`` Shard(0) (its output features, as the base weight): ``x A^T B^T`` comes out sharded on
the features like ``x W^T``.  A row-parallel base (o, down) takes ``lora_A`` Shard(1) (its input
features, as the base weight) and ``lora_B`` replicated: ``x A^T`` is a partial sum over the tp
ranks and so is ``x A^T B^T``; it is added to the base's partial output before the layer's one
all-reduce.  The rank ``r`` is never split, so every rank and target works wherever the base does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from deepshard.core.config import EngineConfig, ZeroConfig
from deepshard.core.mesh import axis_size, local_device
from deepshard.core.parallelize import IGNORE_INDEX, ShardedPart, parallelize_model
from deepshard.core.precision import DTYPES
from deepshard.core.state_store import DeviceStateStore, StoreFactory
from deepshard.core.tensor_parallel import ColwiseWithChildren, ReplicateParallel, RowwiseWithChildren
from deepshard.core.zero import ParamOffload
from deepshard.finetune.models.llama.model import Llama, LlamaConfig
from deepshard.finetune.models.lora import LORA_COLWISE, LORA_ROWWISE
from deepshard.finetune.models.materialize import to_empty_tied
from deepshard.finetune.models.ulysses import apply_ulysses, check_sp
from deepshard.finetune.models.vocab_tiling import apply_vocab_tiling, model_tile_rows, sharded_numel
from deepshard.pipeline import PipelineEngine, build_engine, build_pipeline
from deepshard.pipeline.tied import TiedPair, check_tied_pp, untie

__all__ = ["check_tp", "llama_loss", "llama_stage_init", "llama_tp_plan", "parallelize_llama", "pipeline_llama"]


def check_tp(cfg: LlamaConfig, tp: int) -> None:
    """ValueError unless ``tp`` splits the heads, the kv heads and the hidden units evenly."""
    for key, value in (("model.n_heads", cfg.n_heads), ("model.n_kv_heads", cfg.n_kv_heads),
                       ("model.ffn_hidden", cfg.ffn_hidden)):
        if key == "model.n_kv_heads" and value < tp:
            raise ValueError(f"parallel.tp={tp} is more than model.n_kv_heads={value}: each tp rank must "
                             f"own whole kv heads (replicating them is not supported); use parallel.tp <= "
                             f"{value} and parallel.dp for the other ranks")
        if value % tp:
            raise ValueError(f"parallel.tp={tp} does not divide {key}={value}: each tp rank must own "
                             f"whole heads / equal slices; choose tp among the divisors of {value}")


class HeadNormParallel(ParallelStyle):
    """A norm over each head of a column-parallel projection's output [b, s, heads, head_dim]: its
    input is this rank's heads (Shard(2)), its weight a Replicate DTensor whose gradient comes back
    Partial and is summed over the tp ranks; the output is handed back local."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def wrap(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(t, mesh, (Shard(2),), run_check=False) for t in inputs)

        def unwrap(mod: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return output.to_local()

        return distribute_module(module, device_mesh, input_fn=wrap, output_fn=unwrap)


def llama_tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """FQN pattern -> style for the parts of ``model`` (a Llama or a pipeline stage of one) that exist."""
    def col() -> ParallelStyle:  # torch's ColwiseParallel, and a LoRA layer's adapters split with it
        return ColwiseWithChildren(children=LORA_COLWISE)

    def row() -> ParallelStyle:
        return RowwiseWithChildren(children=LORA_ROWWISE)

    plan: dict[str, ParallelStyle] = {
        "layers.*.input_layernorm": ReplicateParallel(),
        "layers.*.post_attention_layernorm": ReplicateParallel(),
        "layers.*.self_attn.q_proj": col(),
        "layers.*.self_attn.k_proj": col(),
        "layers.*.self_attn.v_proj": col(),
        "layers.*.self_attn.o_proj": row(),
        "layers.*.mlp.gate_proj": col(),
        "layers.*.mlp.up_proj": col(),
        "layers.*.mlp.down_proj": row(),
    }
    if model.cfg.qk_norm:
        plan["layers.*.self_attn.q_norm"] = HeadNormParallel()
        plan["layers.*.self_attn.k_norm"] = HeadNormParallel()
    if getattr(model, "embed_tokens", None) is not None:
        plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if getattr(model, "norm", None) is not None:
        plan["norm"] = ReplicateParallel()
    if getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def parallelize_llama(model: nn.Module, mesh: DeviceMesh, *, zero: ZeroConfig, dtype: str = "fp32",
                      ac: str = "none", offload_params: ParamOffload | None = None,
                      ac_offload: bool = False, experts: Sequence[nn.Module] = (),
                      tp_plan: Callable[[nn.Module], dict[str, ParallelStyle]] | None = None,
                      compile: bool = False) -> ShardedPart:
    """The Llama recipe: core's TP -> AC -> compile -> precision -> ZeRO with this family's TP plan, in place
    (``tp_plan``: another decoder's plan for the same recipe, Gemma's; default :func:`llama_tp_plan`).

    ``model`` (the whole model or a pipeline stage) is fp32, with real weights or on meta.  Stages
    0-2 compute in ``dtype`` (the fp32 local shards are kept for the master weights); stage 3
    keeps fp32 shards and casts per all-gather.  The engine and every pipeline stage take this.
    ``experts``: an MoE model's expert modules under ``parallel.ep`` (sharded over ``mesh["edp"]``).
    """
    check_tp(model.cfg, mesh["tp"].size())
    sp = axis_size(mesh, "sp")
    if sp > 1:
        check_sp(model.cfg, sp=sp, tp=mesh["tp"].size())
        apply_ulysses(model, mesh["sp"])
    rows = model_tile_rows(model, mesh, zero.stage)  # ZeRO-3's embedding and head in vocabulary tiles
    tiled = apply_vocab_tiling(model, mesh["dp"], rows=rows, param_dtype=DTYPES[dtype],
                               reduce_dtype=DTYPES[zero.reduce_dtype]) if rows else 0  # before the root's ZeRO-3
    part = parallelize_model(model, mesh, zero=zero, dtype=dtype, ac=ac, blocks=model.layers,
                             tp_plan=(tp_plan or llama_tp_plan)(model), offload_params=offload_params,
                             ac_offload=ac_offload, experts=experts, compile=compile)
    if mesh["tp"].size() > 1 and getattr(model, "lm_head", None) is not None:
        model.head_loss_fn = partial(_logits_loss, model.lm_head)
    if tiled and part.num_params is not None:  # their params were counted as shards: count them whole
        part.num_params += tiled - sharded_numel(model)
    return part


def llama_stage_init(seed: int = 0, *, full: Callable[[], nn.Module] | None = None,
                     prepare: Callable[[nn.Module], None] | None = None) -> Callable[[nn.Module], None]:
    """``init_fn`` for a pipeline split of a meta-device Llama (or a decoder of its shape: the stage's
    own class is built): the stage gets exactly the weights ``init_weights(seed)`` gives the full model
    (single-process parity), and its buffers (RoPE tables).  The full model is materialized once on the
    host, lazily, and shared by the stages of this rank; a run that loads a checkpoint afterwards can
    skip this (any init_fn will do).

    ``full``: builds the materialized full model instead (the app's: HF weights, LoRA adapters with
    their seeded init or a PEFT folder's), so a stage's adapters equal the unsplit model's.
    ``prepare``: what the pipeline did to the model before splitting it (Gemma names its tied head).
    """
    cache: dict[str, nn.Module] = {}

    def build(stage: nn.Module) -> nn.Module:
        if full is not None:
            model = full()
        else:
            with torch.device("meta"):  # init_weights writes every parameter: skip the default init
                model = type(stage)(stage.cfg)
            to_empty_tied(model, torch.device("cpu"))
            model.init_weights(seed)
        if prepare is not None:
            prepare(model)
        return model

    def init(stage: nn.Module) -> None:
        if "full" not in cache:
            cache["full"] = build(stage)
        whole = cache["full"]
        own = dict(whole.named_parameters(remove_duplicate=False))  # a tied head too (the last stage's copy)
        buffers = dict(whole.named_buffers())
        with torch.no_grad():
            for name, p in stage.named_parameters():
                p.copy_(own[name])
            for name, b in stage.named_buffers():
                b.copy_(buffers[name])

    return init


def _logits_loss(head: nn.Module, h: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    """The TP head's loss: its all-gathered logits, then the plain cross-entropy."""
    return F.cross_entropy(head(h).flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def llama_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The pipeline's last-stage loss: the summed token loss over labels != -100 (the engine divides
    by the step's global valid-token count)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def pipeline_llama(model: Llama, mesh: DeviceMesh, config: EngineConfig, *, schedule: str = "1f1b",
                   microbatches: int = 1, partition: str = "uniform", virtual_stages: int | None = None,
                   init_fn: Callable[[nn.Module], None] | None = None, store_factory: StoreFactory = DeviceStateStore,
                   offload_params: ParamOffload | None = None, device: torch.device | None = None,
                   tp_plan: Callable[[nn.Module], dict[str, ParallelStyle]] | None = None) -> PipelineEngine:
    """The whole 3D recipe: split ``model`` into ``mesh["pp"]`` stages, parallelize each (TP, AC,
    ZeRO per ``config``), and return the pipeline engine (``train_step(input_ids, labels)``).

    Works for pp=1 too (one stage holding everything), so TP / ZeRO runs take the same path.
    A tied head at pp=2 is the last stage's copy of the embedding (:func:`tied_head`).
    ``model`` on meta needs ``init_fn`` (``llama_stage_init(seed)``, or a checkpoint loader by FQN);
    ``store_factory``/``offload_params`` as in ``deepshard.core.initialize``; ``tp_plan``: another
    decoder's plan for the same recipe (Gemma's).
    """
    check_tp(model.cfg, mesh["tp"].size())
    tied = tied_head(model, pp=mesh["pp"].size())

    def parallelize(stage: nn.Module) -> ShardedPart:
        return parallelize_llama(stage, mesh, zero=config.zero, dtype=config.precision.dtype, ac=config.ac,
                                 offload_params=offload_params, ac_offload=config.ac_offload,
                                 compile=config.compile, tp_plan=tp_plan)

    pipe = build_pipeline(model, mesh["pp"], loss_fn=llama_loss, schedule=schedule, microbatches=microbatches,
                          partition=partition, virtual_stages=virtual_stages, parallelize_fn=parallelize,
                          init_fn=init_fn, device=device or local_device())
    return build_engine(pipe, config, mesh=mesh, store_factory=store_factory, tied=tied)


def tied_head(model: nn.Module, *, pp: int) -> tuple[TiedPair, ...]:
    """Over several stages, a head tied to the embedding becomes the last stage's own copy (``model`` is
    changed: its ``lm_head`` gets a parameter of its own, a clone of the embedding's; on meta, the stage's
    ``init_fn`` fills it from the embedding's tensor by name); returns the pair the engine sums."""
    if pp == 1 or not model.cfg.tie_embeddings:
        return ()
    check_tied_pp(pp, what="the model ties its head to its embedding (model.tie_embeddings=True)")
    tied = (("embed_tokens.weight", "lm_head.weight"),)
    untie(model, tied)
    return tied
