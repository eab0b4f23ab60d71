"""HF checkpoints in and out, whatever the family: parameter names, safetensors reading and
streamed writing, a folder's checks.  A family's own config.json mapping lives with it
(``models/<family>/hf.py``) and reaches the app through its spec's ``HFAdapter``.

Our module names are HF transformers' causal-LM names minus the ``model.`` prefix (``lm_head``
has none), so weights move across unchanged; anything without a place in our model is refused by name.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepshard.core.dtensor_utils import copy_global, local_slices, local_tensor

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja")
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them makes a tokenizer
# (HF name, its tensor, where it was read) -> the whole parameter, or None while pieces are still missing:
# how a family folds several HF tensors into one of ours (MoE's per-expert weights into stacked ones)
Assemble = Callable[[str, torch.Tensor, str], "torch.Tensor | None"]


def read_json(f: Path) -> Any:
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{f}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def to_hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def from_hf_name(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def bad_value(path: str | Path, key: str, value: Any, valid: str) -> ValueError:
    return ValueError(f"model.path={str(path)!r}: config.json has {key}={value!r}; {valid}")


def safetensors_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        files = [path / n for n in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ValueError(f"{index}: names {f.name}, which is not in model.path={str(path)!r}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = (f"; {pickled[0]} is a pickle, which is never loaded (it can run code): save the model with "
                f"save_pretrained(safe_serialization=True)") if pickled else ""
        raise ValueError(f"model.path={str(path)!r}: no *.safetensors weights there{hint}")
    return files


def check_tokenizer(path: Path) -> None:
    """ValueError unless ``path`` holds a tokenizer (one of :data:`TOKENIZER_MARKERS`)."""
    if not any((path / name).is_file() for name in TOKENIZER_MARKERS):
        raise ValueError(f"model.path={str(path)!r}: no tokenizer there (expected one of {list(TOKENIZER_MARKERS)}; "
                         f"save it with tokenizer.save_pretrained(DIR))")


def safetensors_headers(path: Path) -> Iterator[tuple[Path, dict[str, tuple[int, ...]]]]:
    """Each safetensors file of ``path`` with its tensors' shapes, read from the header only; one line
    naming a file that cannot be read."""
    from safetensors import SafetensorError, safe_open

    for f in safetensors_files(path):
        try:
            with safe_open(str(f), framework="pt") as st:
                found = {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
        yield f, found


def check_hf_dir(path: str | Path, model: nn.Module, *, rename: Callable[[str], str | None] = from_hf_name,
                 assemble: Assemble | None = None) -> None:
    """Before any worker starts: a tokenizer is there, and the safetensors headers hold exactly the
    weights of ``model`` (on the meta device) with its shapes (headers only: no tensor is read).
    ``rename`` gives our name of a HF tensor, or None for one the family leaves out."""
    path = Path(path)
    check_tokenizer(path)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    missing = set(shapes)
    for f, found in safetensors_headers(path):
        for hf_name, shape in found.items():
            name = rename(hf_name)
            if name is None:  # left out on purpose by the family (Gemma 3's vision tower)
                continue
            if name not in shapes:
                if "rotary_emb" in name:
                    continue
                raise ValueError(f"{f}: weight {hf_name!r} has no place in our model")
            if assemble is not None:
                whole = assemble(hf_name, torch.empty(shape, device="meta"), str(f))
                if whole is None:
                    continue
                shape = tuple(whole.shape)
            if shape != shapes[name]:
                raise ValueError(f"{f}: {hf_name} has shape {list(shape)}, config.json implies {list(shapes[name])}")
            missing.discard(name)
    if missing:
        raise ValueError(f"model.path={str(path)!r}: no weights for {sorted(missing)[:5]}")


def read_local(st: Any, hf_name: str, dst: torch.Tensor, *, row0: int = 0) -> torch.Tensor:
    """The elements of the checkpoint tensor ``hf_name`` (from ``row0`` on: a fused tensor's piece)
    that this rank's ``dst`` holds (``local_slices``: all of a plain tensor, a ZeRO-3 / TP shard's rows
    or columns), read from the open safetensors file ``st`` as a slice: a rank never reads whole
    tensors it keeps only a part of (the host peak of a load is its shards plus one slice)."""
    region = local_slices(dst)
    if region and row0:
        region = (slice(region[0].start + row0, region[0].stop + row0), *region[1:])
    return st.get_slice(hf_name)[region]


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | Path, *, rename: Callable[[str], str | None] = from_hf_name,
                    assemble: Assemble | None = None) -> None:
    """Copy a HF checkpoint's weights into ``model`` (plain, or ZeRO-3 / TP sharded), each rank reading
    only the rows (or columns) it keeps of each tensor (``read_local``).  ``rename``/``assemble``: as in
    :func:`check_hf_dir`; a family that ``assemble``s several tensors into one (MoE's experts) reads
    each of them whole, one at a time."""
    from safetensors import safe_open

    params = {n: p for n, p in model.named_parameters() if ".lora_" not in n}  # LoRA adapters: not in a base
    missing = set(params)
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for hf_name in st.keys():
                name = rename(hf_name)
                if name is None:
                    continue
                if name not in params:
                    if "rotary_emb" in name:
                        continue
                    raise ValueError(f"model.path={str(path)!r}: weight {hf_name!r} has no place in our model")
                if assemble is None:
                    shape = tuple(st.get_slice(hf_name).get_shape())
                else:
                    t = assemble(hf_name, st.get_tensor(hf_name), f"model.path={str(path)!r}")
                    if t is None:
                        continue
                    shape = tuple(t.shape)
                if shape != tuple(params[name].shape):
                    raise ValueError(f"model.path={str(path)!r}: {hf_name} has shape {list(shape)}, "
                                     f"our model expects {list(params[name].shape)}")
                if assemble is None:
                    local_tensor(params[name]).copy_(read_local(st, hf_name, params[name]))
                else:
                    copy_global(params[name], t)
                missing.discard(name)
    if missing:
        raise ValueError(f"model.path={str(path)!r}: no weights for {sorted(missing)[:5]}")


def write_safetensors(path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                      tensors: Iterable[torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """A safetensors file written tensor by tensor: the header first (shapes are known), then data.

    ``tensors`` must come in ``specs`` order; memory stays at one tensor.  Returns the bytes written.
    """
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, dtype, shape in specs:
        n = dtype.itemsize
        for s in shape:
            n *= s
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for (name, dtype, shape), t in zip(specs, tensors, strict=True):
            assert t.dtype == dtype and tuple(t.shape) == tuple(shape), name
            if t.numel():
                f.write(t.contiguous().view(torch.uint8).numpy().data)  # no copy of the tensor
    return 8 + len(raw) + offset


def plan_shards(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], max_bytes: int) -> Iterator[list[int]]:
    """Consecutive spec indices grouped into files of at most ``max_bytes`` (one big tensor alone)."""
    current: list[int] = []
    size = 0
    for i, (_, dtype, shape) in enumerate(specs):
        n = dtype.itemsize
        for s in shape:
            n *= s
        if current and size + n > max_bytes:
            yield current
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        yield current
