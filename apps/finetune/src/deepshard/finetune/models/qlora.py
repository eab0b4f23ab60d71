"""QLoRA (``peft.base_quant=nf4``): the frozen base ``nn.Linear`` weights of the blocks stored as NF4.

The weights are torchao's ``NF4Tensor`` (QLoRA's format: 4-bit codes of the 16-value NormalFloat table,
one absmax scale per block of 64 elements, the scales themselves double-quantized to int8 in blocks of
up to 256 around their mean, with an fp32 factor per such block).  torchao implements FSDP2's
``fsdp_pre_all_gather``/``fsdp_post_all_gather`` and the row split for it, so ZeRO-3 shards the codes
and scales and all-gathers them per block; each projection dequantizes its gathered weight to the
activations' dtype inside the matmul (``LinearNF4``), and frees it with the block.

What stays in the compute dtype: the embedding, the norms, the head, q/k/v biases (they are small, and
the head and embedding are the layers quantization hurts most); the LoRA adapters and their optimizer
state are full precision.  Quantization happens once per run, on the full fp32 weight before ZeRO-3
shards it (a per-shard quantization would give other scales): so the init holds the fp32 model on each
rank once, transiently (quantize-while-loading per block is not built).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import ModuleType

import torch
from torch import nn

__all__ = ["BASE_QUANTS", "NF4_BLOCK", "NF4_SCALER_BLOCK", "apply_nf4", "check_nf4_model", "check_qlora", "count_nf4",
           "is_nf4", "nf4_bytes",
           "nf4_roundtrip", "nf4_weights", "scaler_block_size"]

BASE_QUANTS = ("none", "nf4")
NF4_BLOCK = 64  # elements per absmax scale (QLoRA's, torchao's default)
NF4_SCALER_BLOCK = 256  # scales per double-quantization block (QLoRA's); smaller where a shard needs it


def _torchao() -> ModuleType:
    """``torchao.quantization`` (NF4Tensor, to_nf4), imported without its warnings about CUDA kernel
    libraries a CPU host cannot load (NF4 needs none of them)."""
    logs = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]  # the second: an Enum it registers
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        import torchao.quantization as q
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
    return q


def scaler_block_size(rows: int, cols: int, world: int) -> int:
    """Scales per double-quantization block for a ``rows x cols`` weight sharded over ``world`` ranks:
    the largest power of two <= 256 that divides each rank's number of 64-element blocks (FSDP2 splits
    the codes, the scales and their factors alike, so a shard holds whole factor blocks)."""
    shard_blocks = (rows // world) * cols // NF4_BLOCK
    size = NF4_SCALER_BLOCK
    while size > 1 and shard_blocks % size:
        size //= 2
    return size


def nf4_bytes(numel: int) -> int:
    """Bytes of ``numel`` NF4 elements: 4-bit codes, an int8 scale per 64, an fp32 factor per 256 scales."""
    return numel // 2 + numel // NF4_BLOCK + 4 * (numel // (NF4_BLOCK * NF4_SCALER_BLOCK))


def nf4_weights(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of each ``nn.Linear`` inside the blocks (``model.layers``) but LoRA's adapters: the
    weights QLoRA stores as NF4 (LoRA freezes them all; with or without adapters applied, the same names)."""
    for name, module in model.layers.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in ("lora_A", "lora_B"):
            yield f"layers.{name}.weight", module


def check_nf4_model(model: nn.Module, *, world: int) -> None:
    """ValueError, before start, for a base whose frozen block weights NF4 or its ZeRO-3 sharding cannot
    take: 3-D (stacked MoE experts), rows not split evenly over ``world``, shards not whole 64-blocks."""
    for name, p in model.layers.named_parameters():
        if not p.requires_grad and p.dim() > 2:
            raise ValueError(f"peft.base_quant=nf4: {name} is a {p.dim()}-D stacked weight (MoE experts); NF4 "
                             f"takes 2-D Linear weights only: use peft.base_quant=none for this family")
    for name, module in nf4_weights(model):
        rows, cols = module.weight.shape
        if rows % world or (rows // world) * cols % NF4_BLOCK:
            raise ValueError(f"peft.base_quant=nf4: {name} is {rows}x{cols}; ZeRO-3 over {world} ranks needs its "
                             f"rows divisible by {world} and each rank's {rows // world}x{cols} elements a multiple "
                             f"of {NF4_BLOCK} (the NF4 block)")


def is_nf4(t: torch.Tensor) -> bool:
    """Whether ``t`` (a plain tensor or a DTensor's local piece) is an NF4Tensor."""
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return isinstance(local, _torchao().NF4Tensor)


@torch.no_grad()
def apply_nf4(model: nn.Module, *, world: int = 1) -> int:
    """Quantize the frozen block Linear weights of ``model`` (real weights, not yet sharded) to NF4, in
    place; ``world``: the ZeRO-3 ranks that will shard them.  Returns the elements quantized."""
    to_nf4 = _torchao().to_nf4
    check_nf4_model(model, world=world)
    total = 0
    for name, module in list(nf4_weights(model)):
        assert not module.weight.requires_grad, f"{name} trains: QLoRA quantizes a frozen base only"
        w = module.weight.detach()
        rows, cols = w.shape
        q = to_nf4(w.float().contiguous(), block_size=NF4_BLOCK,
                   scaler_block_size=scaler_block_size(rows, cols, world))
        module.weight = nn.Parameter(q, requires_grad=False)
        total += w.numel()
    return total


@torch.no_grad()
def nf4_roundtrip(w: torch.Tensor, *, world: int = 1) -> torch.Tensor:
    """The fp32 weight training saw for the base weight ``w`` quantized at ``world`` ranks (the merge
    of ``export --merge`` starts from it)."""
    rows, cols = w.shape
    q = _torchao().to_nf4(w.float().contiguous(), block_size=NF4_BLOCK, scaler_block_size=scaler_block_size(rows, cols, world))
    return q.get_original_weight()


def check_qlora(lora: object, model_cfg: object, *, stage: int, dp: int, tp: int = 1, pp: int = 1, sp: int = 1,
                dp_replicate: int = 1, offload_params: str = "none", quantized_weights: bool = False) -> None:
    """Before start: a ``peft.base_quant=nf4`` run this build cannot do, by key and reason.  QLoRA is
    built on ZeRO-3 alone (FSDP2 shards and gathers the NF4 base; stages 0-2 would cast or replicate it);
    tp/pp would need NF4 split by columns or stages; ZeRO++'s quantized all-gather would re-quantize the
    codes; parameter offload moves plain tensors; HSDP and sp are untested here."""
    refusals = (
        (stage != 3, f"zero.stage={stage}", "QLoRA is built on ZeRO-3 (add +zero=stage3): FSDP2 shards the NF4 "
                                            "codes and scales and gathers them per block"),
        (tp > 1, f"parallel.tp={tp}", "tensor parallelism would split the NF4 codes by columns; not built"),
        (pp > 1, f"parallel.pp={pp}", "pipeline stages of an NF4 base are not built"),
        (sp > 1, f"parallel.sp={sp}", "sequence parallelism with an NF4 base is untested; not enabled"),
        (dp_replicate > 1, f"parallel.dp_replicate={dp_replicate}", "HSDP with an NF4 base is untested; not enabled"),
        (offload_params != "none", f"offload.params={offload_params}",
         "parameter offload moves plain tensors, not NF4's codes and scales"),
        (quantized_weights, "zero.quantized_weights=true", "ZeRO++ would quantize the already 4-bit codes again"),
    )
    for bad, key, why in refusals:
        if bad:
            raise ValueError(f"peft.base_quant=nf4 with {key}: {why}")
    from deepshard.finetune.models.lora import apply_lora
    from deepshard.finetune.models.registry import build_meta

    model = build_meta(model_cfg)
    with torch.device("meta"):
        apply_lora(model, r=lora.r, alpha=lora.alpha, target_modules=lora.target_modules,
                   modules_to_save=lora.modules_to_save, seed=None)
    check_nf4_model(model, world=dp // dp_replicate)


def count_nf4(model_cfg: object) -> int:
    """Elements of the block Linear weights ``peft.base_quant=nf4`` stores as NF4 (the estimator's count)."""
    from deepshard.finetune.models.registry import build_meta

    return sum(m.weight.numel() for _, m in nf4_weights(build_meta(model_cfg)))
