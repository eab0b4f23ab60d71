"""core.checkpoint.write_offline_checkpoint, what converters write with: each tensor built once, when
DCP writes it; the result verifies and reads back like any save (manifest, trainer.json, no RNG); a
failing build leaves nothing; an existing step is refused before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepshard.core.checkpoint import (
    iter_full_tensors,
    read_manifest,
    read_trainer,
    verify_checkpoint,
    write_offline_checkpoint,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    full = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g)}
    out = {}
    for prefix, shift in (("model.", 0.0), ("optim.exp_avg.", 1.0), ("optim.exp_avg_sq.", 2.0)):
        out.update({prefix + k: v + shift for k, v in full.items()})
    return out


def _write(root: Path, full: dict[str, torch.Tensor], build) -> Path:
    shapes = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in full.items()}
    return write_offline_checkpoint(root, 4, shapes, build, scaler={"scale": 8.0}, app_state={"x": 1},
                                    zero_stage=2, dp_size=2, meta={"note": "made here"})


def test_written_tensor_by_tensor_and_read_back(tmp_path):
    full = _tensors()
    built: list[str] = []

    def build(key: str) -> torch.Tensor:
        built.append(key)
        return full[key].clone()

    path = _write(tmp_path, full, build)
    assert path == tmp_path / "step-00000004" and sorted(built) == sorted(full)  # each once
    verify_checkpoint(path)  # every file listed with its crc32
    got = {i.key: t for i, t in iter_full_tensors(path)}
    assert got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in full)
    manifest, trainer = read_manifest(path), read_trainer(path)
    assert manifest["world"] == {"world_size": 0, "dp_size": 2, "zero_stage": 2} and manifest["num_params"] == 2
    assert manifest["meta"] == {"note": "made here"}
    assert trainer["num_updates"] == 4 and trainer["app"] == {"x": 1} and trainer["world_size"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp dir, no owner marker left
    assert not (path / ".owner.json").exists()
    with pytest.raises(ValueError, match="already exists"):
        _write(tmp_path, full, build)


def test_a_failing_build_leaves_nothing(tmp_path):
    full = _tensors()

    def build(key: str) -> torch.Tensor:
        if key == "optim.exp_avg.b":
            raise ValueError("rank file 1: short")
        return full[key].clone()

    with pytest.raises(ValueError, match="^rank file 1: short$"):
        _write(tmp_path, full, build)
    assert list(tmp_path.iterdir()) == []
