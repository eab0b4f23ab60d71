"""Issue 41: the opt-in provider of the name ``deepspeed`` (deepshard.compat.provide_deepspeed).

Each case is a fresh interpreter (the provider acts at interpreter start, through the .pth our package
installs).  A stand-in for a real DeepSpeed install (a ``deepspeed`` package and its dist-info on
``PYTHONPATH``) shows that nothing changes where the user did not ask, and that asking wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepshard.compat.deepspeed_provider import ENV, VERSION, requested

PROBE = r"""
import importlib.metadata, importlib.util, json, sys
out = {"preloaded": "deepshard.compat.provide_deepspeed" in sys.modules, "torch_at_start": "torch" in sys.modules}
{prelude}
out["found"] = importlib.util.find_spec("deepspeed") is not None
try:
    out["version"] = importlib.metadata.version("deepspeed")
except importlib.metadata.PackageNotFoundError:
    out["version"] = None
if out["found"]:
    import deepspeed
    out["module"], out["attr_version"] = deepspeed.__name__, deepspeed.__version__
{extra}
print(json.dumps(out))
"""

HF_CHECKS = r"""
import deepshard.compat.deepspeed as ours
from accelerate.utils import is_deepspeed_available as accelerate_sees
from transformers.dependency_versions_check import dep_version_check
from transformers.integrations.deepspeed import is_deepspeed_available as transformers_sees
dep_version_check("deepspeed")  # transformers' own minimum-version check
from deepspeed import DeepSpeedEngine, comm, zero
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.engine import DeepSpeedEngine as engine_by_path
from deepspeed.runtime.zero import partition_parameters
from deepspeed.utils import logger
out["same_module"] = deepspeed is ours and engine_by_path is DeepSpeedEngine is ours.DeepSpeedEngine
out["spec_kept"] = ours.__spec__.name == "deepshard.compat.deepspeed"
out["hf_available"] = [transformers_sees(), accelerate_sees()]
out["lr_schedules"] = deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
out["zero_init"] = partition_parameters.Init is zero.Init
import os
out["hub_kernels"] = os.environ.get("USE_HUB_KERNELS")
import importlib, torch
missing = {}  # what accelerate imports only for paths deepshard does not provide: the import fails naming it
for name in ("deepspeed.ops.adagrad", "deepspeed.ops.lion"):  # map_pytorch_optim_to_deepspeed, offload + Adagrad/Lion
    try:
        importlib.import_module(name)
        missing[name] = ""
    except ImportError as err:
        missing[name] = str(err)
try:  # accelerate's set_moe_leaf_modules (ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES)
    from deepspeed.utils import set_z3_leaf_modules
    missing["set_z3_leaf_modules"] = ""
except ImportError as err:
    missing["set_z3_leaf_modules"] = str(err)
out["missing"] = missing
weight = torch.nn.Linear(2, 2).weight  # PEFT's gather_params_ctx and accelerate's GatheredParameters call shapes
with zero.GatheredParameters(weight, modifier_rank=0, fwd_module=None):
    with zero.GatheredParameters([weight], modifier_rank=None, fwd_module=torch.nn.Linear(2, 2), enabled=False):
        out["gathered_calls"] = True
"""


def _probe(tmp_path: Path, *, env: dict[str, str], prelude: str = "", extra: str = "",
           stand_in: bool = False) -> tuple[dict, str]:
    environ = {k: v for k, v in os.environ.items() if k != ENV}
    environ.update(env)
    if stand_in:
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_real_deepspeed(tmp_path)),
                                                              environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", PROBE.replace("{prelude}", prelude).replace("{extra}", extra)], env=environ,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _real_deepspeed(tmp_path: Path) -> Path:
    """A stand-in for an installed DeepSpeed 0.19.8: the package and its metadata."""
    site = tmp_path / "site"
    (site / "deepspeed").mkdir(parents=True, exist_ok=True)
    (site / "deepspeed" / "__init__.py").write_text('__version__ = "0.19.8"\n')
    info = site / "deepspeed-0.19.8.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    return site


def test_unset_nothing_is_provided_and_nothing_imported(tmp_path):
    out, err = _probe(tmp_path, env={})
    assert out == {"preloaded": False, "torch_at_start": False, "found": False, "version": None}
    assert "deepspeed:" not in err


def test_unset_a_real_deepspeed_stays_what_import_gives(tmp_path):
    out, _ = _probe(tmp_path, env={ENV: "0"}, stand_in=True)
    assert out["module"] == "deepspeed" and out["version"] == out["attr_version"] == "0.19.8"
    assert not out["preloaded"]


def test_asked_for_the_hf_stack_finds_our_engine(tmp_path):
    """Under the launcher's variable, even beside a real DeepSpeed: transformers' and accelerate's
    checks pass, the modules they import resolve to ours, and rank 0 says which engine runs."""
    out, err = _probe(tmp_path, env={ENV: "1", "RANK": "0"}, extra=HF_CHECKS, stand_in=True)
    assert out["preloaded"] and not out["torch_at_start"]  # the .pth imports the provider only, not torch
    assert out["module"] == "deepshard.compat.deepspeed"
    assert out["version"] == out["attr_version"] == VERSION
    assert out["same_module"] and out["spec_kept"] and out["zero_init"]
    assert out["hf_available"] == [True, True]
    assert "WarmupLR" in out["lr_schedules"]
    assert all(name.rpartition(".")[2] in why for name, why in out["missing"].items()), out["missing"]
    assert out["gathered_calls"]
    assert out["hub_kernels"] == "NO"  # kernels refuse zero.Init's meta parameters (from_pretrained at ZeRO-3)
    assert err.count(f"deepspeed: deepshard {VERSION} engine") == 1


def test_one_line_in_the_script_and_quiet_on_other_ranks(tmp_path):
    out, err = _probe(tmp_path, env={"RANK": "1"}, prelude="import deepshard.compat.provide_deepspeed")
    assert not out["preloaded"] and out["version"] == VERSION and out["module"] == "deepshard.compat.deepspeed"
    assert "deepspeed:" not in err  # the line is rank 0's


def test_a_real_deepspeed_imported_first_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import deepspeed, deepshard.compat.provide_deepspeed"],
                          env={**{k: v for k, v in os.environ.items() if k != ENV},
                               "PYTHONPATH": str(_real_deepspeed(tmp_path))},
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("ValueError: DEEPSHARD_DEEPSPEED: the real deepspeed")


@pytest.mark.parametrize(("value", "asked"), [("", False), ("0", False), ("false", False), ("1", True),
                                              ("yes", True)])
def test_requested(value, asked):
    assert requested({ENV: value}) is asked
    assert requested({}) is False


def test_the_launcher_asks_for_it_unless_told_not_to(monkeypatch, tmp_path):
    from deepshard.launch import cli

    script = tmp_path / "train.py"
    script.write_text("")
    for before, after in ((None, "1"), ("0", "0")):
        if before is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, before)
        args = cli.parse(["--num_gpus", "2", str(script)])
        node, _ = cli._this_node(args, *cli.resources(args))
        assert node.env[ENV] == after


KEYS = r"""
import contextlib, io
from deepshard.compat.deepspeed.config import compat_config
ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
      "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2, "sub_group_size": 1e9}}
err = io.StringIO()
with contextlib.redirect_stderr(err):
    compat_config(ds, dp=1, cuda=False)  # a DeepSpeed script's own import: one warning line, no stop
print("WARNED", err.getvalue().strip())
import deepshard.compat.provide_deepspeed  # as in every worker `deepshard` starts
err = io.StringIO()
with contextlib.redirect_stderr(err):
    compat_config(ds, dp=1, cuda=False)  # a DeepSpeed script importing deepshard.compat.deepspeed itself
print("WARNED", err.getvalue().strip())
import deepspeed  # now the HF stack's path: transformers and accelerate import the name
try:
    compat_config(ds, dp=1, cuda=False)
except ValueError as e:
    print("REFUSED", e)
speed_only = {**ds, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
with contextlib.redirect_stderr(io.StringIO()):
    compat_config(speed_only, dp=1, cuda=False)
print("SPEED_ONLY_OK")
"""


def test_keys_that_change_results_stop_under_the_provider(tmp_path):
    """Under the provided ``deepspeed``, an ignored key that changes the numbers stops before training,
    one line naming the ds_config and the key; a speed-only key keeps the warning, and a script that
    imports deepshard.compat.deepspeed itself keeps today's warning for both, also with the provider
    installed (every worker `deepshard` starts has it)."""
    done = subprocess.run([sys.executable, "-c", KEYS], env={k: v for k, v in os.environ.items() if k != ENV},
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("WARNED warning: ds_config: not supported, ignored: optimizer.type=Lamb")
    assert lines[1] == lines[0]  # the provider installed, but this script never imported the name `deepspeed`
    assert lines[2] == ("REFUSED the ds_config (TrainingArguments(deepspeed=...)): optimizer.type=Lamb: not supported "
                        "by deepshard's engine, and ignoring it would change the results; remove it (or train on "
                        "DeepSpeed: DEEPSHARD_DEEPSPEED=0)")
    assert lines[3] == "SPEED_ONLY_OK"


def test_importing_the_machinery_provides_nothing():
    """This pytest process imported the provider's module (above) and collected every test: ``deepspeed``
    is still not served here, so a test that needs the real DeepSpeed skips rather than meets ours."""
    from deepshard.compat.deepspeed_provider import active

    assert not active()
    assert "deepshard.compat.provide_deepspeed" not in sys.modules
