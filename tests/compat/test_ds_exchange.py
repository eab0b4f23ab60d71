"""Issue 34 item 4: checkpoint exchange with DeepSpeed on ordinary scripts.

DeepSpeed -> ours: a real DeepSpeed 0.19.8 checkpoint (tests/compat/fixtures/ds_tied_zero2, made by
bench/record_ds_tied_client_state.py: a tied-embedding tiny Llama, ZeRO-2, world 2, saved with a
``client_state``) imported with from_deepspeed and resumed by deepshard.compat.deepspeed at world 2:
``load_checkpoint`` hands back the script's client_state, the embedding stays tied, and the next 3
losses equal DeepSpeed's own continuation (recorded in the fixture)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ds_exchange_harness import resume_tied_worker

from deepshard.finetune.tools.from_deepspeed import import_checkpoint
from deepshard.launch.local import launch_local

TIED = Path(__file__).parent / "fixtures" / "ds_tied_zero2"


@pytest.mark.slow
def test_deepspeed_tied_checkpoint_with_client_state_resumes(tmp_path):
    record = json.loads((TIED / "continuation.json").read_text())
    imported = import_checkpoint(TIED / "checkpoint", tmp_path / "imported")
    for out in launch_local(resume_tied_worker, 2, str(imported), 2):
        assert out["client_state"] == record["client_state"]
        assert out["tied"]
        assert out["losses"] == pytest.approx(record["losses_after_resume"], abs=1e-5)
