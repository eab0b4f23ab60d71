"""Checkpoints: sharded (DCP), atomic, verified, loaded without running anything they contain.

- ``state``: what a checkpoint holds (DCP state of the ZeRO optimizer's tensors at any stage and
  world size) and the collective save / load / resume search;
- ``async_save``: the same save with the step blocked only while its state is copied into reused
  host buffers; a writer thread (own gloo group) writes, verifies and seals it;
- ``manifest``: every file's size and crc32, the atomic publish, verification;
- ``retention``: what a run may remove or set aside in ``checkpoint.dir`` (only what its saves made);
- ``owners``: the marker that tells a live save's temp dir from a dead run's;
- ``failures``: a failed save as one line on every rank (disk full, I/O error), its cleanup;
- ``safe_load``: DCP's metadata and shards read without unpickling code;
- ``json_state``: the scalars beside the shards (RNG, trainer counters) as JSON;
- ``consolidate``: one full tensor at a time from the shards (export, conversion);
- ``offline``: an ordinary checkpoint written by one process, each tensor built as it is written
  (converters bringing in another tool's checkpoint).
"""

from deepshard.core.lazy_exports import lazy_exports

# imported on first use: the launcher's heartbeat needs ``owners`` alone, not torch
__getattr__, __dir__ = lazy_exports(__name__, {
    "deepshard.core.checkpoint.consolidate": ("TensorInfo", "iter_full_tensors", "load_full_tensor", "tensor_infos"),
    "deepshard.core.checkpoint.failures": ("CheckpointSaveError",),
    "deepshard.core.checkpoint.json_state": ("read_trainer",),
    "deepshard.core.checkpoint.manifest": ("CheckpointError", "latest_good", "read_manifest", "step_dir_name",
                                           "step_dirs", "verify_checkpoint"),
    "deepshard.core.checkpoint.offline": ("write_offline_checkpoint",),
    "deepshard.core.checkpoint.plain_files": ("write_text",),
    "deepshard.core.checkpoint.retention": ("prune",),
    "deepshard.core.checkpoint.state": ("clean_name", "find_resume", "load_checkpoint", "save_checkpoint"),
})

__all__ = ["CheckpointError", "CheckpointSaveError", "TensorInfo", "clean_name", "find_resume", "iter_full_tensors",
           "latest_good", "load_checkpoint", "load_full_tensor", "prune", "read_manifest", "read_trainer",
           "save_checkpoint", "step_dir_name", "step_dirs", "tensor_infos", "verify_checkpoint", "write_offline_checkpoint",
           "write_text"]
