"""save_model() at ZeRO-3 on a model big enough that a full state dict shows in the memory census
(issue 26): a tied Llama of 34M parameters (135 MB in fp32; its largest tensor, an MLP matrix, is
16 MiB) trained one step at world 2 with deepshard's Trainer, then saved.

The census: the peak resident memory (Linux's VmHWM, reset through /proc/self/clear_refs just
before) above what the rank held before the call, with glibc told to map every block over 64 KiB
on its own (so resident memory counts the live tensors).  Measured for ``trainer.save_model()`` and, in the
same process, for the full-gather path it replaced (DCP's ``get_model_state_dict(full_state_dict=True)``,
what transformers' FSDP and DeepSpeed ZeRO-3 paths amount to), so the test sees that the census
would catch a full gather."""

from __future__ import annotations

import ctypes
import gc
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from tests.compat.hf_trainer_harness import collate, rows

HIDDEN, FFN, LAYERS = 1024, 4096, 2


def big_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
                      tie_word_embeddings=True, attn_implementation="eager", pad_token_id=0)
    return LlamaForCausalLM(cfg)


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def exact_resident_memory() -> None:
    """Make resident memory count live tensors: glibc otherwise serves a new tensor from heap memory an
    earlier one freed (no growth seen) and raises its mmap threshold as big blocks are freed.  A fixed
    64 KiB threshold maps every larger block on allocation and unmaps it on free."""
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(-3, 64 << 10) == 1  # M_MMAP_THRESHOLD
    assert libc.mallopt(-1, 64 << 10) == 1  # M_TRIM_THRESHOLD: free heap tops go back too


def peak_growth(fn: Any) -> tuple[Any, int]:
    """``fn()``'s result and the most resident bytes it added at any moment (VmHWM after - VmRSS before)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    before = _status_kb("VmRSS")
    result = fn()
    return result, (_status_kb("VmHWM") - before) * 1024


def census(tmp: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    from deepshard.compat.transformers import Trainer, TrainingArguments
    from deepshard.compat.transformers.save import plan, write_streaming
    from tests.compat.hf_trainer_harness import ds_config

    exact_resident_memory()
    out = Path(tmp)
    args = TrainingArguments(output_dir=str(out / "run"), per_device_train_batch_size=1, max_steps=1,
                             learning_rate=1e-3, save_strategy="no", report_to=[], seed=0,
                             train_sampling_strategy="sequential", remove_unused_columns=False, disable_tqdm=True,
                             deepspeed=ds_config(3))
    trainer = Trainer(model=big_llama(), args=args, train_dataset=rows(8), data_collator=collate)
    trainer.train()
    model = trainer.model
    rank = dist.get_rank()
    _, streamed = peak_growth(lambda: trainer.save_model(str(out / "final")))
    # the same weights cut into shards of at most 40 MB: several files and the index json
    files = write_streaming(model, out / "sharded", is_main=rank == 0, max_shard_size=40_000_000)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_sd, gathered = peak_growth(lambda: get_model_state_dict(model, options=opts))
    sizes = {k: v.numel() * v.element_size() for k, v in plan(model)[1].items()}  # global shapes
    result: dict[str, Any] = {"streamed": streamed, "full_gather": gathered, "largest": max(sizes.values()),
                              "total": sum(sizes.values()), "files": files}
    with torch.no_grad():
        ours = trainer.ds_engine(**collate(rows(12)[8:])).logits
    if rank == 0:
        from safetensors.torch import load_file

        written = load_file(str(out / "final" / "model.safetensors"))
        result["keys"] = sorted(written)
        result["bit_equal"] = all(torch.equal(written[k], full_sd[k]) for k in written)
        result["index"] = (out / "sharded" / "model.safetensors.index.json").is_file()
        shutil.copy(out / "final" / "config.json", out / "sharded" / "config.json")
        for name in ("final", "sharded"):
            loaded = AutoModelForCausalLM.from_pretrained(str(out / name))
            with torch.no_grad():
                result[f"gap_{name}"] = (loaded(**collate(rows(12)[8:])).logits - ours).abs().max().item()
    del full_sd
    return result
