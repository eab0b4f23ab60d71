"""Consolidate a sharded DCP checkpoint one tensor at a time, in one process, without a group.

Export tools read the metadata, then ask DCP for a single full tensor at a time: the file
reader fetches only that tensor's chunks, so memory stays at about one tensor however large
the model is.  Which keys mean what (the HF names, the config) is the caller's business.  The
metadata goes through the restricted unpickler and byte items are refused (checkpoint.safe_load); a
tensor that does not load is a one-line CheckpointError naming its file.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from deepshard.core.checkpoint.failures import one_line, root_cause
from deepshard.core.checkpoint.manifest import CheckpointError
from deepshard.core.checkpoint.safe_load import SafeLoadPlanner, SafeReader, read_metadata_safely


@dataclass(frozen=True)
class TensorInfo:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def checked_metadata(path: str | os.PathLike) -> Metadata:
    """``path``'s metadata, read safely (and its files checked) once for as long as no file of the checkpoint
    directory changes: an export asks for it once per tensor, and parsing it cost ~0.1 s each time."""
    try:
        with os.scandir(path) as entries:  # lstat: a file replaced, grown or turned into a link is a new state
            state = tuple(sorted((e.name, e.inode(), *_lstamp(e)) for e in entries))
    except OSError:
        state = ()
    return _checked_metadata(str(path), state)


def _lstamp(entry: os.DirEntry) -> tuple[int, int, bool]:
    st = entry.stat(follow_symlinks=False)
    return st.st_mtime_ns, st.st_size, entry.is_symlink()


@functools.lru_cache(maxsize=8)
def _checked_metadata(path: str, state: tuple) -> Metadata:
    return read_metadata_safely(path)


def tensor_infos(path: str | os.PathLike, prefix: str = "") -> list[TensorInfo]:
    """Every tensor under ``prefix`` in the checkpoint, in saved order, with its full shape and dtype."""
    meta = checked_metadata(path)
    out = []
    for key, md in meta.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            out.append(TensorInfo(key, tuple(md.size), md.properties.dtype))
    return out


def load_full_tensor(path: str | os.PathLike, info: TensorInfo) -> torch.Tensor:
    """One tensor, consolidated from all its shards into a plain CPU tensor."""
    out = torch.empty(info.shape, dtype=info.dtype)
    try:
        with warnings.catch_warnings():  # "no process group: loading without one" is the point here
            warnings.simplefilter("ignore")
            dcp.load({info.key: out}, storage_reader=SafeReader(str(path), checked=checked_metadata(path)),
                     planner=SafeLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as err:  # one line naming the file (SafeReader) or the tensor
        cause = root_cause(err)
        if isinstance(cause, CheckpointError):
            raise CheckpointError(str(cause)) from None
        raise CheckpointError(f"checkpoint {str(path)!r}: reading {info.key} failed ({one_line(cause)})") from None
    return out


def iter_full_tensors(path: str | os.PathLike, prefix: str = "") -> Iterator[tuple[TensorInfo, torch.Tensor]]:
    """``(info, tensor)`` for every tensor under ``prefix``, one at a time (drop each before the next)."""
    for info in tensor_infos(path, prefix):
        yield info, load_full_tensor(path, info)
