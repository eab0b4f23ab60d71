"""The HF Llama family <-> our Llama: config mapping, parameter names, safetensors in and out.

Our module names are HF's minus the ``model.`` prefix (``lm_head`` has none), and our RoPE is
HF's rotate-half convention, so weights move across unchanged.  Only what our model can
represent is accepted; anything else (biases, RoPE scaling, another head_dim) is refused by name.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from deepshard.finetune.models.llama import Llama, LlamaConfig, copy_global

HF_ARCH = "LlamaForCausalLM"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja")
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them makes a tokenizer


def _read_json(f: Path) -> Any:
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


def _bad(path: str | Path, key: str, value: Any, valid: str) -> ValueError:
    return ValueError(f"model.path={str(path)!r}: config.json has {key}={value!r}; {valid}")


def llama_config_from_hf(path: str | Path) -> LlamaConfig:
    """Our LlamaConfig from a HF ``config.json`` (read as JSON: no transformers import needed)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"model.path={str(path)!r}: no config.json there (expected a HF checkpoint directory)")
    c = _read_json(f)
    if not isinstance(c, dict):
        raise ValueError(f"{f}: expected a JSON object, got {type(c).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in c]
    if missing:
        raise ValueError(f"{f}: missing key {missing[0]!r} (a Llama config.json needs {list(REQUIRED_KEYS)})")
    if c.get("model_type") not in ("llama", "mistral", "qwen2", None):
        raise _bad(path, "model_type", c.get("model_type"), "only the Llama family is supported")
    if c.get("hidden_act", "silu") != "silu":
        raise _bad(path, "hidden_act", c["hidden_act"], "only silu (SwiGLU) is supported")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise _bad(path, key, c[key], "our Llama has no biases")
    rope = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise _bad(path, "rope_type", rope_type, "only default RoPE is supported")
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    if head_dim * heads != c["hidden_size"]:
        raise _bad(path, "head_dim", head_dim, "must be hidden_size / num_attention_heads")
    return LlamaConfig(
        vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=heads,
        n_kv_heads=c.get("num_key_value_heads") or heads, ffn_hidden=c["intermediate_size"],
        max_seq_len=c.get("max_position_embeddings", 2048), rope_theta=float(rope.get("rope_theta",
                                                                                   c.get("rope_theta", 10000.0))),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def hf_config_dict(cfg: LlamaConfig, *, dtype: str = "float32", bos_token_id: int | None = None,
                   eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """A ``config.json`` for LlamaForCausalLM describing ``cfg`` (built by transformers itself)."""
    from transformers import LlamaConfig as HFLlamaConfig

    hf = HFLlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, head_dim=cfg.head_dim, architectures=[HF_ARCH], dtype=dtype,
    )
    return hf.to_dict()


def safetensors_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
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


def check_hf_dir(path: str | Path, cfg: LlamaConfig) -> None:
    """Before any worker starts: a tokenizer is there, and the safetensors headers hold exactly our
    model's weights with our shapes (headers only: no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not any((path / name).is_file() for name in TOKENIZER_MARKERS):
        raise ValueError(f"model.path={str(path)!r}: no tokenizer there (expected one of {list(TOKENIZER_MARKERS)}; "
                         f"save it with tokenizer.save_pretrained(DIR))")
    with torch.device("meta"):
        shapes = {n: list(p.shape) for n, p in Llama(cfg).named_parameters()}
    missing = set(shapes)
    for f in safetensors_files(path):
        try:
            with safe_open(str(f), framework="pt") as st:
                found = {k: list(st.get_slice(k).get_shape()) for k in st.keys()}
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
        for hf_name, shape in found.items():
            name = from_hf_name(hf_name)
            if name not in shapes:
                if "rotary_emb" in name:
                    continue
                raise ValueError(f"{f}: weight {hf_name!r} has no place in our Llama")
            if shape != shapes[name]:
                raise ValueError(f"{f}: {hf_name} has shape {shape}, config.json implies {shapes[name]}")
            missing.discard(name)
    if missing:
        raise ValueError(f"model.path={str(path)!r}: no weights for {sorted(missing)[:5]}")


@torch.no_grad()
def load_hf_weights(model: Llama, path: str | Path) -> None:
    """Copy a HF checkpoint's weights into ``model`` (plain, or ZeRO-3 sharded), one tensor at a time."""
    from safetensors import safe_open

    params = {n: p for n, p in model.named_parameters() if ".lora_" not in n}  # LoRA adapters: not in a base
    missing = set(params)
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for hf_name in st.keys():
                name = from_hf_name(hf_name)
                if name not in params:
                    if "rotary_emb" in name:
                        continue
                    raise ValueError(f"model.path={str(path)!r}: weight {hf_name!r} has no place in our Llama")
                t = st.get_tensor(hf_name)
                if t.shape != params[name].shape:
                    raise ValueError(f"model.path={str(path)!r}: {hf_name} has shape {list(t.shape)}, "
                                     f"our model expects {list(params[name].shape)}")
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
