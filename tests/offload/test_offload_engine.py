"""Through core's real engine (ZeRO 1-3, fp32 and bf16): offloaded stores train bitwise like the default.

Runs in a child process: the engine starts a 1-rank gloo group, which must not leak into the
pytest process that other test folders share.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, torch, torch.nn as nn
    from deepshard.core import DeviceStateStore, EngineConfig, PrecisionConfig, ZeroConfig, initialize
    from deepshard.core.mesh import local_device
    from deepshard.offload import OffloadConfig, make_store_factory

    def train(factory, stage, dtype):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(33, 65), nn.ReLU(), nn.Linear(65, 7)).to(local_device())
        cfg = EngineConfig(zero=ZeroConfig(stage=stage), precision=PrecisionConfig(dtype=dtype))
        engine = initialize(model, cfg, store_factory=factory, blocks=nn.ModuleList())
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(8, 33, generator=gen).to(local_device(), next(model.parameters()).dtype)
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
        engine.store.close()
        return [p.detach().float().clone() for p in model.parameters()]

    factories = {
        "cpu": make_store_factory(OffloadConfig(device="cpu"), 0, "engine"),
        "nvme": make_store_factory(OffloadConfig(device="nvme", nvme_path=sys.argv[1], sub_group_size=500,
                                                 buffer_size=500, buffer_count=2), 0, "engine"),
    }
    for stage in (1, 2, 3):
        for dtype in ("fp32", "bf16"):
            ref = train(DeviceStateStore, stage, dtype)
            for name, factory in factories.items():
                same = all(torch.equal(a, b) for a, b in zip(ref, train(factory, stage, dtype)))
                print(stage, dtype, name, same)
""")


def test_engine_parity_with_offloaded_stores(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 12 and all(line.endswith("True") for line in lines), out.stdout
    assert list(tmp_path.iterdir()) == []  # every store removed its swap files
