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
per element is at most half a step of its block.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from deepshard.core.zero.collectives import Works, all_gather_in_place
from deepshard.kernels.quantize import DEFAULT_BLOCK, dequantize_blockwise, num_blocks, quantize_blockwise

__all__ = ["QuantizedAllGather", "QuantizedReduceScatter", "node_mesh"]


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
        codes = torch.empty(world * seg, dtype=torch.int8, device=output_tensor.device)
        scales = torch.empty(world * nb, dtype=torch.float32, device=output_tensor.device)
        my_codes, my_scales = quantize_blockwise(input_tensor.reshape(-1), block_size=self.block_size, bits=8)
        codes[rank * seg:(rank + 1) * seg].copy_(my_codes)
        scales[rank * nb:(rank + 1) * nb].copy_(my_scales)
        works = _all_gather(codes, rank, world, group).works + _all_gather(scales, rank, world, group).works

        def finish() -> None:
            for r in range(world):
                output_tensor[r * seg:(r + 1) * seg].copy_(dequantize_blockwise(
                    codes[r * seg:(r + 1) * seg], scales[r * nb:(r + 1) * nb], seg, block_size=self.block_size,
                    bits=8, dtype=output_tensor.dtype))

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


class QuantizedReduceScatter(_PlainAlloc, ReduceScatter):
    """qgZ: FSDP2's gradient reduce-scatter as quantized all-to-alls (within node, then across)."""

    def __init__(self, *, bits: int = 8, block_size: int = DEFAULT_BLOCK, nodes: DeviceMesh | None = None) -> None:
        self.bits, self.block_size, self.nodes = bits, block_size, nodes

    def _groups(self, group: dist.ProcessGroup) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, int]:
        """(intra-node group, inter-node group, ranks per node) for ``group``."""
        if self.nodes is None or self.nodes.size() != group.size():
            return group, None, group.size()
        return self.nodes.get_group("qgz_intra"), self.nodes.get_group("qgz_inter"), self.nodes.size(1)

    def _exchange(self, parts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """``parts`` [G, ..., seg_p] fp32: part g goes to rank g of ``group`` as int blocks; returns the
        parts every rank sent here, dequantized, [G, ..., seg_p], to be summed by the caller."""
        g = group.size()
        codes, scales = quantize_blockwise(parts, block_size=self.block_size, bits=self.bits)
        if g > 1:
            recv_codes, recv_scales = torch.empty_like(codes), torch.empty_like(scales)
            dist.all_to_all_single(recv_codes, codes, group=group)
            dist.all_to_all_single(recv_scales, scales, group=group)
            codes, scales = recv_codes, recv_scales
        return dequantize_blockwise(codes, scales, parts.numel(), block_size=self.block_size,
                                    bits=self.bits).view(parts.shape)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> dist.Work | None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or not output_tensor.is_floating_point():
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        world, seg = group.size(), output_tensor.numel()
        intra, inter, local = self._groups(group)
        nodes = world // local
        # each destination chunk padded to whole blocks, so no block straddles two destinations
        seg_p = num_blocks(seg, self.block_size) * self.block_size
        chunks = torch.zeros(nodes, local, seg_p, dtype=torch.float32, device=input_tensor.device)
        chunks[..., :seg] = input_tensor.view(nodes, local, seg)
        # hop 1, inside the node: local rank l gets chunk (n, l) of every node n from each node peer
        partial = self._exchange(chunks.transpose(0, 1).contiguous(), intra).sum(dim=0)  # [nodes, seg_p]
        if inter is not None:  # hop 2, across nodes: chunk n of the node sums goes to node n
            partial = self._exchange(partial, inter).sum(dim=0, keepdim=True)
        out = partial.view(-1)[:seg]
        if op == dist.ReduceOp.AVG:
            out = out / world
        output_tensor.copy_(out)
        return None


def zeropp_collectives(shard_mesh: DeviceMesh, *, quantized_weights: bool, quantized_gradients: bool,
                       gradient_bits: int = 8, node_size: int = 0,
                       ) -> tuple[QuantizedAllGather | None, QuantizedReduceScatter | None]:
    """The (all-gather, reduce-scatter) hooks ZeRO++'s switches ask for (None: FSDP2's or the gloo
    forms).  Under HSDP (a 2-D ``shard_mesh``) the reduce-scatter group is one node already: qgZ is
    one hop there, and the all-reduce across the replicas stays FSDP2's own."""
    gather = QuantizedAllGather(group_size=shard_mesh.size(shard_mesh.ndim - 1)) if quantized_weights else None
    scatter = None
    if quantized_gradients:
        nodes = node_mesh(shard_mesh, node_size) if shard_mesh.ndim == 1 else None
        scatter = QuantizedReduceScatter(bits=gradient_bits, nodes=nodes)
    return gather, scatter
