"""accelerate's DeepSpeed state on a host without an accelerator (for the provided ``deepspeed``).

accelerate 1.16's ``PartialState._prepare_backend`` picks no backend for a launched worker on a CPU-only
host unless ``cpu=True``, and ``cpu=True`` turns DeepSpeed off; its state then reports one process
while the engine runs at the launcher's world size (the ds_config's ``train_batch_size`` comes out
wrong).  Real DeepSpeed on CPU meets the same (bench/record_hf_trainer_ds.py nudges it the same way).
Under the provider, a launched worker (``LOCAL_RANK`` set) with ``ACCELERATE_USE_DEEPSPEED`` and no
backend chosen gets gloo.  The patch is applied when ``accelerate.state`` is imported, so nothing is
imported early; with a GPU, or outside the provider, accelerate is untouched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any


def _patch_launch(module: ModuleType) -> None:
    from deepshard.compat.accelerate_config import patch_launch

    patch_launch(module)


def _patch_trainer_ds_config(module: ModuleType) -> None:
    """``TrainingArguments(deepspeed=...)``: the ds_config's result-changing keys refused when transformers reads
    it (``HfTrainerDeepSpeedConfig``, in ``TrainingArguments.__post_init__``), naming the file."""
    cls = module.HfTrainerDeepSpeedConfig
    original = cls.__init__
    if getattr(original, "_deepshard", False):
        return

    def __init__(self: Any, config_file_or_dict: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        from deepshard.compat.deepspeed.result_keys import check_trainer_ds_config

        check_trainer_ds_config(config_file_or_dict)
        original(self, config_file_or_dict, *args, **kwargs)

    __init__._deepshard = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def _patch_peft(module: ModuleType) -> None:
    from deepshard.compat.peft_zero3 import patch_adapter_device

    patch_adapter_device(module)


# the HF stack's modules patched once executed: accelerate's CPU backend nudge, the yaml check of `accelerate
# launch`, the ds_config check of TrainingArguments(deepspeed=...), PEFT's adapters under zero.Init
WATCHED = {"accelerate.state": lambda module: _patch(module), "accelerate.commands.launch": _patch_launch,
           "transformers.integrations.deepspeed": _patch_trainer_ds_config, "peft.tuners.tuners_utils": _patch_peft}


def _patch(state: ModuleType) -> None:
    import torch

    cls = state.PartialState
    original = cls._prepare_backend
    if getattr(original, "_deepshard", False):
        return

    def prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None) -> Any:
        chosen, kind = original(self, cpu, sagemaker_dp, backend)
        if (chosen is None and not cpu and not torch.cuda.is_available()
                and int(os.environ.get("LOCAL_RANK", -1)) >= 0
                and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"):
            from accelerate.utils import DistributedType

            return "gloo", DistributedType.MULTI_CPU
        return chosen, kind

    prepare_backend._deepshard = True  # type: ignore[attr-defined]
    cls._prepare_backend = prepare_backend


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Any) -> None:
        self.inner = inner
        self.patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the WATCHED modules with the other finders, and patches each once executed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, WATCHED[fullname])
                return spec
        return None


def install() -> None:
    for name, patch in WATCHED.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
