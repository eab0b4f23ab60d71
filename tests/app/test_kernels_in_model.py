"""The app's model on deepshard.kernels: the Triton path (interpreted on CPU) trains like the torch
path, and the chunked linear + cross-entropy really saves the logits' memory on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "apps/finetune/main.py")

TRAIN_TWICE = textwrap.dedent("""
    import json, sys
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from deepshard.finetune.config import register, validate
    from deepshard.finetune.recipe.assemble import train_worker
    register()
    out = {}
    for kernels in ("torch", "triton"):
        with initialize_config_dir(config_dir=sys.argv[1], version_base=None):
            cfg = compose(config_name="config", overrides=[
                f"kernels={kernels}", "train.max_steps=3", "train.micro_batch_size=1", "data.seq_len=16",
                "data.num_docs=200", "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
                "model.ffn_hidden=128", "scheduler=constant", "launcher.nproc_per_node=1"])
        out[kernels] = train_worker(validate(OmegaConf.to_container(cfg, resolve=True)), sys.argv[2] + "/" + kernels)["losses"]
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.slow
def test_triton_kernels_train_like_torch_paths(tmp_path):
    """Every fused kernel in the model (RMSNorm, RoPE, SwiGLU, linear + CE) under TRITON_INTERPRET=1."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", TRAIN_TWICE, str(ROOT / "conf"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT")[-1])
    torch_losses, triton_losses = result["torch"], result["triton"]
    assert len(torch_losses) == 3
    for a, b in zip(torch_losses, triton_losses):
        assert abs(a - b) <= 1e-4 * abs(a), (torch_losses, triton_losses)  # fp32, 3 optimizer steps


PEAK = textwrap.dedent("""
    import sys, torch
    from deepshard.finetune.models.llama import Llama, LlamaConfig
    cfg = LlamaConfig(vocab_size=32000, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=704,
                      loss_chunk_size=int(sys.argv[1]))
    torch.manual_seed(0)
    model = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 513))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking parent (a test worker's GBs)
    print(next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")))
""")


def _peak_bytes(chunk: int) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", PEAK, str(chunk)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.split()[-1])


@pytest.mark.slow  # two fresh interpreters at vocab 32k (~15 s); kernels keep the in-process memory test
def test_chunked_linear_cross_entropy_saves_the_logits_on_cpu():
    """A small-width Llama (vocab 32k, 2048 tokens): peak RSS of one training step, fused vs logits."""
    logits_bytes = 4 * 512 * 32000 * 4
    fused, plain = _peak_bytes(1024), _peak_bytes(0)
    assert plain - fused >= logits_bytes, (plain, fused, logits_bytes)
