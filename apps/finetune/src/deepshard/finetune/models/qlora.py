"""QLoRA (``peft.base_quant=nf4``): the frozen base ``nn.Linear`` weights of the blocks stored as NF4.

The weights are torchao's ``NF4Tensor`` (QLoRA's format: 4-bit codes of the 16-value NormalFloat table,
one absmax scale per block of 64 elements, the scales themselves double-quantized to int8 in blocks of
up to 256 around their mean, with an fp32 factor per such block).  torchao implements FSDP2's
``fsdp_pre_all_gather``/``fsdp_post_all_gather`` and the row split for it, so ZeRO-3 shards the codes
and scales and all-gathers them per block; each projection dequantizes its gathered weight to the
activations' dtype inside the matmul (:func:`nf4_linear`, in forward and again in backward: keeping the
dequantized weight for backward would hold 4 B/param of a block per block, the memory QLoRA exists to
save), and frees it with the block.  The dequantization is one table lookup per code byte (both nibbles'
values at once) and one in-place scale per 64-block, where torchao's ``get_original_weight`` takes two
int64 gathers, two products and an interleaving stack (~12x slower on CPU); the values are bit-equal.

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
import torch.nn.functional as F
from torch import nn

from deepshard.finetune.models.lora import LoraLinear

__all__ = ["BASE_QUANTS", "NF4_BLOCK", "NF4_SCALER_BLOCK", "NF4_VALUES", "NF4Linear", "QLoraLinear", "apply_nf4", "check_nf4_model",
           "check_qlora", "count_nf4", "dequantize_nf4", "is_nf4", "nf4_bytes", "nf4_linear", "nf4_roundtrip",
           "nf4_weights", "quantize_nf4", "scaler_block_size"]

BASE_QUANTS = ("none", "nf4")
NF4_BLOCK = 64  # elements per absmax scale (QLoRA's, torchao's default)
NF4_SCALER_BLOCK = 256  # scales per double-quantization block (QLoRA's); smaller where a shard needs it
# the 16 NormalFloat values as torchao writes them (bitsandbytes' rounded to 4 decimals), ascending
NF4_VALUES = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
              0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0)


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


def _nearest_code(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The index of the table value nearest each of ``x`` (the table ascending), the lower one on a tie:
    torchao's ``min(|x - table|)`` over all 16 values (which keeps the first on a tie), from the two values
    that bracket ``x``; a NaN (a 64-block of zeros: 0/0) gets 0, as there."""
    hi = torch.searchsorted(table, x, out_int32=True).clamp_(max=table.numel() - 1)
    lo = (hi - 1).clamp_(min=0)
    nearer_hi = (x - table.index_select(0, hi)).abs() < (x - table.index_select(0, lo)).abs()
    return torch.where(nearer_hi, hi, lo).masked_fill_(x.isnan(), 0).to(torch.uint8)


@torch.no_grad()
def quantize_nf4(w: torch.Tensor, *, scaler_block_size: int) -> torch.Tensor:
    """``w`` (2-D, fp32) as an NF4Tensor: bit-equal to torchao's ``to_nf4(w, 64, scaler_block_size)``, whose
    nearest-code search builds a 16-wide difference per element (~2x slower here)."""
    import importlib

    q = _torchao()
    nf4_module = importlib.import_module(q.NF4Tensor.__module__)  # SubclassTensorArgs, nf4_constructor
    w = w.contiguous()
    table = torch.tensor(NF4_VALUES, device=w.device, dtype=w.dtype)
    blocks = w.flatten().view(-1, NF4_BLOCK)
    scalers, factor, mean = q.NF4Tensor.double_quantize_scalers(w.flatten(), NF4_BLOCK, scaler_block_size)
    codes = _nearest_code((blocks / blocks.abs().amax(dim=1, keepdim=True)).flatten(), table)
    meta = nf4_module.SubclassTensorArgs(w.size(), w.stride(), w.storage_offset(), w.dtype, w.device, w.requires_grad)
    return nf4_module.nf4_constructor(meta, NF4_BLOCK, blocks.shape[0], scaler_block_size, scalers, factor, mean,
                                      (codes[0::2] << 4) | codes[1::2], table)


@torch.no_grad()
def apply_nf4(model: nn.Module, *, world: int = 1) -> int:
    """Quantize the frozen block Linear weights of ``model`` (real weights, not yet sharded) to NF4, in
    place; ``world``: the ZeRO-3 ranks that will shard them.  Returns the elements quantized."""
    check_nf4_model(model, world=world)
    total = 0
    for name, module in list(nf4_weights(model)):
        assert not module.weight.requires_grad, f"{name} trains: QLoRA quantizes a frozen base only"
        w = module.weight.detach()
        rows, cols = w.shape
        q = quantize_nf4(w.float(), scaler_block_size=scaler_block_size(rows, cols, world))
        module.weight = nn.Parameter(q, requires_grad=False)
        # the same module, its forward through nf4_linear (no state added: parameters and hooks stay)
        module.__class__ = _NF4_CLASSES.get(type(module), type(module))
        total += w.numel()
    return total


def dequantize_nf4(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The plain weight of the NF4Tensor ``w`` (bit-equal to torchao's ``get_original_weight``), in ``dtype``.

    Each code byte holds two 4-bit codes, high nibble first: a 256-entry table of value pairs (as one
    int64 per pair) turns every byte into both values with one gather, then each 64-block is scaled in
    place by its double-dequantized absmax (int8 / factor + mean, torchao's order of operations)."""
    if not w.is_contiguous():  # a transposed view (``w.t()``): dequantize the stored layout
        return dequantize_nf4(w.t(), dtype).t()
    table = w.nf4
    pairs = torch.stack([table.repeat_interleave(16), table.repeat(16)], dim=1).to(torch.float32)
    # index_select with an int32 index: ~3x faster than indexing with int64 codes on CPU
    values = torch.index_select(pairs.view(torch.int64).flatten(), 0, w.quantized_data.int())
    values = values.view(torch.float32).to(w.dtype)
    scales = (w.quantized_scalers.view(-1, w.scaler_block_size) / w.quantization_factor[:, None]).flatten()
    scales = scales.to(w.dtype) + w.scaler_mean
    out = values.view(-1, w.block_size).mul_(scales[:, None]).view(w.shape)
    return out if dtype is None else out.to(dtype)


class _LinearNF4(torch.autograd.Function):
    """``x W^T`` for a frozen NF4 ``W``: it saves the codes (0.5 B/param), not the dequantized weight,
    and dequantizes again for the input's gradient (torchao's ``LinearNF4``, our dequantization)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return F.linear(x, dequantize_nf4(weight, x.dtype))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (weight,) = ctx.saved_tensors
        return grad @ dequantize_nf4(weight, grad.dtype), None


def nf4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with an NF4Tensor weight (frozen: no weight gradient)."""
    out = _LinearNF4.apply(x, weight)
    return out if bias is None else out + bias


class NF4Linear(nn.Linear):
    """An ``nn.Linear`` whose frozen weight is an NF4Tensor (a block Linear without adapters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_linear(x, self.weight, self.bias)


class QLoraLinear(LoraLinear):
    """A LoRA layer on an NF4 base weight: the adapters as LoraLinear's, the base through :func:`nf4_linear`."""

    def base(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_linear(x, self.weight, self.bias)


_NF4_CLASSES: dict[type, type] = {nn.Linear: NF4Linear, LoraLinear: QLoraLinear}


@torch.no_grad()
def nf4_roundtrip(w: torch.Tensor, *, world: int = 1) -> torch.Tensor:
    """The fp32 weight training saw for the base weight ``w`` quantized at ``world`` ranks (the merge
    of ``export --merge`` starts from it)."""
    rows, cols = w.shape
    return dequantize_nf4(quantize_nf4(w.float(), scaler_block_size=scaler_block_size(rows, cols, world)))


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
