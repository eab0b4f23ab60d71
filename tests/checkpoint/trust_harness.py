"""Workers and crafted checkpoints for test_trust.py: models of another architecture, metadata
pointing outside the checkpoint, a shard that is a pickle payload."""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from deepshard.core import initialize
from deepshard.core.checkpoint.manifest import CheckpointError
from deepshard.core.checkpoint.state import load_checkpoint, save_checkpoint
from deepshard.core.mesh import local_device
from tests.checkpoint.ckpt_harness import run_steps
from tests.checkpoint.malicious import RunsCode, reseal
from tests.core.zero_harness import MICRO, build_model, engine_config

THREE = dataclasses.replace(MICRO, n_layers=3)
NARROW = dataclasses.replace(MICRO, ffn_hidden=64)


def _engine(cfg, stage: int = 3):
    return initialize(build_model(cfg).to(local_device()), engine_config(stage, 1, 0.5))


def _save(cfg, root: Path, stage: int = 3) -> Path:
    engine = _engine(cfg, stage)
    run_steps(engine, range(1))
    return save_checkpoint(root, 1, engine.optimizer, engine.mesh["dp"], model=engine.model,
                           app_state={"step": 1}, meta={"model": dataclasses.asdict(cfg)})


def _try_load(cfg, path: Path, stage: int = 3, **kwargs) -> str | None:
    """None when the load went through, else the CheckpointError's text."""
    engine = _engine(cfg, stage)
    try:
        load_checkpoint(path, engine.optimizer, engine.mesh["dp"], model=engine.model, **kwargs)
    except CheckpointError as err:
        return str(err)
    return None


def mismatch_worker(root: str) -> dict[str, str | None]:
    """A 3-layer checkpoint into a 2-layer run and the reverse, a narrower MLP, each rank's message;
    and an intended reshard (stage 3 -> stage 1) that must still load."""
    from deepshard.core import init_distributed

    init_distributed()
    root = Path(root)
    three = _save(THREE, root / "three")
    two = _save(MICRO, root / "two")
    crafted = root / "crafted" / two.name
    if dist.get_rank() == 0:
        shutil.copytree(two, crafted)
        craft_shard(crafted, root / "pwned")
    dist.barrier()
    return {
        "fewer_layers": _try_load(MICRO, three),
        "fewer_layers_meta": _try_load(MICRO, three, meta={"model": dataclasses.asdict(MICRO)}),
        "more_layers": _try_load(THREE, two),
        "narrower": _try_load(NARROW, two),
        "reshard": _try_load(MICRO, two, stage=1),
        "crafted_shard": _try_load(MICRO, crafted),
    }


def _metadata(ckpt: Path):
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)  # our own test checkpoint: trusted here


def redirect_first_shard(ckpt: Path, rel: str) -> None:
    """Make every item stored in the first shard file read from ``rel`` (relative to ``ckpt``: a
    ``../`` path outside it, or a new file inside), reseal, then put a copy of that shard there (so
    the manifest does not list it, as when it is added after sealing)."""
    md = _metadata(ckpt)
    first = sorted({info.relative_path for info in md.storage_data.values()})[0]
    data = (ckpt / first).read_bytes()
    for info in md.storage_data.values():
        if info.relative_path == first:
            info.relative_path = rel
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    reseal(ckpt)
    (ckpt / rel).write_bytes(data)


def craft_shard(ckpt: Path, marker: Path) -> str:
    """Store the first ``model.`` tensor's bytes in a new shard file holding a torch.save'd payload
    that runs a shell command when unpickled without weights_only; reseal.  Returns the file name."""
    import io

    md = _metadata(ckpt)
    buf = io.BytesIO()
    torch.save(RunsCode(marker), buf)
    payload = buf.getvalue()
    name = "__7_0.distcp"
    (ckpt / name).write_bytes(payload)
    for index, info in md.storage_data.items():
        if index.fqn.startswith("model."):
            info.relative_path, info.offset, info.length = name, 0, len(payload)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    reseal(ckpt)
    return name
