"""``None`` means "pick for me"; a value the user gave is never changed (issue 47).  The offload keys
the preflight may pick (``sub_group_size``, ``buffer_count``, ``param_buffer_count``,
``param_prefetch``) default to None in the Hydra schema; validated settings hold OffloadConfig's
defaults there and name the keys left out, and the preflight picks only those.  Before, a value equal
to its default counted as "not given": an explicit ``offload.sub_group_size=16777216`` was cut to
2**21 when memory was short (this file's first test failed on that code)."""

from __future__ import annotations

import json

import pytest

from deepshard.finetune import preflight as pf
from deepshard.finetune.config import validate
from deepshard.finetune.config.ds_config import merge_argv
from deepshard.finetune.tools.estimate import compose
from deepshard.offload import OffloadConfig

NVME = ["+zero=stage3", "+offload=nvme", "offload.params=nvme", "launcher.nproc_per_node=2"]


def _short_room(monkeypatch) -> None:
    """A host with (almost) no room: every pickable buffer goes to its smallest choice."""
    monkeypatch.setattr(pf, "room", lambda: (1, "a test's room"))


def test_an_explicit_value_equal_to_the_default_is_kept(monkeypatch, tmp_path):
    _short_room(monkeypatch)
    given = validate(compose([*NVME, f"offload.nvme_path={tmp_path}", "offload.sub_group_size=16777216"]))
    chosen, _ = pf.fit_buffers(given, 2)
    assert chosen.offload.sub_group_size == 16777216 == OffloadConfig.sub_group_size  # as given
    assert chosen.offload.buffer_count == 1  # left out: picked for the room


def test_values_left_out_are_picked_and_resolved_before_the_workers(monkeypatch, tmp_path):
    _short_room(monkeypatch)
    s = validate(compose([*NVME, f"offload.nvme_path={tmp_path}"]))
    assert set(s.offload_picks) == {"sub_group_size", "buffer_count", "param_buffer_count", "param_prefetch",
                                    "param_buffer_size"}
    assert s.offload == OffloadConfig(**{**vars(s.offload)})  # library defaults, plain ints
    assert s.offload.sub_group_size == OffloadConfig.sub_group_size and s.offload.buffer_count == 3
    with pytest.raises(ValueError, match="memory: this run needs about"):  # no room at all: refused
        pf.preflight_memory(s, 2)
    chosen, line = pf.fit_buffers(s, 2)
    assert (chosen.offload.buffer_count, chosen.offload.param_buffer_count, chosen.offload.param_prefetch,
            chosen.offload.sub_group_size) == (1, 2, 1, 2**21)
    monkeypatch.setattr(pf, "room", lambda: None)  # no limit known: nothing to pick, all resolved
    workers_get = pf.preflight_memory(s, 2)
    assert workers_get.offload_picks == () and workers_get.offload == s.offload
    assert all(type(getattr(workers_get.offload, k)) is int for k in pf._CHOICE_KEYS)


def test_given_buffers_are_kept_and_the_rest_picked(monkeypatch, tmp_path):
    _short_room(monkeypatch)
    s = validate(compose([*NVME, f"offload.nvme_path={tmp_path}", "offload.buffer_count=3",
                          "offload.param_buffer_count=4"]))
    chosen, line = pf.fit_buffers(s, 2)
    o = chosen.offload
    assert (o.buffer_count, o.param_buffer_count, o.param_prefetch, o.sub_group_size) == (3, 4, 1, 2**21)
    assert line is None or ("offload.buffer_count" not in line and "offload.param_prefetch=1" in line), line


def test_a_deepspeed_config_gives_explicit_values(tmp_path):
    """ds_config import: its keys are the user's values, equal to our defaults or not."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "sub_group_size": 16777216,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4}}}))
    argv, _ = merge_argv(["main.py", f"+deepspeed={path}", "launcher.nproc_per_node=2"])
    s = validate(compose(argv[1:]))
    assert s.offload.params == "nvme" and s.offload_picks == ("param_prefetch", "param_buffer_size")
    assert (s.offload.sub_group_size, s.offload.buffer_count, s.offload.param_buffer_count) == (16777216, 3, 4)


def test_the_schema_leaves_the_picks_unset():
    cfg = compose(NVME + ["offload.nvme_path=/tmp"])
    assert all(cfg["offload"][k] is None for k in (*pf._CHOICE_KEYS, "param_buffer_size"))
