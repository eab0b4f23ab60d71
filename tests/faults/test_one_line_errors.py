"""Mistakes a user makes before any training starts end with one ``error:`` line naming the file, the
key or the override, exit 2, no traceback (issue #33 item 6, and item 7's data parts).

Every case runs the real command in a fresh interpreter: ``python apps/finetune/main.py ...`` (Hydra
override typos, an unwritable or full ``hydra.run.dir``, bad ds_config values, a chat template the
sandbox refuses, chat files with no assistant turn, a Latin-1 ``.txt``) or ``python -m
deepshard.finetune.tools.from_deepspeed`` (crafted DeepSpeed checkpoints: no ``.tmp-import`` may be left,
and torch's advice to retry with ``weights_only=False`` must never reach the user).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.app_runner import run_main, run_module

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "apps/finetune/main.py"
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
        "data.seq_len=32", "train.max_steps=2"]

# torch's advice when its weights-only unpickler refuses a file, in the words it has used
UNSAFE_ADVICE = ("weights_only=False", "will likely succeed", "`weights_only` set to `False`")

pytestmark = pytest.mark.slow


def _one_line(proc: subprocess.CompletedProcess, expected: str) -> str:
    """The command failed with exit 2 and one ``error:`` line, the last, starting with ``expected``."""
    err = proc.stderr
    lines = err.strip().splitlines()
    assert proc.returncode == 2, f"exit {proc.returncode}:\n{err[-3000:]}"
    assert lines and lines[-1].startswith(expected), f"expected {expected!r}, got:\n{err[-3000:]}"
    assert sum(line.startswith("error:") for line in lines) == 1, err[-3000:]
    assert "Traceback" not in err and not any(advice in err for advice in UNSAFE_ADVICE), err[-3000:]
    return lines[-1]


def _main(tmp: Path, *overrides: str, run_dir: Path | None = None, env: dict | None = None):
    run_dir = run_dir if run_dir is not None else tmp / "run"
    return run_main([*TINY, *overrides, f"hydra.run.dir={run_dir}"], cwd=tmp, timeout=300,
                    env={**os.environ, **(env or {})})


def _nothing_trained(run_dir: Path) -> None:
    assert not (run_dir / "heartbeat").exists() and not (run_dir / "checkpoints").exists()
    assert not (run_dir / "launcher.log").exists()  # no worker started (its traceback would be there)


# --- Hydra: override typos and the run directory -------------------------------------------------------

def test_unknown_key_names_the_override(tmp_path):
    line = _one_line(_main(tmp_path, "train.max_stepz=3"), "error: train.max_stepz=3: no such key")
    assert "train.max_steps" in line  # the close match


def test_unknown_group_option_lists_the_valid_ones(tmp_path):
    line = _one_line(_main(tmp_path, "+zero=stage9"), "error: zero=stage9: ")
    assert "stage0, stage1, stage2, stage3" in line


def test_override_that_does_not_parse_is_named(tmp_path):
    _one_line(_main(tmp_path, "optim.lr=["), "error: optim.lr=[: ")


def test_hydra_full_error_still_gives_the_full_trace(tmp_path):
    proc = _main(tmp_path, "train.max_stepz=3", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr, proc.stderr[-2000:]


def test_run_dir_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    run_dir = blocker / "run"
    _one_line(_main(tmp_path, run_dir=run_dir), f"error: hydra.run.dir={run_dir}: ")


@pytest.mark.parametrize("how", ["read-only", "full"])
def test_run_dir_read_only_or_full(tmp_path, mount_tmpfs, how):
    mnt = mount_tmpfs("256k")
    if how == "full":
        with open(mnt / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
    else:
        res = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
        if res.returncode:
            pytest.skip(f"cannot remount read-only: {res.stderr.strip()}")
    run_dir = mnt / "run"
    line = _one_line(_main(tmp_path, run_dir=run_dir), f"error: hydra.run.dir={run_dir}: ")
    assert ("No space left" if how == "full" else "Read-only") in line


# --- ds_config values: named by the file's own key -----------------------------------------------------

def _ds(tmp: Path, config: dict) -> Path:
    path = tmp / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


def test_ds_config_batch_not_a_number(tmp_path):
    ds = _ds(tmp_path, {"train_micro_batch_size_per_gpu": "eight", "gradient_accumulation_steps": 1})
    _one_line(_main(tmp_path, f"+deepspeed={ds}"), f"error: {ds}: train_micro_batch_size_per_gpu='eight': ")


def test_ds_config_zero_stage_4(tmp_path):
    ds = _ds(tmp_path, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 4}})
    _one_line(_main(tmp_path, f"+deepspeed={ds}"),
              f"error: {ds}: zero_optimization.stage=4: valid values are 0, 1, 2, 3")


def test_ds_config_value_of_the_wrong_type_is_named_by_its_ds_key(tmp_path):
    """Any value the app's schema refuses (here a string lr) is named as the file names it."""
    ds = _ds(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}})
    _one_line(_main(tmp_path, f"+deepspeed={ds}"), f"error: {ds}: optimizer.params.lr='fast': ")


# --- data: nothing is trained on text that is not what it seems ----------------------------------------

CHAT = {"messages": [{"role": "user", "content": "how many apples?"}, {"role": "assistant", "content": "three."}]}


def test_chat_template_refused_by_the_sandbox_names_the_template(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text((json.dumps(CHAT) + "\n") * 200)
    template = tmp_path / "evil.jinja"
    template.write_text("{% for m in messages %}{{ m.content.__class__.__mro__ }}{% endfor %}")
    proc = _main(tmp_path, "data=chat", f"data.path={data}", f"data.chat_template={template}")
    line = _one_line(proc, f"error: data.chat_template='{template}': ")
    assert "unsafe" in line
    _nothing_trained(tmp_path / "run")


def test_chat_file_without_assistant_turns_is_refused(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text((json.dumps({"messages": CHAT["messages"][:1]}) + "\n") * 200)
    _one_line(_main(tmp_path, "data=chat", f"data.path={data}"), f"error: {data}: no conversation has an assistant")
    _nothing_trained(tmp_path / "run")


def test_latin1_text_is_refused_not_replaced(tmp_path):
    data = tmp_path / "notes.txt"
    data.write_bytes(b"a plain line of text\n" * 500 + "un caf\xe9 au lait\n".encode("latin-1") + b"more\n" * 500)
    _one_line(_main(tmp_path, "data=text", "data.text_unit=line", f"data.path={data}"),
              f"error: {data}:501: not UTF-8 text (byte 0xe9 at column 7)")
    _nothing_trained(tmp_path / "run")


# --- DeepSpeed checkpoint import: one line, nothing left behind ----------------------------------------

class _RunsACommand:
    def __reduce__(self):
        return (os.system, ("echo this must not run",))


def _zero2(root: Path, *, short_rank: int | None = None, drop: str | None = None) -> Path:
    """DeepSpeed's ZeRO-2 layout at world 2 (one group of two matrices), written without DeepSpeed."""
    tag = root / "global_step5"
    tag.mkdir(parents=True)
    shapes = {"layers.0.weight": torch.Size([2, 1024]), "layers.1.weight": torch.Size([1, 1024])}
    torch.save({"module": {}, "param_shapes": [shapes], "buffer_names": [], "global_steps": 5},
               tag / "mp_rank_00_model_states.pt")
    for r in range(2):
        flat = torch.full((1536 - (100 if r == short_rank else 0),), float(r))
        osd = {"zero_stage": 2, "loss_scaler": None, "partition_count": [2], "single_partition_of_fp32_groups": [flat],
               "base_optimizer_state": {"state": {0: {"step": 5, "exp_avg": flat + 1, "exp_avg_sq": flat + 2}},
                                        "param_groups": [{"lr": 1e-3, "params": [0]}]}}
        osd.pop(drop, None)
        torch.save({"optimizer_state_dict": osd}, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    (root / "latest").write_text(tag.name)
    return tag


def _import(ds: Path, out: Path):
    proc = run_module("deepshard.finetune.tools.from_deepspeed", [ds, out], cwd=Path.cwd(), timeout=300)
    if out.exists():
        assert not list(out.glob("*.tmp-import")), list(out.iterdir())
    assert "this must not run" not in proc.stdout
    return proc


def test_import_refuses_a_global_without_torchs_advice(tmp_path):
    tag = _zero2(tmp_path / "ds")
    torch.save({"module": {}, "param_shapes": [], "x": _RunsACommand()}, tag / "mp_rank_00_model_states.pt")
    line = _one_line(_import(tmp_path / "ds", tmp_path / "out"), f"error: {tag / 'mp_rank_00_model_states.pt'}: ")
    assert "unsupported global: GLOBAL posix.system" in line or "unsupported global: GLOBAL os.system" in line


def test_import_of_a_truncated_file(tmp_path):
    tag = _zero2(tmp_path / "ds")
    f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:300])
    _one_line(_import(tmp_path / "ds", tmp_path / "out"), f"error: {f}: ")


def test_import_of_a_partition_shorter_than_its_layout_leaves_no_tmp_import(tmp_path):
    tag = _zero2(tmp_path / "ds", short_rank=1)
    _one_line(_import(tmp_path / "ds", tmp_path / "out"),
              f"error: {tag / 'zero_pp_rank_1_mp_rank_00_optim_states.pt'}: ")
    assert not list((tmp_path / "out").glob("*"))


def test_import_of_a_file_missing_a_key(tmp_path):
    tag = _zero2(tmp_path / "ds", drop="zero_stage")
    line = _one_line(_import(tmp_path / "ds", tmp_path / "out"),
                     f"error: {tag / 'zero_pp_rank_0_mp_rank_00_optim_states.pt'}: ")
    assert "zero_stage" in line


def test_import_refuses_a_later_rank_file_and_removes_the_partial_import(tmp_path):
    """A rank file other than the first, read while DCP writes: refused, and the partial import removed."""
    tag = _zero2(tmp_path / "ds")
    f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": 2, "fn": pickle.loads(pickle.dumps(print))}}, f)
    line = _one_line(_import(tmp_path / "ds", tmp_path / "out"), f"error: {f}: ")
    assert re.search(r"unsupported global: GLOBAL (builtins\.)?print\b", line), line
    assert not list((tmp_path / "out").glob("*"))


def test_import_replaces_the_leftover_of_a_killed_import(tmp_path):
    """A kill leaves ``step-N.tmp-import`` behind (no chance to clean up): the next import replaces it."""
    _zero2(tmp_path / "ds")
    leftover = tmp_path / "out" / "step-00000005.tmp-import"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"half")
    proc = _import(tmp_path / "ds", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["step-00000005"]


def test_import_into_a_full_directory(tmp_path, mount_tmpfs):
    _zero2(tmp_path / "ds")
    out = mount_tmpfs("64k")
    with open(out / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
        while True:
            f.write(b"\0" * 4096)
    _one_line(_import(tmp_path / "ds", out), "error: ")
    assert sorted(p.name for p in out.iterdir()) == ["filler"]
