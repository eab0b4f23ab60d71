"""No module of ours shadows an installed package (issue 46).

transformers 5.25 imports the ``kernels`` distribution; a ``bench/kernels.py`` on ``sys.path`` (the tests
put it there, and the forkserver inherits the launcher's ``sys.path``) made every HF test fail with
``cannot import name 'CUDAProperties' from 'kernels'``.  This lists every directory we put on
``sys.path`` (pytest's rootdir for the ``tests`` package, each script's own folder when run by path, the
app's folder, and whatever of the repository the running interpreter, and so a forkserver it starts, has
on its path) and fails on a top-level module name that an installed distribution or the standard
library also provides.  bench scripts carry a prefix (``bench_``, ``record_``, ``make_``), so that running
one by path, which puts ``bench/`` first on ``sys.path``, is safe also for names nothing installed has yet.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The one deliberate exception has its place here: an opt-in provider of the ``deepspeed`` name for
# transformers/accelerate/TRL (issue 41), active only when asked for and never over a real DeepSpeed.
ALLOWED: dict[str, str] = {"deepspeed": "deepshard.compat.provide_deepspeed: a meta-path finder, active only "
                                        "under `deepshard`, DEEPSHARD_DEEPSPEED=1 or its import line"}

OURS = {"deepshard"}  # our own distributions' namespace, installed editable from packages/*/src
BENCH_PREFIXES = ("bench_", "record_", "make_")


def _path_dirs() -> set[Path]:
    """Every directory of this repository that some way of running our code puts on ``sys.path``."""
    dirs = {ROOT, ROOT / "bench", ROOT / "apps" / "finetune"}
    dirs |= {p.parent for p in (ROOT / "tests").rglob("*.py")  # a script run by path: its own folder
             if re.search(r'^if __name__ == "__main__"', p.read_text(), re.M)}
    here = {Path(p).resolve() for p in sys.path if p}  # pytest's, and so the forkserver's, inherited path
    dirs |= {p for p in here if p == ROOT or ROOT in p.parents}
    installed = ("site-packages", "dist-packages", "src")  # a venv inside the checkout; src: our packages' roots
    return {d for d in dirs if d.is_dir() and not set(d.relative_to(ROOT).parts) & set(installed)}


def _top_level_names(folder: Path) -> set[str]:
    """What ``import NAME`` finds in ``folder``: modules and regular packages (a folder without
    ``__init__.py`` is a namespace portion, which never hides a regular package found later)."""
    names = {p.stem for p in folder.glob("*.py")} | {p.stem for p in folder.glob("*.so")}
    names |= {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return names - {"__init__", "conftest", "__main__"}


def _provided_elsewhere() -> dict[str, str]:
    """Top-level import names of installed distributions and the standard library -> who provides them."""
    owners = {name: ", ".join(sorted(set(dists)))
              for name, dists in importlib.metadata.packages_distributions().items() if name not in OURS}
    owners.update({name: "the standard library" for name in sys.stdlib_module_names})
    return owners


def test_no_module_on_our_paths_shadows_an_installed_one() -> None:
    owners = _provided_elsewhere()
    assert "torch" in owners and "os" in owners  # the census itself sees installed and standard modules
    clashes = sorted(f"{(folder / name).relative_to(ROOT)}: also '{name}' of {owners[name]}"
                     for folder in _path_dirs() for name in _top_level_names(folder)
                     if name in owners and name not in ALLOWED)
    assert not clashes, "our modules shadow installed ones:\n" + "\n".join(clashes)


def test_bench_scripts_have_names_safe_to_run_by_path() -> None:
    unsafe = sorted(name for name in _top_level_names(ROOT / "bench") if not name.startswith(BENCH_PREFIXES))
    assert not unsafe, f"bench/ modules without a {BENCH_PREFIXES} prefix: {unsafe}"
