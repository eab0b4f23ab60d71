"""Reading DeepSpeed's checkpoint files without running what they carry.

They are pickles (``torch.save``).  Each is read with ``torch.load(weights_only=True, mmap=True)``:
torch's restricted unpickler rebuilds tensors and plain containers only, plus the classes named in
:data:`ALLOWED`, which are *our* inert stand-ins registered under DeepSpeed's names (DeepSpeed need
not be installed): an IntEnum and two attribute bags.  Anything else in a file is refused with the
file's name and the global it asked for (never with torch's own advice, which is to load it with
``weights_only=False``: exactly what must not be done with a file of unknown origin).  ``mmap=True`` maps tensor storage instead of reading it,
so a partition costs memory only for the pages actually copied out.
"""

from __future__ import annotations

import enum
import errno
import os
import pickle
import re
import stat
import types
import zipfile
from pathlib import Path
from typing import Any

import torch


class ZeroStageEnum(enum.IntEnum):
    """Stand-in for deepspeed.runtime.zero.config.ZeroStageEnum (same values)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class _AttrBag:
    """Stand-in for a pickled DeepSpeed object: its attributes, nothing callable."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({k: v for k, v in state.items() if isinstance(k, str)})

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class LossScaler(_AttrBag):
    """Stand-in for deepspeed.runtime.fp16.loss_scaler.LossScaler (static scale)."""


class DynamicLossScaler(_AttrBag):
    """Stand-in for deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler."""


class FragmentAddress(_AttrBag):
    """Stand-in for deepspeed.utils.tensor_fragment.fragment_address (numel, start)."""


ALLOWED = [
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
]


# What DeepSpeed 0.19's engine writes into mp_rank_00_model_states.pt itself; every other key is the
# script's client_state (DeepSpeed merges it into the same dict and hands it back on load).
DS_OWN_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "csr_tensor_module_names", "skipped_steps", "global_steps", "global_samples", "dp_world_size",
    "mp_world_size", "ds_config", "ds_version", "checkpoint_parallel_dimensions"})


_DS_NAMES = {cls: name.rsplit(".", 1) for cls, name in ALLOWED}


class _DsPickler(pickle._Pickler):  # the pure-Python pickler: its save_global can be overridden
    """Writes the stand-ins under DeepSpeed's own names, so DeepSpeed (which unpickles its files with
    weights_only=False) gets its real classes back; DeepSpeed need not be installed to write them."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj not in _DS_NAMES:
            return super().save_global(obj, name)
        module, qualname = _DS_NAMES[obj]
        assert self.proto < 4, "torch.save pickles with protocol 2"
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


_DS_PICKLE = types.ModuleType("deepshard_ds_pickle")
_DS_PICKLE.Pickler = _DsPickler  # type: ignore[attr-defined]


def DsLossScaler(scale: float) -> LossScaler:  # noqa: N802 - it stands for DeepSpeed's class
    """What DeepSpeed's ``LossScaler(scale)`` (a static scale) pickles as: ``cur_scale``, ``dynamic``."""
    out = LossScaler()
    out.__setstate__({"cur_scale": float(scale), "dynamic": False})
    return out


def save_for_deepspeed(obj: dict[str, Any], path: str | os.PathLike) -> None:
    """``torch.save`` for a file DeepSpeed will load, the stand-ins in it named as DeepSpeed's classes."""
    torch.save(obj, path, pickle_module=_DS_PICKLE)


# what torch's weights-only unpickler says around its reason: the advice to retry unsafely, pointers
_ADVICE = ("Weights only load failed", "Check the documentation", "Please file an issue", "You can use")


def refusal_reason(message: str) -> str:
    """The essential reason in torch's weights-only refusal (``unsupported global: GLOBAL os.system``),
    without its advice to retry with ``weights_only=False``."""
    found = re.search(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)", message)
    if found:
        return f"unsupported global: GLOBAL {found.group(1)}, not on the allowlist"
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", message)]
    kept = [p.removeprefix("WeightsUnpickler error:").strip() for p in paragraphs
            if p and not p.startswith(_ADVICE) and "weights_only" not in p]
    return "; ".join(p for p in kept if p)[:300] or "refused by torch's weights-only unpickler"


def load_ds_file(path: str | os.PathLike) -> dict[str, Any]:
    """One DeepSpeed ``.pt`` file, restricted to tensors, containers and :data:`ALLOWED` (ValueError else)."""
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file")
    if not zipfile.is_zipfile(path):  # torch.save has written zip archives since torch 1.6; DeepSpeed too
        raise ValueError(f"{path}: not loaded (not a torch.save zip archive: truncated, or not a checkpoint file)")
    try:
        with torch.serialization.safe_globals(ALLOWED):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"{path}: not loaded ({refusal_reason(str(err))}); DeepSpeed checkpoints are read by "
                         f"torch's weights-only unpickler with an allowlist of {[name for _, name in ALLOWED]}, "
                         f"so nothing in them runs") from None
    except Exception as err:  # noqa: BLE001 - torch raises RuntimeError, OSError, EOFError, ...
        raise ValueError(f"{path}: not loaded ({type(err).__name__}: {refusal_reason(str(err))})") from None


_TAG_RULE = "a tag names a directory inside the checkpoint directory: no path separators, not '.' or '..'"
_LATEST_MAX = 4096  # bytes: a tag is a short name


def _is_tag(tag: str) -> bool:
    return bool(tag) and tag not in (".", "..") and not any(c in tag for c in ("/", "\\", "\0")) and not (
        os.altsep and os.altsep in tag)


def check_tag(tag: str, source: str) -> str:
    """A checkpoint tag names a directory inside the checkpoint directory: never a path (no separator,
    not ``.`` or ``..``), so a crafted ``latest`` file cannot send a reader outside it.  For a tag the
    user gave (a file's tag comes through :func:`read_latest`, which never echoes it)."""
    if not _is_tag(tag):
        raise ValueError(f"{source}: tag {tag!r} is not a checkpoint name ({_TAG_RULE})")
    return tag


def read_latest(latest: Path) -> str:
    """The tag that DeepSpeed's ``latest`` file names.  Its errors name the file and what is wrong with
    it, never what it holds: ``latest`` linked to a key file would print the key.  So a symlink (or
    anything but a regular file) is refused unread, as the HF Trainer path does."""
    try:
        fd = os.open(latest, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.ENXIO):
            raise
        raise ValueError(f"{latest}: is not a regular file ({'a symlink' if latest.is_symlink() else 'a socket'}); "
                         "a checkpoint's 'latest' must be a plain file naming its tag") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{latest}: is not a regular file; a checkpoint's 'latest' must be a plain file "
                             "naming its tag")
        raw = f.read(_LATEST_MAX + 1)
    if len(raw) > _LATEST_MAX:
        raise ValueError(f"{latest}: is over {_LATEST_MAX} bytes, too long to name a checkpoint tag")
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{latest}: is not UTF-8 text; it should name a checkpoint tag") from None
    if not _is_tag(tag):
        raise ValueError(f"{latest}: names no checkpoint tag ({_TAG_RULE})")
    return tag


def no_tag_dir(latest: Path) -> ValueError:
    """The tag ``latest`` names has no directory (named by the directories there, not by the tag)."""
    root = latest.parent
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    return ValueError(f"{latest}: the tag it names has no directory in {root} (directories there: {found}); "
                      "give the tag")


def resolve_tag_dir(ckpt_dir: str | os.PathLike, tag: str | None) -> Path:
    """``ckpt_dir/tag`` (the tag from ``ckpt_dir/latest`` when not given), or ckpt_dir itself when it
    already holds the files."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise ValueError(f"{root}: no such directory")
    if tag is None:
        if list(root.glob("*model_states.pt")):
            return root
        latest = root / "latest"
        if not os.path.lexists(latest):
            raise ValueError(f"{root}: no 'latest' file and no *model_states.pt: give --tag (one of "
                             f"{sorted(p.name for p in root.iterdir() if p.is_dir())})")
        tag_dir = root / read_latest(latest)
        if not tag_dir.is_dir():
            raise no_tag_dir(latest)
        return tag_dir
    tag_dir = root / check_tag(tag, str(root))
    if not tag_dir.is_dir():
        raise ValueError(f"{root}: tag {tag!r} has no directory {tag_dir}")
    return tag_dir


def rank_files(tag_dir: Path, kind: str) -> list[Path]:
    """``*zero_pp_rank_R_mp_rank_00_{kind}.pt`` ordered by data-parallel rank R."""
    found = {}
    for f in tag_dir.glob(f"*zero_pp_rank_*_mp_rank_*_{kind}.pt"):
        m = re.search(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_", f.name)
        assert m is not None
        if m.group(2) != "00":
            raise ValueError(f"{f}: model-parallel rank {m.group(2)}: checkpoints with tensor/pipeline model "
                             f"parallelism (mp_rank > 0) are not supported")
        found[int(m.group(1))] = f
    if sorted(found) != list(range(len(found))):
        raise ValueError(f"{tag_dir}: {kind} files for data-parallel ranks {sorted(found)}: some are missing")
    return [found[r] for r in range(len(found))]
