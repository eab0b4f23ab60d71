"""Loading a checkpoint executes nothing from it: a crafted DCP ``.metadata`` or a pickled extra-state
item is refused with one line naming the file, on load and on export, and the payload never runs."""

from __future__ import annotations

import json
import shutil

import pytest

from deepshard.core.checkpoint.consolidate import tensor_infos
from deepshard.core.checkpoint.manifest import MANIFEST, CheckpointError, verify_checkpoint
from deepshard.core.checkpoint.safe_load import read_metadata_safely
from deepshard.core.checkpoint.state import load_checkpoint
from deepshard.finetune.tools.export import main as export_main
from tests.checkpoint.ckpt_harness import SPLIT
from tests.checkpoint.malicious import add_pickled_item, poison_metadata


@pytest.fixture
def ckpt(world2, tmp_path):
    _, root = world2
    dst = tmp_path / f"step-{SPLIT:08d}"
    shutil.copytree(root / "stage2" / f"step-{SPLIT:08d}", dst)
    return dst


def _refused_everywhere(ckpt, tmp_path, capsys, match: str) -> None:
    """Refused by the metadata reader, by load_checkpoint (before the optimizer is touched) and by export."""
    verify_checkpoint(ckpt)  # resealed: the crc32 manifest alone does not catch tampering
    with pytest.raises(CheckpointError, match=match) as err:
        read_metadata_safely(ckpt)
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(ckpt, None, None)  # type: ignore[arg-type] - refused before these are used
    with pytest.raises(CheckpointError, match=match):
        tensor_infos(ckpt, "model.")
    assert export_main([str(ckpt), str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and ".metadata" in lines[0], lines


def test_a_metadata_pickle_that_runs_code_is_refused(ckpt, tmp_path, capsys):
    marker = tmp_path / "pwned"
    poison_metadata(ckpt, marker)
    _refused_everywhere(ckpt, tmp_path, capsys, r"\.metadata' asks to load posix\.system.*refused")
    assert not marker.exists()


def test_a_pickled_extra_state_item_is_refused(ckpt, tmp_path, capsys):
    marker = tmp_path / "pwned"
    add_pickled_item(ckpt, marker)
    _refused_everywhere(ckpt, tmp_path, capsys, r"\.metadata' declares pickled object item\(s\) \['trainer'\]")
    assert not marker.exists()


def test_extra_state_is_json(ckpt):
    """The scalars and RNG states are plain JSON files the manifest covers; no byte items in DCP."""
    files = json.loads((ckpt / MANIFEST).read_text())["files"]
    assert {"trainer.json", "rng/rank-0.json", "rng/rank-1.json"} <= set(files)
    assert json.loads((ckpt / "trainer.json").read_text())["app"] == {"step": SPLIT}
    assert read_metadata_safely(ckpt).state_dict_metadata  # only tensors: the strict reader accepts it


def test_a_damaged_json_state_file_is_named(ckpt):
    (ckpt / "trainer.json").write_text("{not json")
    from tests.checkpoint.malicious import reseal

    reseal(ckpt)
    with pytest.raises(CheckpointError, match=r"trainer\.json is not valid JSON"):
        load_checkpoint(ckpt, None, None)  # type: ignore[arg-type]


def test_the_old_pickled_format_is_not_loaded(ckpt):
    manifest = json.loads((ckpt / MANIFEST).read_text())
    (ckpt / MANIFEST).write_text(json.dumps({**manifest, "format": "deepshard-checkpoint/1"}))
    with pytest.raises(CheckpointError, match="pickled state, which is not loaded"):
        verify_checkpoint(ckpt)
