"""ZeRO++'s quantized collectives for stage 3, handed to FSDP2 through its custom-collective hooks
(``set_custom_all_gather`` / ``set_custom_reduce_scatter``, where the gloo forms already live).

qwZ (:class:`QuantizedAllGather`): each rank quantizes its shard of a unit's flat all-gather input
to int8 blocks (one fp32 scale per block), the codes and scales are all-gathered, and every rank
dequantizes every segment, its own included, so all ranks compute with the same weights.  The
sharded fp32 params (the masters) are never touched: only the gathered copy is rounded.

qgZ (:class:`QuantizedReduceScatter`): the unsharded gradient's ``W`` destination chunks are
quantized (int8 or int4 blocks) and exchanged by all-to-all in two hops, DeepSpeed's hierarchical
scheme: inside each node first (each rank receives, for its local index, the chunks of every node
and sums them in fp32), then the node partial sums are re-quantized and exchanged across nodes
between ranks of the same local index, summed in fp32 on arrival.  One node (or one rank per node)
is a single hop.  Quantization is symmetric and unbiased only on average, as DeepSpeed's: the error
per element is at most half a step of its block.  With ``zero.loco`` every quantization adds back what
the previous one rounded away (LoCo's error feedback, ``zero.loco``).  Under HSDP the all-reduce across
the replicas is quantized too (``zero.replica_reduce``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from deepshard.core.zero.collectives import Works, all_gather_in_place
from deepshard.core.zero.loco import ErrorFeedback
from deepshard.kernels.quantize import (
    DEFAULT_BLOCK,
    code_bytes,
    dequantize_blockwise,
    num_blocks,
    quantize_blockwise,
)

__all__ = ["QuantizedAllGather", "QuantizedReduceScatter", "node_mesh", "pack_rows", "trim_codes", "unpack_rows",
           "untrim_codes", "zeropp_all_gather"]


class _PlainAlloc:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


def _all_gather(buf: torch.Tensor, rank: int, world: int, group: dist.ProcessGroup) -> Works:
    return all_gather_in_place(buf, rank, world, group)  # gloo: one broadcast per segment; else native


class _Dequantized(Works):
    """The gather's works, then the dequantization into FSDP2's output, when FSDP2 waits."""

    def __init__(self, works: list[dist.Work], finish) -> None:
        super().__init__(works)
        self.finish = finish

    def wait(self, timeout: object = None) -> bool:
        super().wait()
        if self.finish is not None:
            self.finish()
            self.finish = None
        return True


class QuantizedAllGather(_PlainAlloc, AllGather):
    """qwZ: FSDP2's parameter all-gather carrying int8 blocks (floating outputs; others as they are).

    ``group_size``: only gathers over groups of this many ranks (the ZeRO group) are quantized; a
    smaller one is hpZ's backward gather inside a node, which DeepSpeed keeps in the compute dtype
    (and re-quantizing already dequantized weights would only add error).  None: every gather.
    """

    def __init__(self, *, block_size: int = DEFAULT_BLOCK, group_size: int | None = None) -> None:
        self.block_size, self.group_size = block_size, group_size

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        world, rank = group.size(), group.rank()
        seg = output_tensor.numel() // world
        exact = self.group_size is not None and world != self.group_size  # hpZ's intra-node gather
        if exact or not output_tensor.is_floating_point():  # (mixed-dtype units gather raw bytes)
            mine = output_tensor[rank * seg:(rank + 1) * seg]
            if mine.data_ptr() != input_tensor.data_ptr():
                mine.copy_(input_tensor)
            work = _all_gather(output_tensor, rank, world, group)
            return work if async_op else work.wait() and None
        nb = num_blocks(seg, self.block_size)
        # one message per rank: its block scales' bytes, then its codes (one broadcast per rank, not two)
        packed = torch.empty(world, 4 * nb + seg, dtype=torch.uint8, device=output_tensor.device)
        my_codes, my_scales = quantize_blockwise(input_tensor.reshape(-1), block_size=self.block_size, bits=8)
        packed[rank].copy_(pack_rows(my_codes, my_scales, 1).view(-1))
        works = _all_gather(packed.view(-1), rank, world, group).works

        def finish() -> None:
            codes, scales = unpack_rows(packed, nb, torch.int8, flat=False)
            for r in range(world):
                output_tensor[r * seg:(r + 1) * seg].copy_(dequantize_blockwise(
                    codes[r], scales[r], seg, block_size=self.block_size, bits=8, dtype=output_tensor.dtype))

        work = _Dequantized(works, finish)
        if async_op:
            return work
        work.wait()
        return None


def node_mesh(dp_mesh: DeviceMesh, node_size: int) -> DeviceMesh | None:
    """``dp_mesh`` (1-D) seen as ``(nodes, ranks per node)`` for qgZ's two hops; None for one hop.

    ``node_size`` 0: torchrun's ``LOCAL_WORLD_SIZE``.  Consecutive dp ranks share a node (torchrun's
    and the deepshard launcher's numbering).  Collective: every rank calls it.
    """
    size = dp_mesh.size()
    node_size = node_size or int(os.environ.get("LOCAL_WORLD_SIZE", size))
    if node_size >= size or node_size <= 1:
        return None
    if size % node_size:
        raise ValueError(f"zero.quantized_gradients_node_size={node_size} does not divide the ZeRO group's "
                         f"{size} ranks: use a divisor of {size} (ranks per node)")
    return dp_mesh._unflatten(0, (size // node_size, node_size), ("qgz_inter", "qgz_intra"))


def trim_codes(codes: torch.Tensor, rows: int, seg: int, seg_p: int, bits: int) -> torch.Tensor:
    """What goes on the wire of ``rows`` rows quantized at ``seg_p`` (whole blocks) elements each, of
    which ``seg`` are real: each row's codes without its padding (the scales are per block already)."""
    if seg == seg_p:
        return codes
    return codes.view(rows, code_bytes(seg_p, bits))[:, :code_bytes(seg, bits)].reshape(-1)


def pack_rows(codes: torch.Tensor, scales: torch.Tensor, rows: int) -> torch.Tensor:
    """``rows`` equal rows of codes and their block scales as one uint8 message [rows, bytes]: each row
    its scales' bytes, then its codes' (one collective carries both; the same bytes as two)."""
    return torch.cat([scales.view(rows, scales.numel() // rows).view(torch.uint8),
                      codes.view(rows, codes.numel() // rows).view(torch.uint8)], dim=1)


def unpack_rows(packed: torch.Tensor, scales_per_row: int, dtype: torch.dtype, *,
                flat: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_rows`: ``(codes, scales)``, flat (``flat``) or one row per rank."""
    sb = 4 * scales_per_row
    scales = packed[:, :sb].contiguous().view(torch.float32)
    codes = packed[:, sb:].view(dtype)
    return (codes.reshape(-1), scales.view(-1)) if flat else (codes, scales)


def untrim_codes(sent: torch.Tensor, rows: int, seg: int, seg_p: int, bits: int) -> torch.Tensor:
    """The inverse of :func:`trim_codes`; the padding decodes to zeros (int4: 0x88, two zero nibbles),
    so a sum that is quantized again keeps its last block's absmax."""
    if seg == seg_p:
        return sent
    full = torch.full((rows, code_bytes(seg_p, bits)), 0 if bits == 8 else 0x88, dtype=sent.dtype, device=sent.device)
    full[:, :code_bytes(seg, bits)] = sent.view(rows, -1)
    return full.view(-1)


class QuantizedReduceScatter(_PlainAlloc, ReduceScatter):
    """qgZ: FSDP2's gradient reduce-scatter as quantized all-to-alls (within node, then across)."""

    def __init__(self, *, bits: int = 8, block_size: int = DEFAULT_BLOCK, nodes: DeviceMesh | None = None,
                 feedback: ErrorFeedback | None = None, key: object = 0) -> None:
        self.bits, self.block_size, self.nodes = bits, block_size, nodes
        self.feedback, self.key = feedback, key  # LoCo: error buffers under (key, hop)

    def _groups(self, group: dist.ProcessGroup) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, int]:
        """(intra-node group, inter-node group, ranks per node) for ``group``."""
        if self.nodes is None or self.nodes.size() != group.size():
            return group, None, group.size()
        return self.nodes.get_group("qgz_intra"), self.nodes.get_group("qgz_inter"), self.nodes.size(1)

    def _quantize(self, x: torch.Tensor, hop: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.feedback is None:
            return quantize_blockwise(x, block_size=self.block_size, bits=self.bits)
        return self.feedback.quantize((self.key, hop), x, block_size=self.block_size, bits=self.bits)

    def _exchange(self, parts: torch.Tensor, group: dist.ProcessGroup, hop: str, seg: int) -> torch.Tensor:
        """``parts`` [G, ..., seg_p] fp32 (``seg`` real elements per row): part g goes to rank g of
        ``group`` as int blocks; returns the parts every rank sent here, dequantized, [G, ..., seg_p],
        to be summed by the caller."""
        g, seg_p = group.size(), parts.shape[-1]
        rows = parts.numel() // seg_p
        codes, scales = self._quantize(parts, hop)
        if g > 1:  # one all-to-all: to each peer its rows' scales and codes (the padding stays home)
            sent = pack_rows(trim_codes(codes, rows, seg, seg_p, self.bits), scales, g)
            recv = torch.empty_like(sent)
            dist.all_to_all_single(recv, sent, group=group)
            got, scales = unpack_rows(recv, scales.numel() // g, codes.dtype)
            codes = untrim_codes(got, rows, seg, seg_p, self.bits)
        return dequantize_blockwise(codes, scales, parts.numel(), block_size=self.block_size,
                                    bits=self.bits).view(parts.shape)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> dist.Work | None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or not output_tensor.is_floating_point():
            return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        world, seg = group.size(), output_tensor.numel()
        intra, inter, local = self._groups(group)
        nodes = world // local
        # each destination chunk padded to whole blocks, so no block straddles two destinations
        seg_p = num_blocks(seg, self.block_size) * self.block_size
        chunks = torch.zeros(nodes, local, seg_p, dtype=torch.float32, device=input_tensor.device)
        chunks[..., :seg] = input_tensor.view(nodes, local, seg)
        # hop 1, inside the node: local rank l gets chunk (n, l) of every node n from each node peer
        partial = self._exchange(chunks.transpose(0, 1).contiguous(), intra, "intra", seg).sum(dim=0)  # [nodes, seg_p]
        if inter is not None:  # hop 2, across nodes: chunk n of the node sums goes to node n
            partial = self._exchange(partial, inter, "inter", seg).sum(dim=0, keepdim=True)
        out = partial.view(-1)[:seg]
        if op == dist.ReduceOp.AVG:
            out = out / world
        output_tensor.copy_(out)
        return None


def zeropp_all_gather(shard_mesh: DeviceMesh) -> QuantizedAllGather:
    """qwZ's all-gather hook: gathers over the whole shard group quantized (hpZ's smaller ones exact)."""
    return QuantizedAllGather(group_size=shard_mesh.size(shard_mesh.ndim - 1))
