"""The non-tensor part of a checkpoint as JSON files beside DCP's shards (covered by the manifest).

``trainer.json`` (rank 0): update count, loss scaler, the caller's app state, the saving layout.
``rng/rank-N.json`` (each rank): torch, CUDA, Python and NumPy generator states as integer lists.
JSON cannot carry code, so reading these runs nothing; a malformed file, or one the manifest does
not list (or a symlink), is a CheckpointError naming it.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import torch

from deepshard.core.checkpoint import progress
from deepshard.core.checkpoint.manifest import CheckpointError, checked_file, read_manifest
from deepshard.core.checkpoint.plain_files import write_text

TRAINER = "trainer.json"


def rng_file(rank: int) -> str:
    return f"rng/rank-{rank}.json"


def rng_state() -> dict[str, Any]:
    """This process's generator states, JSON-ready."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state().tolist(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def write_json(directory: Path, name: str, value: Any) -> None:
    """``directory/name`` as JSON, fsynced; TypeError (naming the file) for values JSON cannot hold."""
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        text = json.dumps(value, allow_nan=True)
    except TypeError as err:
        raise TypeError(f"checkpoint {name}: state must be JSON (numbers, strings, lists, dicts): {err}") from err
    write_text(path, text, fsync=True)
    progress.report(len(text))


def read_json(directory: str | os.PathLike, name: str, manifest: dict[str, Any] | None = None) -> Any:
    """``directory/name``, which must be a regular file inside the checkpoint that its manifest
    (read here unless given) lists."""
    path = Path(directory) / name
    if not os.path.lexists(path):
        raise CheckpointError(f"checkpoint {str(directory)!r}: {name} is missing")
    checked_file(directory, name, read_manifest(directory) if manifest is None else manifest)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint {str(directory)!r}: {name} is missing") from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {str(directory)!r}: {name} is not valid JSON ({err})") from err


def read_trainer(directory: str | os.PathLike, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """``trainer.json`` with its keys checked (CheckpointError naming the file)."""
    value = read_json(directory, TRAINER, manifest)
    keys = ("num_updates", "scaler", "app")
    if not isinstance(value, dict) or any(k not in value for k in keys):
        raise CheckpointError(f"checkpoint {str(directory)!r}: {TRAINER} lacks one of {list(keys)}")
    return value
