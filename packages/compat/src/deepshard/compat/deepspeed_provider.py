"""The opt-in provider of the name ``deepspeed``: transformers, accelerate and TRL find deepshard's engine.

Importing this module changes nothing; :func:`activate` (what ``import deepshard.compat.provide_deepspeed``
does) installs the finders.

transformers and accelerate take the DeepSpeed path only when ``import deepspeed`` works *and*
``importlib.metadata`` knows a ``deepspeed`` distribution.  This module serves both: a meta-path
finder that answers ``deepspeed`` and ``deepspeed.X`` with ``deepshard.compat.deepspeed`` (and
``.X``), and a metadata finder reporting the distribution ``deepspeed`` at :data:`VERSION`.

It is active only when asked for, never by surprise (a real DeepSpeed installed beside us stays
what ``import deepspeed`` gives unless one of these is used):

- the ``deepshard`` launcher sets ``DEEPSHARD_DEEPSPEED=1`` in its workers (``DEEPSHARD_DEEPSPEED=0``
  before ``deepshard`` turns that off), and the ``deepshard_deepspeed.pth`` our package installs
  imports this module at interpreter start when the variable is set (unset: one dict lookup);
- the same variable for a plain start: ``DEEPSHARD_DEEPSPEED=1 torchrun --nproc_per_node 2 train.py``;
- or one line at the top of the script: ``import deepshard.compat.provide_deepspeed``.

Rank 0 prints one line naming the engine when ``deepspeed`` is first imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

ENV = "DEEPSHARD_DEEPSPEED"
VERSION = "0.19.8+deepshard"  # DeepSpeed's release whose API and behaviour the front door follows
TARGET = "deepshard.compat.deepspeed"
# deepspeed.* modules the HF stack imports that live elsewhere in our front door (DeepSpeed's module
# layout, where ours differs): name -> our module
EXTRA = {"deepspeed.checkpoint.utils": "deepshard.compat.deepspeed.runtime.hf_shims",
         "deepspeed.runtime.lr_schedules": "deepshard.compat.deepspeed.runtime.hf_shims",
         "deepspeed.runtime.engine": "deepshard.compat.deepspeed.engine",
         "deepspeed.utils.groups": "deepshard.compat.deepspeed.groups"}
_announced = False


def requested(environ: dict[str, str] | None = None) -> bool:
    """Whether the environment asks for the provider (``DEEPSHARD_DEEPSPEED`` set, not 0/false/empty)."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def _ours(fullname: str) -> str | None:
    if fullname in EXTRA:
        return EXTRA[fullname]
    if fullname == "deepspeed" or fullname.startswith("deepspeed."):
        return TARGET + fullname[len("deepspeed"):]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads ``deepspeed.X`` as the already-importable ``deepshard.compat.deepspeed.X`` (one module
    object under both names, so ``isinstance`` and module state agree)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.original: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.original = module.__spec__
        if spec.name == "deepspeed":
            _prepare_modules()
            _announce()
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Already executed under its own name; importlib set ``__spec__`` to the alias's: put ours back."""
        if self.original is not None:
            module.__spec__ = self.original


class DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """``import deepspeed[.X]`` -> ``deepshard.compat.deepspeed[.X]``; names we do not have are not found."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        ours = _ours(fullname)
        if ours is None:
            return None
        try:
            found = importlib.util.find_spec(ours)
        except ModuleNotFoundError:
            return None
        if found is None:
            return None
        is_package = found.submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(ours), is_package=is_package)

    def find_distributions(self, context: Any = None) -> list:
        name = getattr(context, "name", None)
        if name is None or _normalized(name) == "deepspeed":
            return [ProvidedDistribution()]
        return []


def _normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


class ProvidedDistribution(importlib.metadata.Distribution):
    """``importlib.metadata``'s view of the provided ``deepspeed``: its name and version, no files."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {VERSION}\n"
                    f"Summary: deepshard's DeepSpeed-compatible engine ({TARGET})\n")
        return None

    def locate_file(self, path: Any) -> Any:
        return None


def _announce() -> None:
    """One line on rank 0 naming the engine behind ``deepspeed``."""
    global _announced
    if _announced:
        return
    _announced = True
    if os.environ.get("RANK", "0") == "0":
        print(f"deepspeed: deepshard {VERSION} engine ({TARGET})", file=sys.stderr, flush=True)


def silence() -> None:
    """No line from this process: it starts workers and trains nothing (``accelerate launch`` imports
    ``deepspeed`` to launch; its rank-0 worker prints the line)."""
    global _announced
    _announced = True


def _prepare_modules() -> None:
    """What DeepSpeed's package layout offers as attributes (``deepspeed.runtime.lr_schedules``,
    ``deepspeed.checkpoint.utils``) and where the HF stack reads it, set on our modules."""
    runtime = importlib.import_module(TARGET + ".runtime")
    shims = importlib.import_module(TARGET + ".runtime.hf_shims")
    runtime.lr_schedules = shims
    checkpoint = importlib.import_module(TARGET + ".checkpoint")
    if not hasattr(checkpoint, "__path__"):
        checkpoint.__path__ = []  # lets ``deepspeed.checkpoint.utils`` be imported (EXTRA maps it)
    checkpoint.utils = shims
    utils = importlib.import_module(TARGET + ".utils")
    if not hasattr(utils, "__path__"):
        utils.__path__ = []  # lets ``deepspeed.utils.groups`` be imported (EXTRA maps it)


def activate() -> None:
    """Install the finders (idempotent).  A ``deepspeed`` imported before this keeps being what it was."""
    if any(isinstance(f, DeepSpeedFinder) for f in sys.meta_path):
        return
    existing = sys.modules.get("deepspeed")
    if existing is not None and not getattr(existing, "__name__", "").startswith(TARGET):
        raise ValueError(f"{ENV}: the real deepspeed ({getattr(existing, '__file__', '?')}) was imported before "
                         f"deepshard's provider; import deepshard.compat.provide_deepspeed first")
    sys.meta_path.insert(0, DeepSpeedFinder())
    # transformers >= 5 kernelizes every from_pretrained model with hub kernels (its use_kernels default);
    # under ZeRO-3 our zero.Init leaves parameters on the meta device until initialize, which `kernels`
    # refuses ("Unsupported device type 'meta'"): off unless the user set the variable
    os.environ.setdefault("USE_HUB_KERNELS", "NO")
    from . import hf_cpu

    hf_cpu.install()


def active() -> bool:
    """Whether the provider is installed in this interpreter."""
    return any(isinstance(f, DeepSpeedFinder) for f in sys.meta_path)


def serving() -> bool:
    """Whether ``import deepspeed`` has given deepshard's engine in this process: the HF stack's path (a
    script that imports ``deepshard.compat.deepspeed`` itself is not on it, even under the provider)."""
    ours = sys.modules.get(TARGET)
    return active() and ours is not None and sys.modules.get("deepspeed") is ours
