"""zero.Init (params never whole on a rank), GatheredParameters (full inside, modifier_rank's change
kept and reaching the fp32 masters), DeepSpeed's checkpoint calls with the ``latest`` tag file and
client_state, the LR schedule's position across save/load (DeepSpeed's recorded rates), and
save_16bit_model, on a real 2-rank gloo group at ZeRO-3."""

from __future__ import annotations

import pytest

from tests.compat.compat_ckpt_harness import FIXTURE, LR_CASE, checkpoint_worker
from tests.gloo_pool import pool


@pytest.mark.slow
def test_init_gather_checkpoint_and_16bit_model(tmp_path):
    outs = pool(2).run(checkpoint_worker, str(tmp_path))
    for rank, o in enumerate(outs):
        assert o["meta"], "zero.Init left a parameter materialized"
        assert o["local"] * 2 == o["full"]  # each rank holds half of the embedding, never all of it
        assert o["gathered_shape"][0] * o["gathered_shape"][1] == o["full"]
        assert o["row0"] == [0.5] * len(o["row0"]) and not o["row1_is_9"]
        assert rank or o["master_row0"] == o["row0"]  # the fp32 master took the change (rank 0 holds row 0)
        assert o["latest"] == "global_step2" and o["steps"] == 2
        assert o["path"].startswith(str(tmp_path / "global_step2"))
        assert o["client"] == {"epoch": 3, "note": "hi"}
        assert o["resumed"] == pytest.approx(o["after"], abs=1e-6), f"rank {rank}"
        # the LR schedule came back with the update count: DeepSpeed's own rates for this
        # WarmupDecayLR (recorded straight through, and after its own save at update 2 and resume)
        ds = FIXTURE["cases"][LR_CASE]["lrs"]
        assert o["lrs"] == pytest.approx(ds[:4], rel=1e-12) and o["resumed_lrs"] == pytest.approx(ds[2:4], rel=1e-12)
        assert o["resumed_lrs"] == pytest.approx(FIXTURE["resume"]["lrs_after"][:2], rel=1e-12)
        assert o["lr"] == pytest.approx([ds[4]], rel=1e-12)
    assert outs[0]["saved_keys"] and outs[0]["saved_match"]
    assert outs[0]["first"] != outs[1]["first"]  # ranks saw different data
