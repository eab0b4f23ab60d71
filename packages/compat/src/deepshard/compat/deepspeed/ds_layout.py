"""DeepSpeed's ZeRO-1/2/3 checkpoint layout, read: which rank file holds which piece of each fp32
master and Adam moment, and each parameter's whole tensor assembled from its pieces.

Only rank 0's files are read to learn the layout; every other file is mapped when a parameter needs
a piece of it (``ds_files.load_ds_file``: ``weights_only=True, mmap=True``), so a parameter costs
about its own size in memory.  Whatever a file lacks (a key, a type, enough elements) is a
ValueError naming the file.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .ds_files import load_ds_file, rank_files

__all__ = ["DsCheckpoint", "Param", "reading"]


@dataclass(frozen=True)
class Param:
    """One trainable parameter in DeepSpeed's flat buffers: where its elements start."""

    name: str
    shape: tuple[int, ...]
    group: int
    offset: int  # stages 1-2: start in its group's flat vector; stage 3: start in each rank's flat partition

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@contextlib.contextmanager
def reading(file: Path) -> Iterator[None]:
    """What a file's contents do not have (a key, a type, enough elements) as a ValueError naming it."""
    try:
        yield
    except KeyError as err:
        raise ValueError(f"{file}: not a DeepSpeed ZeRO checkpoint this importer reads (no key {err.args[0]!r})") \
            from None
    except (TypeError, AttributeError, IndexError, StopIteration, RuntimeError) as err:
        raise ValueError(f"{file}: not a DeepSpeed ZeRO checkpoint this importer reads ({type(err).__name__}: "
                         f"{' '.join(str(err).split())[:200]})") from None


class DsCheckpoint:
    """The layout of one DeepSpeed checkpoint tag, read from rank 0's files (tensors stay mapped)."""

    def __init__(self, tag_dir: Path) -> None:
        self.tag_dir = tag_dir
        self.optim_files = rank_files(tag_dir, "optim_states")
        if not self.optim_files:
            raise ValueError(f"{tag_dir}: no *zero_pp_rank_*_optim_states.pt: not a ZeRO checkpoint (stage 0 "
                             f"checkpoints keep the optimizer in mp_rank_00_model_states.pt, not supported)")
        model_file = tag_dir / "mp_rank_00_model_states.pt"
        if not model_file.is_file():
            model_file = rank_files(tag_dir, "model_states")[0]
        self.model_file = model_file
        self.model_states = load_ds_file(model_file)
        with reading(model_file):
            if self.model_states.get("frozen_param_shapes"):
                raise ValueError(f"{model_file}: frozen parameters {list(self.model_states['frozen_param_shapes'])}: "
                                 f"not supported by the importer yet")
        self.world = len(self.optim_files)
        with reading(self.optim_files[0]):
            osd = load_ds_file(self.optim_files[0])["optimizer_state_dict"]
            self.stage = int(osd["zero_stage"])
            self.osd_meta = {k: v for k, v in osd.items() if k not in ("single_partition_of_fp32_groups",
                                                                      "fp32_flat_groups", "base_optimizer_state",
                                                                      "optimizer_state_dict")}
            base = osd["base_optimizer_state"] if self.stage < 3 else osd["optimizer_state_dict"]
            self.adam_step = int(next(iter(base["state"].values()))["step"])
            self.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]]
            flats = self._flats(osd, "master")
            self.group_sizes = [int(t.numel()) for t in flats]
        with reading(model_file):
            self.params = self._layout()
        del osd, base, flats

    def _flats(self, osd: dict, kind: str) -> list[torch.Tensor]:
        """One rank's flat partitions of ``kind`` (one per group, or per sub-group at stage 3)."""
        if kind == "master":
            return list(osd["single_partition_of_fp32_groups"] if self.stage < 3 else osd["fp32_flat_groups"])
        base = osd["base_optimizer_state"] if self.stage < 3 else osd["optimizer_state_dict"]
        return [base["state"][i][kind] for i in sorted(base["state"])]

    def _layout(self) -> list[Param]:
        shapes = self.model_states["param_shapes"]
        out = []
        if self.stage < 3:
            # zero_optimization.parameter_alignment: each parameter but a group's last padded to 16 bytes
            paddings = self.osd_meta.get("param_alignment_paddings") or [[0] * len(g) for g in shapes]
            for g, group in enumerate(shapes):
                offset = 0
                for (name, shape), pad in zip(group.items(), paddings[g], strict=True):
                    out.append(Param(name, tuple(shape), g, offset))
                    offset += math.prod(shape) + int(pad)
                if offset > self.group_sizes[g] * self.world:
                    raise ValueError(f"{self.tag_dir}: group {g} has {offset} elements but its partitions hold "
                                     f"{self.group_sizes[g]} x {self.world}: files of different runs?")
        else:
            offset = 0  # each rank's flat partition is its ceil(numel / world) slice of every param, in order
            for group in shapes:
                for name, shape in group.items():
                    out.append(Param(name, tuple(shape), 0, offset))
                    offset += math.ceil(math.prod(shape) / self.world)
            if offset > sum(self.group_sizes):
                raise ValueError(f"{self.tag_dir}: the parameters need {offset} elements per rank, the partitions "
                                 f"hold {sum(self.group_sizes)}: files of different runs?")
        return out

    def full(self, param: Param, kind: str) -> torch.Tensor:
        """The whole fp32 ``kind`` tensor of ``param``, from the rank files that hold pieces of it."""
        out = torch.empty(param.numel, dtype=torch.float32)
        if self.stage < 3:
            size = self.group_sizes[param.group]
            first, last = param.offset // size, (param.offset + param.numel - 1) // size
            for rank in range(first, last + 1):
                with reading(self.optim_files[rank]):
                    flat = self._flats(load_ds_file(self.optim_files[rank])["optimizer_state_dict"], kind)[param.group]
                short_last = rank == self.world - 1 and flat.numel() >= param.offset + param.numel - rank * size
                if flat.numel() != size and not short_last:  # the last rank's may stop at its data (aligned layout)
                    raise ValueError(f"{self.optim_files[rank]}: its {kind} partition of group {param.group} holds "
                                     f"{flat.numel()} elements, rank 0's {size}: truncated, or files of different runs?")
                lo, hi = max(param.offset, rank * size), min(param.offset + param.numel, (rank + 1) * size)
                out[lo - param.offset:hi - param.offset] = flat[lo - rank * size:hi - rank * size]
        else:
            part = math.ceil(param.numel / self.world)
            for rank in range(self.world):
                lo, hi = rank * part, min((rank + 1) * part, param.numel)
                if hi > lo:
                    with reading(self.optim_files[rank]):
                        flats = self._flats(load_ds_file(self.optim_files[rank])["optimizer_state_dict"], kind)
                        out[lo:hi] = _take(flats, param.offset, hi - lo)
        return out.view(param.shape)


def _take(flats: list[torch.Tensor], start: int, length: int) -> torch.Tensor:
    """``length`` elements from ``start`` of the concatenation of ``flats`` (without concatenating)."""
    pieces = []
    for t in flats:
        n = t.numel()
        if start < n and length > 0:
            k = min(length, n - start)
            pieces.append(t[start:start + k])
            length -= k
            start = 0
        else:
            start -= n
    if length:  # the file holds fewer elements than the layout says
        raise IndexError(f"parameter at {start}: its partitions end {length} element(s) short")
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()
