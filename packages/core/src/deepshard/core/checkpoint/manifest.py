"""What makes a checkpoint directory trustworthy: a manifest of every file's size and checksum.

A save writes into ``step-NNNNNNNN.tmp-XXXXXXXX`` and is renamed into place only once complete, with
``manifest.json`` written last; so a directory named ``step-NNNNNNNN`` without a manifest, with a
file of the wrong size or checksum, is a half-written or damaged save and is refused by name.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepshard.core.checkpoint import progress
from deepshard.core.checkpoint.owners import OWNER, write_owner
from deepshard.core.checkpoint.plain_files import write_text

log = logging.getLogger("deepshard.checkpoint")

MANIFEST = "manifest.json"
FORMAT = "deepshard-checkpoint/2"  # /1 pickled its scalars: not loaded, since unpickling can run code
STEP_DIR = re.compile(r"^step-(\d{8,})$")
TEMP_DIR = re.compile(r"^step-(\d{8,})\.(tmp|init|old)-([0-9a-f]{8})$")  # exactly the names our saves give
_CHUNK = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, half-written, corrupted or incompatible."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def crc32_file(path: Path) -> str:
    """CRC-32 of a file, read in chunks (zlib's crc32 runs at ~3 GB/s here, sha256 at ~0.8); each chunk is
    reported as progress (sealing a large save on a slow filesystem reads it all back)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            progress.report(len(chunk))
    return f"{crc:08x}"


def list_files(directory: Path) -> list[str]:
    """Every regular file below ``directory`` except the manifest, as sorted relative paths."""
    out = []
    for root, _, files in os.walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel not in (MANIFEST, OWNER):
                out.append(rel)
    return sorted(out)


def describe_files(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes", "crc32"}}`` for the given files (each rank describes its share)."""
    return {n: {"bytes": (directory / n).stat().st_size, "crc32": crc32_file(directory / n)} for n in names}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` durably (temp file, fsync, rename): the last file of a save."""
    tmp = directory / (MANIFEST + ".tmp")
    write_text(tmp, json.dumps(manifest, indent=1, sort_keys=True, default=str), fsync=True)
    os.replace(tmp, directory / MANIFEST)
    _fsync_dir(directory)


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a directory holding a deepshard manifest (sound or not): one of our saves."""
    mpath = path / MANIFEST
    if path.is_symlink() or not path.is_dir() or mpath.is_symlink() or not mpath.is_file():
        return False
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(manifest, dict) and str(manifest.get("format", "")).startswith("deepshard-checkpoint/")


def in_the_way(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{str(path)!r} is in the way: {what}; it was left alone (move or rename it)")


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished temp directory into place, replacing an older save of the same step, never
    anything else (CheckpointError naming what is in the way)."""
    if final.exists() or final.is_symlink():
        if not is_checkpoint(final):
            raise in_the_way(final, f"it is not a deepshard checkpoint (no {MANIFEST} of ours), so this save is "
                                    f"not put in its place")
        old = final.with_name(final.name + ".old-" + tmp.name.rsplit("-", 1)[-1])
        if old.exists() or old.is_symlink():
            raise in_the_way(old, "the name this save gives the older checkpoint it replaces")
        write_owner(final)  # the replaced save, renamed .old-, stays ours to remove if we die before the rmtree
        os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:
            os.replace(old, final)  # put the older save back
            (final / OWNER).unlink(missing_ok=True)
            raise
        shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint: %s replaced an older save of the same step (removed)", final)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a checkpoint directory; CheckpointError when absent or unreadable."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r}: no such directory")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r}: no {MANIFEST}, so the save never finished (or this is "
                              f"not a deepshard checkpoint); resume from an earlier step-* directory")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} is unreadable ({err})") from err
    if manifest.get("format") == "deepshard-checkpoint/1":
        raise CheckpointError(f"checkpoint {str(path)!r}: format deepshard-checkpoint/1 stores pickled state, which "
                              f"is not loaded (unpickling can run code); it was written by an older deepshard")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def file_problem(directory: str | os.PathLike, name: str) -> str | None:
    """Why ``directory/name`` is not safe to read as a file of the checkpoint (None when it is): it
    must be a plain relative name, a regular file, with no symlink on the way below ``directory``."""
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or "\0" in name or any(q in ("", ".", "..") for q in parts):
        return f"{name!r} is outside the checkpoint"
    at = Path(directory)
    for i, part in enumerate(parts):
        at = at / part
        try:
            mode = os.lstat(at).st_mode
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as err:
            return f"{name} cannot be read ({err.strerror})"
        if stat.S_ISLNK(mode):
            return f"{'/'.join(parts[:i + 1])!r} is a symlink (only regular files inside the checkpoint are read)"
        if i < len(parts) - 1 and not stat.S_ISDIR(mode):
            return f"{name} is missing"
    return None if stat.S_ISREG(mode) else f"{name!r} is not a regular file"


def checked_file(directory: str | os.PathLike, name: str, manifest: dict[str, Any]) -> Path:
    """``directory/name`` if the manifest lists it and it is a regular file inside the checkpoint (its
    size and checksum are :func:`verify_files`' business); CheckpointError naming it otherwise."""
    problem = file_problem(directory, name)
    if problem is None and name not in manifest.get("files", {}):
        problem = f"{name!r} is a file the manifest does not list (added after the save, or crafted)"
    if problem is not None:
        raise CheckpointError(f"checkpoint {str(directory)!r}: {problem}: refused")
    return Path(directory) / name


def sealed_files(directory: str | os.PathLike, manifest: dict[str, Any], folder: str) -> list[str]:
    """The files the manifest lists under ``folder`` (e.g. ``tokenizer``), each a regular file inside the
    checkpoint; anything else there (a symlink, a file the manifest does not list) is a CheckpointError
    naming it, so a tool that copies the folder copies exactly what the save sealed."""
    directory = Path(directory)
    listed = sorted(n for n in manifest.get("files", {}) if n.startswith(folder + "/"))
    top = directory / folder
    if top.is_symlink():
        raise CheckpointError(f"checkpoint {str(directory)!r}: {folder!r} is a symlink: refused")
    for root, dirs, files in os.walk(top):
        for name in sorted(dirs + files):
            rel = os.path.relpath(os.path.join(root, name), directory)
            if os.path.islink(os.path.join(root, name)):
                raise CheckpointError(f"checkpoint {str(directory)!r}: {rel!r} is a symlink: refused (only regular "
                                      f"files the manifest lists are read)")
            if name in files and rel not in manifest.get("files", {}):
                raise CheckpointError(f"checkpoint {str(directory)!r}: {rel!r} is a file the manifest does not "
                                      f"list (added after the save, or crafted): refused")
    for name in listed:
        checked_file(directory, name, manifest)
    return listed


def verify_files(path: str | os.PathLike, manifest: dict[str, Any], *, part: tuple[int, int] = (0, 1),
                 checksums: bool = True) -> list[str]:
    """Problems with the files of ``part = (index, count)`` of the manifest (all by default).

    Sizes are always checked (a truncated shard is caught without reading it); checksums unless
    ``checksums=False``.  Returns human-readable problems, empty when the files are intact.
    """
    path = Path(path)
    index, count = part
    problems = []
    for i, (name, info) in enumerate(sorted(manifest["files"].items())):
        if i % count != index:
            continue
        f = path / name
        problem = file_problem(path, name)
        if problem is not None:
            problems.append(problem)
            continue
        size = f.stat().st_size
        if size != info["bytes"]:
            problems.append(f"{name} has {size} bytes, the manifest says {info['bytes']} (truncated or half-written)")
        elif checksums and crc32_file(f) != info["crc32"]:
            problems.append(f"{name} fails its crc32 checksum (corrupted)")
    return problems


def verify_checkpoint(path: str | os.PathLike, *, checksums: bool = True) -> dict[str, Any]:
    """Read the manifest and check every file; returns the manifest or raises CheckpointError."""
    manifest = read_manifest(path)
    problems = verify_files(path, manifest, checksums=checksums)
    if problems:
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: " + "; ".join(problems))
    return manifest


@dataclass
class Candidate:
    path: Path
    step: int


def step_dirs(root: str | os.PathLike) -> list[Candidate]:
    """Published ``step-*`` directories under ``root``, newest first (temp dirs are never listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append(Candidate(p, int(m.group(1))))
    return sorted(found, key=lambda c: c.step, reverse=True)


def latest_good(root: str | os.PathLike, *, checksums: bool = True) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under ``root`` that verifies, and why each newer one was skipped."""
    skipped = []
    for cand in step_dirs(root):
        try:
            verify_checkpoint(cand.path, checksums=checksums)
        except CheckpointError as err:
            skipped.append(str(err))
            continue
        return cand.path, skipped
    return None, skipped


