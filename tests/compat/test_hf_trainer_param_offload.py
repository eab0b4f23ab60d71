"""``save_model()`` under ZeRO-3 with the parameters offloaded (ds_config ``offload_param``, cpu and
nvme; issue 43) in the HF Trainer path: the safetensors it writes load with transformers'
``from_pretrained`` and give the engine's logits within 1e-5.  With nvme the shards rest on NVMe with the
last update deferred to their next use: the save applies it and reads them back first (it failed before,
gathering empty shards).  One rank of the session's gloo pool, 2 steps of the tiny Llama."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gloo_pool import pool


def save_under_param_offload(tmp: str, device: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from tests.compat.hf_trainer_harness import ds_config, our_trainer, probe_batch

    out = Path(tmp) / device
    ds = ds_config(3)
    (out / "swap").mkdir(parents=True)
    where = {"device": device, **({"nvme_path": str(out / "swap")} if device == "nvme" else {})}
    ds["zero_optimization"].update(offload_param=where, offload_optimizer=where)  # nvme params need both there
    trainer = our_trainer(out, stage=3, micro=4, accum=1, max_steps=2, deepspeed=ds)
    trainer.train()
    trainer.save_model(str(out / "final"))
    with torch.no_grad():
        ours = trainer.ds_engine(**probe_batch()).logits
        loaded = AutoModelForCausalLM.from_pretrained(str(out / "final"))(**probe_batch()).logits
    return {"gap": (loaded - ours).abs().max().item(), "finite": bool(torch.isfinite(ours).all())}


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_save_model_under_zero3_param_offload_loads_with_the_engines_logits(tmp_path, device):
    got = pool(1).run(save_under_param_offload, str(tmp_path), device)[0]
    assert got["finite"] and got["gap"] < 1e-5, got
