"""Issue 34: the ds_config's ``checkpoint`` section and its optimizer's weight decay, as DeepSpeed 0.19.8
gives them, at world 2 (one launch, tests/compat/ds_ckpt_config_harness.py, about 25 s):

- ``checkpoint.tag_validation`` with a per-rank tag (``tag=loss.item()``): Warn warns on every rank and
  saves (under rank 0's tag), Ignore saves without a word, Fail raises on every rank and writes nothing
  (DeepSpeed's engine.py ``_checkpoint_tag_validation``).
- ``optimizer: {type: AdamW, params: {weight_decay: 0.1}}`` with ``model_parameters=model.parameters()``:
  DeepSpeed decays every parameter of its one group, norms and biases too; reference: torch's AdamW
  over all parameters in one process.
- ``checkpoint.writer.decoupled: true`` (DeepSpeed's writer in its own process): saves are written by a
  thread while training goes on; the shards equal a synchronous save's and a resume is bit-exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from deepshard.compat.ds_config import translate
from deepshard.core.checkpoint.manifest import latest_good
from deepshard.launch.local import launch_local
from tests.compat.ds_ckpt_config_harness import BETAS, LR, WD, exit_worker, worker
from tests.compat.ds_zero3_patterns_harness import TinyLM, batch


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    return launch_local(worker, 2, str(tmp_path_factory.mktemp("ds_ckpt_config")))


@pytest.mark.slow
def test_tag_validation_warn_ignore_fail(outs, tmp_path_factory):
    tags = [o["tags"] for o in outs]
    assert "error" not in tags[0], tags[0]
    assert tags[0]["Warn"]["tag"] != tags[1]["Warn"]["tag"]  # the ranks' losses differ: the case exists
    for rank in (0, 1):
        warn, ignore, fail = (tags[rank][m] for m in ("Warn", "Ignore", "Fail"))
        assert warn["error"] is None and len(warn["warnings"]) == 1, warn
        assert "differs across ranks" in warn["warnings"][0]
        assert f"saved under rank 0's tag {tags[0]['Warn']['tag']!r}" in warn["warnings"][0]
        assert ignore["error"] is None and ignore["warnings"] == []
        assert fail["error"] is not None and "checkpoint.tag_validation is Fail" in fail["error"]
        assert fail["warnings"] == []


@pytest.mark.slow
def test_ds_config_weight_decay_applies_to_every_parameter(outs):
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    for step in range(3):
        opt.zero_grad()
        losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in (batch(step, r) for r in (0, 1))]
        (sum(losses) / 2).backward()
        opt.step()
    for out in outs:
        assert "error" not in out["decay"], out["decay"]
        for stage, got in out["decay"].items():
            for name, p in model.named_parameters():
                torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6,
                                           msg=lambda m, s=stage, n=name: f"ZeRO-{s} {n}: {m}")


@pytest.mark.slow
def test_async_saves_equal_synchronous_ones_and_resume_bit_exact(outs):
    for out in outs:
        assert "error" not in out["async"], out["async"]
        run, sync = out["async"]["async"], out["async"]["sync"]
        assert run["in_flight_after_loop"] and run["sealed"] is not None  # the last save was still writing
        assert run["latest"] == sync["latest"] == "global_step4"
        assert run["losses"] == sync["losses"]
        assert out["async"]["same_shards"] == [True, True]
        assert out["async"]["client_state"] == {"step": 2}
        assert out["async"]["resumed"] == run["losses"][2:]  # bit-exact


@pytest.mark.slow
def test_an_async_save_in_flight_at_exit_is_sealed(tmp_path):
    """A script whose last call is an asynchronous save (its engine gone when the function returns): the
    worker's exit waits for the writer, so the checkpoint is sealed and ``latest`` names it."""
    launch_local(exit_worker, 2, str(tmp_path))
    assert (tmp_path / "latest").read_text() == "global_step2"
    found, _ = latest_good(tmp_path / "global_step2")
    assert found is not None and found.name == "step-00000002"
    assert not list((tmp_path / "global_step2").glob("*.tmp-*"))


def test_checkpoint_section_translates():
    tr = translate({"checkpoint": {"tag_validation": "fail", "writer": {"decoupled": True, "io_buffer_size": 1e8},
                                   "load_universal": False}})
    assert tr.entries["checkpoint.async_save"] == ("value", True)
    assert "checkpoint.writer.io_buffer_size" in tr.unsupported and "checkpoint.load_universal" in tr.unsupported
    assert not any(k.startswith("checkpoint.tag_validation") for k in tr.unsupported)
    with pytest.raises(ValueError, match=r"checkpoint.tag_validation='Loud': valid values are Warn, Ignore, Fail"):
        translate({"checkpoint": {"tag_validation": "Loud"}})
