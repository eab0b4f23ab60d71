"""The chaos soak's fault hooks (``recipe/chaos.py``): a fault fires at its event, step and rank only, once
in the whole run however often its step is replayed, logs the phase it hit; a load fault waits for the
fault it follows; a save fault fires at the save's first written bytes; a resume waits on the hold."""

from __future__ import annotations

import json
import threading
import time

from deepshard.core.checkpoint import progress
from deepshard.finetune.recipe import chaos


def plan(tmp_path, faults):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"faults": faults, "pause_s": 0}))
    return path


def fired(tmp_path):
    lines = (tmp_path / "events.jsonl").read_text().splitlines() if (tmp_path / "events.jsonl").exists() else []
    return [(e["id"], e["phase"], e["step"]) for e in map(json.loads, lines) if e["event"] == "fault"]


def test_faults_fire_once_at_their_event_step_and_rank(tmp_path):
    faults = [{"id": 0, "kind": "launcher_kill", "phase": "step", "step": 5, "rank": 0},
              {"id": 1, "kind": "sigterm_async", "phase": "save", "step": 10, "rank": 0},
              {"id": 2, "kind": "launcher_kill", "phase": "step", "step": 6, "rank": 1},
              {"id": 3, "kind": "launcher_kill", "phase": "load", "step": -1, "after": 1, "rank": 0}]
    c = chaos.Chaos(str(plan(tmp_path, faults)), rank=0)
    c.event("load", 5)  # fault 1 has not fired: no load fault yet
    for step in (4, 5, 6, 5, 6):  # step 5 replayed after a resume: fault 0 fires once; fault 2 is rank 1's
        c.event("step", step)
    c.event("save", 5)
    c.event("save", 10)
    c.event("load", 10)
    c.event("load", 10)
    again = chaos.Chaos(str(plan(tmp_path, faults)), rank=0)  # a restarted worker
    again.event("step", 5)
    again.event("save", 10)
    assert fired(tmp_path) == [(0, "step", 5), (1, "save", 10), (3, "load", 10)]


def test_a_save_fault_fires_at_the_first_written_bytes_and_a_resume_waits_for_the_hold(tmp_path, monkeypatch):
    path = plan(tmp_path, [{"id": 0, "kind": "launcher_kill", "phase": "save", "step": 20, "rank": 0}])
    monkeypatch.setenv(chaos.PLAN_ENV, str(path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(chaos, "_state", {})
    written: list[int] = []
    previous = progress.set_listener(chaos.listener(written.append))
    try:
        progress.report(100)  # bytes of something that is not an armed save
        assert fired(tmp_path) == []
        chaos.saving(20)
        progress.report(64)
        progress.report(64)
    finally:
        progress.set_listener(previous)
    assert written == [100, 64, 64] and fired(tmp_path) == [(0, "save", 20)]
    (tmp_path / chaos.HOLD).touch()
    threading.Timer(0.3, (tmp_path / chaos.HOLD).unlink).start()
    start = time.monotonic()
    chaos.before_resume()
    assert time.monotonic() - start >= 0.25
    chaos.resumed(15)
    notes = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert notes[-1]["event"] == "resumed" and notes[-1]["step"] == 15
