"""Muon with optimizer offload, decided before any worker starts: ``+offload=cpu`` runs (the host store
runs the rule over every parameter in one call; tests/core/test_muon.py trains it against the reference),
the NVMe store and parameter offload are refused in one line naming the keys."""

from __future__ import annotations

import pytest

BASE = ["optim=muon", "+zero=stage3", "launcher.nproc_per_node=2"]


def _validate(*overrides: str):
    from deepshard.finetune.config import validate
    from deepshard.finetune.tools.estimate import compose

    return validate(compose([*BASE, *overrides]))


def test_muon_with_the_host_store_validates():
    s = _validate("+offload=cpu")
    assert (s.engine.optim.name, s.offload.device, s.offload.params) == ("muon", "cpu", "none")


@pytest.mark.parametrize("overrides, keys", [
    (("+offload=nvme", "offload.nvme_path={tmp}"), "offload.device='nvme'"),
    (("+offload=cpu", "offload.params=cpu"), "offload.params='cpu'"),
])
def test_muon_with_nvme_or_param_offload_is_refused_by_key(tmp_path, overrides, keys):
    with pytest.raises(ValueError) as e:
        _validate(*(o.format(tmp=tmp_path) for o in overrides))
    message = str(e.value)
    assert "\n" not in message and "optim.name=muon" in message and keys in message, message
