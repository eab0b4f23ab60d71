"""Reading a checkpoint executes nothing from it.

DCP stores its ``.metadata`` as a pickle, and its default planner unpickles byte items with
``torch.load(weights_only=False)``: either would run whatever code a crafted file names.  Here
the metadata goes through an unpickler that admits only DCP's metadata classes, ``torch.Size``,
dtypes and paths; byte items are refused outright (deepshard checkpoints hold only tensors, and
their scalars in JSON); tensor data is read by DCP with ``torch.load(weights_only=True)``.

Every file read is one the manifest lists, a regular file inside the checkpoint (its size and
checksum are verified before a load or export): ``.metadata`` itself, and each shard file its
storage entries name (a ``relative_path`` such as ``../../outside.distcp`` is refused by name).
A shard that does not read as tensor data is refused naming the file, in one line.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.futures import Future

from deepshard.core.checkpoint.failures import one_line
from deepshard.core.checkpoint.manifest import CheckpointError, checked_file, file_problem, read_manifest

__all__ = ["SafeLoadPlanner", "SafeReader", "read_metadata_safely"]

METADATA = ".metadata"
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the names DCP's metadata is made of; anything else is an error naming it."""

    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file)
        self.source = source

    _admitted: dict[tuple[str, str], Any] = {}  # names resolved once (a metadata names its classes thousands of times)

    def find_class(self, module: str, name: str) -> Any:
        found = self._admitted.get((module, name))
        if found is not None:
            return found
        if name in _DCP_CLASSES.get(module, ()):
            found = super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is not None:
            self._admitted[(module, name)] = found
            return found
        raise CheckpointError(f"{str(self.source)!r} asks to load {module}.{name}, which is not part of DCP's "
                              f"metadata: refused, nothing from it was run (the file is crafted or not a DCP checkpoint)")


def read_metadata_safely(path: str | os.PathLike, *, allow_bytes: bool = False,
                         manifest: dict[str, Any] | None = None) -> Metadata:
    """The DCP metadata of checkpoint directory ``path``, unpickled with the restricted unpickler.

    A byte (pickled object) item is refused unless ``allow_bytes``: loading one would unpickle it.
    ``.metadata`` and every file it names must be regular files inside ``path`` that the manifest
    (``path``'s own unless given) lists; CheckpointError naming the first that is not.
    """
    if manifest is None:
        manifest = read_manifest(path)
    source = Path(path) / METADATA
    if os.path.lexists(source):  # missing: the FileNotFoundError below says so
        checked_file(path, METADATA, manifest)
    try:
        with open(source, "rb") as f:
            metadata = _MetadataUnpickler(f, source).load()
    except CheckpointError:
        raise
    except FileNotFoundError as err:
        raise CheckpointError(f"{str(source)!r}: missing, so this is not a complete DCP checkpoint") from err
    except Exception as err:  # truncated or garbage pickle
        raise CheckpointError(f"{str(source)!r} is unreadable ({type(err).__name__}: {err})") from err
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{str(source)!r} holds a {type(metadata).__name__}, not DCP metadata")
    if not allow_bytes:
        items = [k for k, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)]
        if items:
            raise CheckpointError(f"{str(source)!r} declares pickled object item(s) {items[:3]}: a deepshard "
                                  f"checkpoint holds only tensors, and unpickling them could run code; refused")
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    seen: set[str] = set()
    for index, info in storage.items():
        rel = getattr(info, "relative_path", None)
        if rel in seen:
            continue
        if not isinstance(rel, str):
            raise CheckpointError(f"{str(source)!r} names no file for item {getattr(index, 'fqn', index)!r}: refused")
        problem = file_problem(path, rel)
        if problem is None and rel not in manifest.get("files", {}):
            problem = f"{rel!r} is a file the manifest does not list (added after the save, or crafted)"
        if problem is not None:
            raise CheckpointError(f"{str(source)!r} stores item {getattr(index, 'fqn', index)!r} in {rel!r}, but "
                                  f"{problem}: refused, nothing was read from it")
        seen.add(rel)
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata_safely` in place of ``pickle.load``, reading only
    the files that checked, and naming the file whose data does not load.  ``checked``: metadata this
    process already read safely from ``path`` (consolidation reads one tensor per load, and parsing
    the metadata each time cost ~0.1 s per tensor); it is not modified."""

    def __init__(self, path: str | os.PathLike, *, checked: Metadata | None = None) -> None:
        super().__init__(path)
        self.checked = checked

    # no **kwargs: DCP then never falls back to unpickling a per-rank ``__N.metadata`` file
    def read_metadata(self, *args: Any) -> Metadata:
        metadata = self.checked if self.checked is not None else read_metadata_safely(self.path)
        self.checked_files = {info.relative_path for info in metadata.storage_data.values()}
        storage_meta = dataclasses.replace(metadata.storage_meta or StorageMeta(), load_id=self.load_id)
        return dataclasses.replace(metadata, storage_meta=storage_meta)

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, items in per_file.items():
            source = str(Path(self.path) / rel)
            if rel not in getattr(self, "checked_files", ()):
                raise CheckpointError(f"{source!r} was not among the files .metadata names: refused")
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:
                raise
            except Exception as err:
                raise CheckpointError(f"{source!r} does not hold tensor data this checkpoint can load "
                                      f"({one_line(err)}): refused, nothing from it was run") from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


class SafeLoadPlanner(DefaultLoadPlanner):
    """Refuses byte items (DCP would ``torch.load(weights_only=False)`` them)."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CheckpointError(f"item {read_item.dest_index.fqn!r} is a pickled object: refused, a deepshard "
                              f"checkpoint holds only tensors")
