"""``python -m deepshard.finetune.tools.from_deepspeed DS_CHECKPOINT_DIR [--tag TAG] OUT_DIR``

A DeepSpeed ZeRO-1/2/3 checkpoint (``latest``, ``mp_rank_*_model_states.pt``,
``*zero_pp_rank_*_optim_states.pt``; any data-parallel world size) as one of our checkpoints,
``OUT_DIR/step-NNNNNNNN``: fp32 master weights, both Adam moments, the update count (Adam's step,
which is also where our LR schedule stands), the loss scaler and DeepSpeed's counters.  It resumes at
any world size and ZeRO stage: ``engine.load_checkpoint(OUT_DIR)`` (deepshard.compat.deepspeed) or
core's ``load_checkpoint``.

Files are read with ``torch.load(weights_only=True, mmap=True)`` and an allowlist of inert stand-ins
for the few DeepSpeed classes they hold (compat.deepspeed.ds_files): nothing in them runs.  Each
output tensor is assembled when DCP writes it, from the mapped pieces of the rank files holding it,
so the peak memory is about one parameter, never the model (DeepSpeed's zero_to_fp32 holds it all).

Whatever is wrong with the files (refused, truncated, a key missing, a partition of the wrong size)
is one ``error:`` line naming the file, exit 2; the partial ``step-N.tmp-import`` is removed.  The
import is written into ``step-N.tmp-import`` (marked with its importer's host and pid) and renamed into
place whole; a leftover of a killed import is removed, one whose importer still runs is named (exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from deepshard.compat.deepspeed.ds_files import DS_OWN_KEYS, load_ds_file, rank_files, resolve_tag_dir
from deepshard.core.checkpoint.consolidate import tensor_infos
from deepshard.core.checkpoint.json_state import TRAINER, read_trainer, write_json
from deepshard.core.checkpoint.manifest import (
    FORMAT,
    CheckpointError,
    describe_files,
    list_files,
    step_dir_name,
    write_manifest,
)
from deepshard.core.checkpoint.owners import OWNER
from deepshard.core.checkpoint.state import clean_name
from deepshard.finetune.models.hf import to_hf_name
from deepshard.finetune.tools.partial_import import claim

KINDS = {"model.": "master", "optim.exp_avg.": "exp_avg", "optim.exp_avg_sq.": "exp_avg_sq"}


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    group: int
    offset: int  # stages 1-2: start in its group's flat vector; stage 3: start in each rank's flat partition

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@contextlib.contextmanager
def _reading(file: Path) -> Iterator[None]:
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
        with _reading(model_file):
            if self.model_states.get("frozen_param_shapes"):
                raise ValueError(f"{model_file}: frozen parameters {list(self.model_states['frozen_param_shapes'])}: "
                                 f"not supported by the importer yet")
        self.world = len(self.optim_files)
        with _reading(self.optim_files[0]):
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
        with _reading(model_file):
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
                with _reading(self.optim_files[rank]):
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
                    with _reading(self.optim_files[rank]):
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


class _StreamingPlanner(DefaultSavePlanner):
    """DCP planner over meta placeholders: each tensor is built only when the writer asks for it."""

    def __init__(self, build) -> None:
        super().__init__()
        self._build = build

    def resolve_data(self, write_item: Any) -> torch.Tensor:
        return self._build(write_item.index.fqn)


def loss_scaler_state(osd_meta: dict, global_steps: int) -> dict[str, float]:
    """DeepSpeed's (static or dynamic) loss scaler as our LossScaler's state."""
    ls = osd_meta.get("loss_scaler")
    attrs = ls.as_dict() if hasattr(ls, "as_dict") else dict(ls or {})
    return {"scale": float(attrs.get("cur_scale", 1.0)), "cur_hysteresis": int(attrs.get("cur_hysteresis", 2)),
            "iteration": int(attrs.get("cur_iter", global_steps)),
            "last_overflow": int(attrs.get("last_overflow_iter", -1)), "num_overflows": 0}


def import_checkpoint(ds_dir: str | Path, out_dir: str | Path, *, tag: str | None = None) -> Path:
    """Write ``out_dir/step-N`` from the DeepSpeed checkpoint; returns its path."""
    tag_dir = resolve_tag_dir(ds_dir, tag)
    ds = DsCheckpoint(tag_dir)
    ms = ds.model_states
    params = {p.name: p for p in ds.params}
    state: dict[str, torch.Tensor] = {}
    for prefix in KINDS:
        for p in ds.params:
            state[prefix + p.name] = torch.empty(p.shape, dtype=torch.float32, device="meta")
    with _reading(ds.model_file):
        buffers = {n: t for n, t in ms["module"].items() if n in set(ms.get("buffer_names") or [])}
        for name, t in buffers.items():
            state["model." + name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
        # tied weights (lm_head.weight -> model.embed_tokens.weight): DeepSpeed trains one, our checkpoints
        # also hold the alias (the model's state_dict has it), in the module's dtype
        aliases = {a: src for a, src in dict(ms.get("shared_params") or {}).items() if src in params}
        for alias, src in aliases.items():
            dtype = ms["module"][alias].dtype if alias in ms["module"] else torch.float32
            state["model." + alias] = torch.empty(params[src].shape, dtype=dtype, device="meta")
        global_steps = int(ms.get("global_steps", ds.adam_step))

    def build(fqn: str) -> torch.Tensor:
        if fqn.startswith("model.") and fqn[len("model."):] in aliases:
            alias = fqn[len("model."):]
            return ds.full(params[aliases[alias]], "master").to(state[fqn].dtype)
        for prefix, kind in KINDS.items():
            if fqn.startswith(prefix) and fqn[len(prefix):] in params:
                return ds.full(params[fqn[len(prefix):]], kind)
        return buffers[fqn[len("model."):]].clone()

    step = ds.adam_step
    final = Path(out_dir) / step_dir_name(step)
    tmp = Path(out_dir) / f"{final.name}.tmp-import"
    if os.path.lexists(final):  # before any work: an import that cannot be renamed into place is wasted
        raise ValueError(f"{final}: already exists; choose an empty OUT_DIR")
    claim(tmp)
    try:
        _write(tmp, ds, tag_dir, state, build, step, global_steps)
        (tmp / OWNER).unlink()
    except BaseException:  # a refused or short file, a full disk, Ctrl-C: no half-written import stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.rename(final)  # atomic: OUT_DIR holds the whole import or none of it
    return final


def _write(tmp: Path, ds: DsCheckpoint, tag_dir: Path, state: dict, build, step: int, global_steps: int) -> None:
    """The tensors (DCP, built one by one), trainer.json and the manifest, into ``tmp``."""
    ms = ds.model_states
    warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
    try:
        dcp.save(state, storage_writer=FileSystemWriter(str(tmp), thread_count=1), planner=_StreamingPlanner(build),
                 no_dist=True)
    except CheckpointException as err:  # DCP wraps what failed (a file refused or short, a full disk): that
        first = next(iter(err.failures.values()))[0]  # is what the user needs to read
        if isinstance(first, (ValueError, OSError)):
            raise first from None
        raise
    with _reading(ds.model_file):
        sched = dict(ms.get("lr_scheduler") or {})
        counters = {"global_steps": global_steps, "global_samples": int(ms.get("global_samples", 0)),
                    "skipped_steps": int(ms.get("skipped_steps", 0)), "micro_steps": 0}
    with _reading(ds.optim_files[0]):
        scaler = loss_scaler_state(ds.osd_meta, global_steps)
    if sched and int(sched.get("last_batch_iteration", step - 1)) + 1 != step:
        print(f"warning: {tag_dir}: the LR scheduler is at iteration {sched['last_batch_iteration']} but Adam at "
              f"step {step} (skipped fp16 steps); one counter drives both here: Adam's", file=sys.stderr)
    app = {"counters": counters, "client_state": client_state(ms, ds.model_file),
           "deepspeed": {"tag": tag_dir.name, "version": str(ms.get("ds_version", "?")), "zero_stage": ds.stage,
                         "dp_world_size": ds.world, "bf16": ds.optim_files[0].name.startswith("bf16_"),
                         "parameter_alignment": any(any(g) for g in ds.osd_meta.get("param_alignment_paddings") or []),
                         "lr_scheduler": {k: v for k, v in sched.items()
                                                                     if isinstance(v, (int, float, str))},
                         "param_groups": _jsonable(ds.param_groups)}}
    # DeepSpeed saves no RNG state: world_size 0 matches no resuming world, so every rank keeps its own RNG
    trainer = {"num_updates": step, "scaler": scaler, "app": app,
               "world_size": 0, "zero_stage": ds.stage}
    write_json(tmp, TRAINER, trainer)
    write_manifest(tmp, {
        "format": FORMAT, "step": step, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "world": {"world_size": 0, "dp_size": ds.world, "zero_stage": ds.stage},
        "num_params": len(ds.params), "meta": {"source": f"deepspeed {app['deepspeed']['version']} {tag_dir}"},
        "checksum": "crc32", "files": describe_files(tmp, list_files(tmp)),
    })


def client_state(ms: dict, model_file: Path) -> dict[str, Any]:
    """The script's ``client_state`` (the keys DeepSpeed did not write), as JSON: a 0-d tensor becomes its
    number; a value JSON cannot hold (a tensor, an object) is dropped with a warning naming its key."""
    out = {}
    for key, value in ms.items():
        if key in DS_OWN_KEYS or not isinstance(key, str):
            continue
        value = value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 else value
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            print(f"warning: {model_file}: client_state[{key!r}] ({type(value).__name__}) is not JSON: not "
                  f"imported (our checkpoints hold client_state as JSON)", file=sys.stderr)
            continue
        out[key] = value
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


class ImportedRun:
    """A checkpoint this importer wrote, as the app resumes it (``checkpoint.resume=OUT_DIR``): DeepSpeed's
    module names mapped to ours, and the app state DeepSpeed has none of (our data position, tokens seen)."""

    def __init__(self, path: Path, trainer: dict[str, Any]) -> None:
        self.path = path
        self.step = int(trainer["num_updates"])
        self.record = trainer["app"]["deepspeed"]
        self.scale = float(trainer["scaler"]["scale"])
        self.hf_names = False

    @staticmethod
    def of(path: str | Path) -> ImportedRun | None:
        """The import record of ``path``, or None for a checkpoint this importer did not write (or one
        whose trainer.json cannot be read: load_checkpoint's verification then names what is wrong)."""
        try:
            trainer = read_trainer(path)
        except (CheckpointError, OSError, ValueError):
            return None
        app = trainer["app"]
        imported = isinstance(app, dict) and "deepspeed" in app and "data" not in app
        return ImportedRun(Path(path), trainer) if imported else None

    def match_names(self, names: list[str]) -> None:
        """Our parameter names against the checkpoint's, as saved or as HF names (``model.`` + ours,
        ``lm_head.`` as is); CheckpointError naming the first one found neither way."""
        saved = {i.key for i in tensor_infos(self.path, "model.")}
        ours = [f"model.{clean_name(n)}" for n in names]
        if all(k in saved for k in ours):
            return
        self.hf_names = True
        missing = [k for k in ours if self.rename(k) not in saved]
        if missing:
            raise CheckpointError(f"checkpoint.resume={str(self.path)!r}: imported from DeepSpeed, but it has no tensor "
                             f"{self.rename(missing[0])!r} (this run's {missing[0]!r}; {len(missing)} missing in all): "
                             f"a different model than this run's model= settings")

    def rename(self, key: str) -> str:
        """Our checkpoint key -> the imported one (``model.layers.0...`` -> ``model.model.layers.0...``)."""
        if not self.hf_names:
            return key
        for prefix in KINDS:
            if key.startswith(prefix):
                return prefix + to_hf_name(key[len(prefix):])
        return key

    def app_state(self, data: Any, *, micro_batches_per_step: int, tokens_per_step: int) -> dict[str, Any]:
        """This run's data stream placed after ``step`` steps of its own data, as if it had trained them."""
        state = data.state_dict()
        done = self.step * micro_batches_per_step
        per_epoch = state["num_samples"] // data.global_batch
        state.update(epoch=done // per_epoch, consumed=(done % per_epoch) * data.global_batch)
        return {"step": self.step, "tokens_seen": self.step * tokens_per_step, "data": state}

    def describe(self) -> str:
        r = self.record
        names = "HF names mapped to ours" if self.hf_names else "names as ours"
        return (f"checkpoint: imported from DeepSpeed {r['version']} (ZeRO-{r['zero_stage']}, dp {r['dp_world_size']}, "
                f"tag {r['tag']}): fp32 weights and Adam moments ({names}), Adam and the LR schedule at update "
                f"{self.step}, loss scale {self.scale:g}; this run's data starts at step {self.step} (DeepSpeed "
                f"saves no data position or RNG); this run's optim/scheduler settings apply")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepshard.finetune.tools.from_deepspeed", description=__doc__.split("\n\n")[1])
    ap.add_argument("ds_checkpoint_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--tag", default=None, help="the checkpoint tag (default: the one in DS_CHECKPOINT_DIR/latest)")
    args = ap.parse_args(argv)
    try:
        path = import_checkpoint(args.ds_checkpoint_dir, args.out_dir, tag=args.tag)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # OUT_DIR read-only or full
        print(f"error: {err.filename or args.out_dir}: cannot write the import ({err.strerror or err})", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
