"""World-2 workers for the asynchronous-save tests (one launch serves them all)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from deepshard.core.checkpoint.async_save import AsyncCheckpointer
from deepshard.core.checkpoint.manifest import read_manifest, step_dirs, verify_checkpoint
from deepshard.core.checkpoint.retention import temp_dirs
from deepshard.core.checkpoint.state import save_request, training_state
from deepshard.core.mesh import local_device
from tests.checkpoint.ckpt_harness import MICRO, load, make_engine, run_steps, save


class SlowWriter(AsyncCheckpointer):
    """The writer starts ``delay`` seconds late: training has moved on before a byte is written, so a
    save that did not snapshot the state would write a later step's."""

    delay = 0.4

    def _writer(self, request) -> None:
        time.sleep(self.delay)
        super()._writer(request)


def _request(engine, root: Path, step: int):
    return save_request(root, step, engine.optimizer, engine.mesh["dp"], model=engine.model,
                        app_state={"step": step}, meta={"model": dataclasses.asdict(MICRO)})


def _full(engine) -> dict[str, torch.Tensor]:
    # cloned: at world 1 full_tensor() may be the live tensor itself, which the next step updates in place
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in training_state(engine.optimizer, engine.mesh["dp"], engine.model).items()}


def _shard_crcs(path: Path) -> dict[str, str]:
    return {n: f["crc32"] for n, f in read_manifest(path)["files"].items() if n.endswith(".distcp")}


TIMEOUT_S = 123.0  # the training group's collective timeout (the app's launcher.timeout_s)


def reshard_worker(path: str, stage: int) -> dict:
    """Load the asynchronous checkpoint ``path`` at this world size and ``stage``: its state, update count
    and the loss of the next step."""
    from deepshard.core import init_distributed

    init_distributed()
    engine = make_engine(stage)
    app = load(engine, Path(path))
    return {"state": _full(engine), "app": app, "num_updates": engine.optimizer.num_updates,
            "next_loss": run_steps(engine, range(4, 5))[0]}


def async_worker(scratch: str, small: str) -> dict:
    from deepshard.core import init_distributed

    init_distributed(timeout_s=TIMEOUT_S)
    rank = dist.get_rank()
    scratch_p, small_p = Path(scratch), Path(small)
    out: dict = {}

    # (1) a save at every step, synchronous and asynchronous, from the same start
    sync = make_engine(3)
    for step in range(1, 5):
        run_steps(sync, range(step - 1, step))
        save(sync, scratch_p / "sync", step)
    eng = make_engine(3)
    writer = SlowWriter(device=local_device())
    out["writer_timeout_s"] = writer.group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    blocked, outcomes = [], []
    for step in range(1, 5):
        run_steps(eng, range(step - 1, step))
        outcomes.append(writer.poll())
        go, waited = writer.make_room("wait")
        outcomes.append(waited)
        blocked.append(writer.start(_request(eng, scratch_p / "async", step)))
    outcomes.append(writer.wait())
    done = [o for o in outcomes if o is not None]
    out["outcomes"] = [(o.step, o.error is None, o.path is not None) for o in done]
    out["blocked"], out["write_s"] = blocked, [o.write_s for o in done]
    out["staging_bytes"] = writer.staging.nbytes
    out["verified"] = [verify_checkpoint(c.path)["step"] for c in step_dirs(scratch_p / "async")]
    out["same_shards"] = [_shard_crcs(scratch_p / "sync" / f"step-{s:08d}") == _shard_crcs(c)
                          for s, c in ((c.step, c.path) for c in step_dirs(scratch_p / "async"))]
    # resume from the last asynchronous checkpoint and from the synchronous one: the same weights and next loss
    a, b = make_engine(3), make_engine(3)
    out["app"] = load(a, scratch_p / "async" / "step-00000004")
    load(b, scratch_p / "sync" / "step-00000004")
    fa, fb = _full(a), _full(b)
    out["same_state"] = sorted(fa) == sorted(fb) and all(torch.equal(fa[k], fb[k]) for k in fa)
    out["same_as_trained"] = all(torch.equal(fa[k], v) for k, v in _full(eng).items())
    trained = _full(eng)  # collective: on every rank
    if rank == 0:  # what step 4 left, for the reshard test (world 1, another stage) to compare with
        torch.save(trained, scratch_p / "trained-step4.pt")
    out["next_loss"] = (run_steps(a, range(4, 5))[0], run_steps(b, range(4, 5))[0], run_steps(eng, range(4, 5))[0])

    # (3) policy: saves requested faster than the (slow) writer writes
    SlowWriter.delay = 1.5
    for policy in ("skip", "wait"):
        start = time.perf_counter()
        writer.start(_request(eng, scratch_p / policy, 5))
        go, waited = writer.make_room(policy)
        out[policy] = {"go": go, "waited": waited is not None and waited.step,
                       "seconds": time.perf_counter() - start, "in_flight": writer.in_flight}
        if go:
            writer.start(_request(eng, scratch_p / policy, 6))
        writer.wait()
        out[policy]["steps"] = [c.step for c in step_dirs(scratch_p / policy)]
    SlowWriter.delay = 0.0

    # (2) the disk fills up during an asynchronous write: the error surfaces on every rank at the harvest
    from deepshard.core.checkpoint import state as checkpoint

    writer.start(_request(eng, small_p, 1))
    first = writer.wait()
    out["first_ok"] = first.error is None
    if rank == 0:  # fill the disk, leaving less than a checkpoint
        free = shutil.disk_usage(small_p).free
        with open(small_p / "filler", "wb") as f:
            f.write(b"\0" * max(free - 200_000, 0))
    dist.barrier()
    checkpoint.free_space_check = lambda *a: None  # the disk fills up after the check (another writer)
    writer.start(_request(eng, small_p, 2))
    while (failed := writer.poll()) is None:  # training goes on meanwhile
        run_steps(eng, range(5, 6))
    out["enospc"] = str(failed.error)
    out["after_enospc"] = {"steps": [c.step for c in step_dirs(small_p)], "temp": [p.name for p, _, _ in temp_dirs(small_p)],
                           "entries": sorted(p.name for p in small_p.iterdir())}
    verify_checkpoint(small_p / "step-00000001")
    dist.barrier()  # both ranks have looked before rank 0 removes the filler
    if rank == 0:
        os.remove(small_p / "filler")
    return out
