"""Resuming a checkpoint this app did not write (compat's engine saved it, or a converter brought it in
from DeepSpeed): it is an ordinary checkpoint of ours, but it may carry the model family's HF parameter
names and it records none of the app's state (no data position, no tokens seen).  The family's own
name mapping (its registry entry's HF adapter) and this run's data stream fill those in; nothing here
knows which tool wrote it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepshard.core.checkpoint import CheckpointError, clean_name, read_manifest, tensor_infos
from deepshard.finetune.data.resumable import ResumableStream
from deepshard.finetune.models import registry

log = logging.getLogger("deepshard.finetune")


def hf_rename(path: str | Path, names: list[str], meta: dict[str, Any]) -> Callable[[str], str] | None:
    """For a checkpoint this app did not write whose tensors carry the model family's HF names (one
    saved around transformers' model, e.g. by compat's engine or a DeepSpeed import): our checkpoint key
    -> the saved one.  None when the names are ours, or match neither way (then load_checkpoint names
    the first missing tensor)."""
    try:
        if "family" in read_manifest(path).get("meta", {}):  # written by this app: our names
            return None
        saved = {i.key for i in tensor_infos(path, "model.")}
    except (CheckpointError, OSError, ValueError):  # load_checkpoint's verification names what is wrong
        return None
    ours = [f"model.{clean_name(n)}" for n in names]
    if all(k in saved for k in ours):
        return None
    to_hf = registry.get(meta.get("family", registry.DEFAULT_FAMILY)).hf.to_hf_name

    def rename(key: str) -> str:
        for prefix in ("model.", "optim.exp_avg.", "optim.exp_avg_sq."):
            if key.startswith(prefix):
                return prefix + to_hf(key[len(prefix):])
        return key

    return rename if all(rename(k) in saved for k in ours) else None


def placed_after(path: str | Path, data: ResumableStream, step: int, *, micro_batches_per_step: int,
                 tokens_per_step: int, names_mapped: bool) -> dict[str, Any]:
    """The app state of a checkpoint that records none of ours: this run's data stream placed after
    ``step`` steps of its own data, as if it had trained them; logs what was resumed (the checkpoint's
    manifest ``meta.note``, which a converter writes)."""
    state = data.state_dict()
    done = step * micro_batches_per_step
    per_epoch = state["num_samples"] // data.global_batch
    state.update(epoch=done // per_epoch, consumed=(done % per_epoch) * data.global_batch)
    note = read_manifest(path).get("meta", {}).get("note") or f"{path} records no data position of this app"
    names = "; HF parameter names mapped to ours (the model family's)" if names_mapped else ""
    log.info("checkpoint: %s%s; this run's data starts at step %d, and its optim/scheduler settings apply",
             note, names, step)
    return {"step": step, "tokens_seen": step * tokens_per_step, "data": state}
