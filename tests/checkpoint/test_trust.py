"""What a load or export reads is the checkpoint it verified, and the model it expects.

A checkpoint of another architecture is refused before anything is loaded, naming the first
mismatching key (an intended reshard still loads); DCP metadata naming a file outside the checkpoint,
or one the manifest does not list, is refused on load and export; export copies only the tokenizer
files the manifest lists and refuses symlinks and unlisted files by name; a crafted shard ends an
export with one line naming it, without torch's advice to load it with weights_only=False."""

from __future__ import annotations

import io
import shutil

import pytest
import torch

from deepshard.core.checkpoint.consolidate import tensor_infos
from deepshard.core.checkpoint.failures import one_line
from deepshard.core.checkpoint.manifest import CheckpointError, verify_checkpoint
from deepshard.core.checkpoint.state import load_checkpoint
from deepshard.finetune.tools.export import main as export_main
from deepshard.finetune.tools.hf_export import export_checkpoint
from tests.checkpoint.ckpt_harness import SPLIT
from tests.checkpoint.malicious import RunsCode, reseal
from tests.checkpoint.trust_harness import craft_shard, mismatch_worker, redirect_first_shard
from tests.gloo_pool import pool

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mismatch(tmp_path_factory):
    root = tmp_path_factory.mktemp("mismatch")
    return pool(2).run(mismatch_worker, str(root)), root


def test_a_checkpoint_of_another_architecture_is_refused_naming_the_first_mismatch(mismatch):
    (r0, r1), root = mismatch
    r1 = {k: v.replace("rank 1", "rank 0") if v else v for k, v in r1.items()}
    assert r0 == r1  # every rank refuses, with the same line
    three, two = str(root / "three" / "step-00000001"), str(root / "two" / "step-00000001")
    for key in ("fewer_layers", "fewer_layers_meta", "more_layers", "narrower"):
        assert r0[key] is not None and "\n" not in r0[key], (key, r0[key])
    assert r0["fewer_layers"].startswith(f"checkpoint {three!r} holds model.layers.2."), r0["fewer_layers"]
    assert "which this run's model does not have" in r0["fewer_layers"]
    assert "(the checkpoint's model differs: n_layers 3 vs 2)" in r0["fewer_layers_meta"], r0["fewer_layers_meta"]
    assert r0["more_layers"].startswith(f"checkpoint {two!r} lacks model.layers.2."), r0["more_layers"]
    assert "which this run's model has" in r0["more_layers"]
    assert r0["narrower"].startswith(f"checkpoint {two!r}: model.layers.0.mlp.gate_proj.weight has shape "
                                     f"[72, 32] there, [64, 32] in this run"), r0["narrower"]
    assert r0["reshard"] is None  # another stage (and world size) keeps the global shapes: it loads


def test_a_crafted_shard_is_refused_on_load_naming_it_without_torchs_advice(mismatch):
    (r0, _), root = mismatch
    assert r0["crafted_shard"] is not None and "__7_0.distcp" in r0["crafted_shard"], r0["crafted_shard"]
    assert "weights_only=False" not in r0["crafted_shard"] and "likely succeed" not in r0["crafted_shard"]
    assert "\n" not in r0["crafted_shard"] and not (root / "pwned").exists()


@pytest.fixture
def ckpt(world2, tmp_path):
    _, root = world2
    dst = tmp_path / "ckpts" / f"step-{SPLIT:08d}"
    shutil.copytree(root / "stage2" / f"step-{SPLIT:08d}", dst)
    return dst


def _one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_metadata_naming_a_file_outside_the_checkpoint_is_refused_on_load_and_export(ckpt, tmp_path, capsys):
    redirect_first_shard(ckpt, "../outside.distcp")
    verify_checkpoint(ckpt)  # resealed: the manifest's crc32 alone does not catch it
    with pytest.raises(CheckpointError, match=r"'\.\./outside\.distcp'.*outside the checkpoint"):
        load_checkpoint(ckpt, None, None)  # type: ignore[arg-type] - refused before these are used
    with pytest.raises(CheckpointError, match=r"outside the checkpoint"):
        tensor_infos(ckpt, "model.")
    assert export_main([str(ckpt), str(tmp_path / "out")]) == 2
    assert "../outside.distcp" in _one_error_line(capsys)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_metadata_naming_a_file_the_manifest_does_not_list_is_refused(ckpt, tmp_path, capsys):
    redirect_first_shard(ckpt, "__8_0.distcp")  # inside the checkpoint, added after sealing
    with pytest.raises(CheckpointError, match=r"'__8_0\.distcp'.*the manifest does not list"):
        load_checkpoint(ckpt, None, None)  # type: ignore[arg-type]
    assert export_main([str(ckpt), str(tmp_path / "out")]) == 2
    assert "__8_0.distcp" in _one_error_line(capsys)


def _with_tokenizer(ckpt):
    tok = ckpt / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": {}}')
    (tok / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    reseal(ckpt)
    return tok


def test_export_copies_the_tokenizer_files_the_manifest_lists(ckpt, tmp_path):
    _with_tokenizer(ckpt)
    summary = export_checkpoint(ckpt, tmp_path / "out")
    assert summary["tokenizer"]
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": {}}'
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == '{"bos_token": "<s>"}'


@pytest.mark.parametrize("entry", ["link_to_file", "link_to_dir", "unlisted_file", "sealed_link"])
def test_tokenizer_entries_the_manifest_does_not_vouch_for_are_refused_by_name(ckpt, tmp_path, capsys, entry):
    tok = _with_tokenizer(ckpt)
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret\n")
    name = {"link_to_file": "special_tokens_map.json", "link_to_dir": "extra", "unlisted_file": "added.json",
            "sealed_link": "special_tokens_map.json"}[entry]
    if entry == "unlisted_file":
        (tok / name).write_text("{}")
    else:
        (tok / name).symlink_to(tmp_path if entry == "link_to_dir" else secret)
    if entry == "sealed_link":
        reseal(ckpt)  # listed now, with the target's size and checksum
    out = tmp_path / "out"
    assert export_main([str(ckpt), str(out)]) == 2
    assert f"tokenizer/{name}" in _one_error_line(capsys)
    assert not any("host secret" in f.read_text(errors="replace") for f in out.rglob("*") if f.is_file())


def test_torchs_advice_to_turn_off_weights_only_is_never_quoted():
    buf = io.BytesIO()
    torch.save(RunsCode("/nonexistent/pwned"), buf)
    buf.seek(0)
    with pytest.raises(Exception) as err:
        torch.load(buf, weights_only=True)
    line = one_line(err.value)
    assert "weights_only" not in line and "likely succeed" not in line, line
    assert "posix.system" in line and "\n" not in line, line


def test_an_export_of_a_crafted_shard_ends_with_one_error_line_naming_it(ckpt, tmp_path, capsys):
    marker = tmp_path / "pwned"
    name = craft_shard(ckpt, marker)
    assert export_main([str(ckpt), str(tmp_path / "out")]) == 2
    line = _one_error_line(capsys)
    assert name in line and "weights_only" not in line and "likely succeed" not in line, line
    assert not marker.exists()


def test_a_shard_turned_into_a_link_after_a_first_read_is_refused_on_the_next(ckpt, tmp_path, capsys):
    """Consolidation keeps a checkpoint's checked metadata between reads of one export; a file of the
    checkpoint replaced meanwhile (here by a link to a copy of itself outside) is a new state, checked again."""
    from deepshard.core.checkpoint import load_full_tensor

    info = tensor_infos(ckpt, "model.")[0]
    before = load_full_tensor(ckpt, info)
    shard = sorted(ckpt.glob("*.distcp"))[0]
    outside = tmp_path / "outside.distcp"
    shutil.copy(shard, outside)
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(CheckpointError, match=rf"{shard.name}"):
        load_full_tensor(ckpt, info)
    assert export_main([str(ckpt), str(tmp_path / "out")]) == 2
    assert shard.name in _one_error_line(capsys)
    assert before.numel() > 0
