"""``DEEPSHARD_DEEPSPEED=1 accelerate launch --config_file cfg.yaml train.py``: accelerate's own DeepSpeed
yamls on deepshard's engine, with the keys nothing would honour refused before a worker starts.

accelerate's launcher maps the yaml to its workers' environment (``ACCELERATE_DEEPSPEED_ZERO_STAGE``...),
and their ``DeepSpeedPlugin`` builds the ds_config the provided ``deepspeed.initialize`` reads, so
accelerate's mapping is used as it is.  Under the provider (the variable set, so the ``.pth`` runs in the
``accelerate`` process too) :func:`check` runs first, from a wrapper around accelerate's ``launch_command``
(installed when ``accelerate.commands.launch`` is imported: ``hf_cpu``'s import hook): a key that would
change results, or that accelerate would route away from our engine, stops the launch with one line
naming the file and the key.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

# accelerate 1.16's deepspeed_config keys that reach DeepSpeedPlugin (or its launcher) and mean the same here
DEEPSPEED_KEYS = {"zero_stage", "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
                  "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping", "zero3_init_flag",
                  "zero3_save_16bit_model", "deepspeed_config_file", "deepspeed_hostfile",
                  "deepspeed_multinode_launcher", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter"}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
PARALLEL_SIZES = ("parallelism_config_tp_size", "parallelism_config_cp_size", "parallelism_config_sp_size")


def _refuse(path: str, key: str, value: Any, why: str) -> None:
    raise ValueError(f"{path}: {key}={value}: {why}")


def _check_ds_file(path: str, ds_file: str) -> None:
    from deepshard.compat.deepspeed.result_keys import refuse_in

    try:
        ds = json.loads(Path(ds_file).read_text())
    except (OSError, ValueError) as err:
        _refuse(path, "deepspeed_config.deepspeed_config_file", ds_file, f"cannot be read as JSON ({err})")
    refuse_in(ds_file, ds)


def check(path: str | Path) -> None:
    """Refuse (ValueError, one line) what deepshard's engine would not honour in an accelerate yaml; a yaml
    that does not choose DeepSpeed is not ours to judge."""
    import yaml

    path = str(path)
    cfg = yaml.safe_load(Path(path).read_text()) or {}
    if str(cfg.get("distributed_type", "")).upper() != "DEEPSPEED":
        return
    if cfg.get("use_cpu"):
        _refuse(path, "use_cpu", cfg["use_cpu"], "accelerate then starts each process as its own world without "
                "DeepSpeed; set use_cpu: false (on a host without GPUs deepshard's engine runs on the CPU)")
    if str(cfg.get("mixed_precision", "no")).lower() == "fp8":
        _refuse(path, "mixed_precision", "fp8", "not supported by deepshard's engine; use bf16, fp16 or no")
    if int(cfg.get("num_machines", 1) or 1) > 1:
        launcher = (cfg.get("deepspeed_config") or {}).get("deepspeed_multinode_launcher", "pdsh")
        if launcher != "standard":
            _refuse(path, "deepspeed_config.deepspeed_multinode_launcher", launcher,
                    "multi-node starts through DeepSpeed's runner are not provided; use standard (torchrun on "
                    "each node) or deepshard --hostfile")
    for key in PARALLEL_SIZES:
        size = (cfg.get("parallelism_config") or {}).get(key, 1)
        if int(size or 1) > 1:
            _refuse(path, f"parallelism_config.{key}", size, "accelerate's tensor/context/sequence parallelism with "
                    "DeepSpeed is not supported by deepshard's engine (ignoring it would change the results)")
    ds = cfg.get("deepspeed_config") or {}
    for key, value in ds.items():
        if key == "deepspeed_moe_layer_cls_names":
            _refuse(path, f"deepspeed_config.{key}", value, "DeepSpeed's ZeRO-3 leaf modules are not provided "
                    "(deepshard gathers whole blocks, no leaf marking needed); remove it")
        if key not in DEEPSPEED_KEYS:
            _refuse(path, f"deepspeed_config.{key}", value,
                    f"not a key deepshard knows accelerate to honour; valid: {', '.join(sorted(DEEPSPEED_KEYS))}")
    if "zero_stage" in ds and ds["zero_stage"] not in (0, 1, 2, 3):
        _refuse(path, "deepspeed_config.zero_stage", ds["zero_stage"], "valid: 0, 1, 2, 3")
    for key in ("offload_optimizer_device", "offload_param_device"):
        if key in ds and str(ds[key]).lower() not in OFFLOAD_DEVICES:
            _refuse(path, f"deepspeed_config.{key}", ds[key], f"valid: {', '.join(OFFLOAD_DEVICES)}")
    if ds.get("deepspeed_config_file"):  # relative to the working directory, as accelerate reads it
        _check_ds_file(path, str(ds["deepspeed_config_file"]))


def patch_launch(module: ModuleType) -> None:
    """Wrap ``accelerate.commands.launch.launch_command``: :func:`check` the yaml before anything starts."""
    original = module.launch_command
    if getattr(original, "_deepshard", False):
        return

    def launch_command(args: Any) -> Any:
        from deepshard.compat.deepspeed_provider import silence

        silence()  # the launcher trains nothing: rank 0's worker names the engine
        path = getattr(args, "config_file", None)
        if path is None:
            from accelerate.commands.config import default_config_file

            path = default_config_file if Path(default_config_file).is_file() else None
        if path is not None:
            try:
                check(path)
            except ValueError as err:
                print(f"error: {err}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None
        return original(args)

    launch_command._deepshard = True  # type: ignore[attr-defined]
    module.launch_command = launch_command


def launch_env(path: str | Path) -> tuple[int, dict[str, str]]:
    """``deepshard --accelerate_config FILE``: the worker count and the ``ACCELERATE_*`` variables that
    ``accelerate launch --config_file FILE`` gives its workers, computed by accelerate's own launcher code
    (so its mapping of ``deepspeed_config`` is used as it is), after :func:`check`.  One node only.
    Reached by the launcher through the ``deepshard.launch`` entry point (launch imports no compat)."""
    import os
    import warnings

    import yaml

    path = str(path)
    if not Path(path).is_file():
        raise ValueError(f"--accelerate_config={path}: no such file")
    cfg = yaml.safe_load(Path(path).read_text()) or {}
    kind = cfg.get("distributed_type")
    if str(kind).upper() != "DEEPSPEED":
        _refuse(path, "distributed_type", kind, "deepshard --accelerate_config runs accelerate's DeepSpeed configs "
                "(distributed_type: DEEPSPEED); start other configs with accelerate launch")
    check(path)
    if int(cfg.get("num_machines", 1) or 1) > 1:
        _refuse(path, "num_machines", cfg["num_machines"], "deepshard --accelerate_config starts one node; for "
                "several, run accelerate launch on each node (deepspeed_multinode_launcher: standard)")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args(["--config_file", path, "--main_process_port", "0", "script.py"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its port checks: deepshard's launcher picks the port
        args, defaults, mp_from_config = _validate_launch_command(args)
        fields = list(defaults.deepspeed_config.keys()) if defaults else []  # as launch_command does
        args.deepspeed_fields_from_accelerate_config = ",".join([*fields, *(["mixed_precision"] if mp_from_config
                                                                            else [])])
        _, env = prepare_deepspeed_cmd_env(args)
    num = args.num_processes
    if not isinstance(num, int) or num < 1:
        _refuse(path, "num_processes", num, "the number of worker processes, a positive number")
    return num, {k: v for k, v in env.items() if k.startswith("ACCELERATE_") and os.environ.get(k) != v}
