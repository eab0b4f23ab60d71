"""Crafted checkpoints for the safe-loading tests: a good checkpoint whose DCP metadata or extra
state would run code when unpickled, resealed (the manifest's crc32 detects damage, not tampering)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

from deepshard.core.checkpoint.manifest import MANIFEST, describe_files, list_files


class RunsCode:
    """Unpickling this runs ``touch MARKER`` (what an attacker's payload would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def reseal(ckpt: Path) -> None:
    """Recompute the manifest's file list and checksums, as an attacker would."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"] = describe_files(ckpt, list_files(ckpt))
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def poison_metadata(ckpt: Path, marker: Path) -> None:
    """Replace ``.metadata`` with a pickle whose loading runs a shell command."""
    (ckpt / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    reseal(ckpt)


def add_pickled_item(ckpt: Path, marker: Path, key: str = "trainer") -> None:
    """Declare a byte item ``key`` in the real metadata (DCP would torch.load(weights_only=False) it),
    its bytes being a payload that runs a shell command -- what the old format's extra state was."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own test checkpoint: trusted here
    payload = pickle.dumps(RunsCode(marker))
    (ckpt / "__9_0.distcp").write_bytes(payload)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(relative_path="__9_0.distcp", offset=0,
                                                             length=len(payload))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(ckpt)
