"""design.md's package boundaries, enforced with import-linter (contracts in pyproject.toml): kernels
imports no other deepshard package; core imports neither offload, pipeline, launch, compat nor the
app; offload and pipeline use core's public API only; nothing (compat and launch included) imports
the app; launch imports no training package; Hydra/OmegaConf only in the app.  And offload's
modules import each other without a cycle (function-level and TYPE_CHECKING imports included)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*sorted((ROOT / "packages").glob("*/src")), ROOT / "apps/finetune/src"]
CONTRACTS = 6


def _lint(env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    return subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=env)


def test_import_contracts_are_kept():
    proc = _lint()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{CONTRACTS} kept, 0 broken" in proc.stdout, proc.stdout[-2000:]


def test_a_planted_violation_breaks_its_contract(tmp_path):
    """A copy of the sources where compat imports the app and core imports launch: both are caught."""
    roots = []
    for i, src in enumerate(SOURCES):
        dst = tmp_path / f"src{i}"
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
        roots.append(str(dst))
    planted = {"deepshard/compat/planted.py": "from deepshard.finetune import faults  # noqa\n",
               "deepshard/core/planted.py": "import deepshard.launch.heartbeat  # noqa\n"}
    for rel, text in planted.items():
        target = next(Path(r) / rel for r in roots if (Path(r) / rel).parent.is_dir())
        target.write_text(text)
    proc = _lint({**os.environ, "PYTHONPATH": os.pathsep.join(roots)})
    assert proc.returncode != 0, proc.stdout[-3000:]
    out = proc.stdout
    assert f"{CONTRACTS - 2} kept, 2 broken" in out, out[-3000:]
    assert "deepshard.compat.planted -> deepshard.finetune" in out and "deepshard.core.planted -> deepshard.launch" in out


def import_cycles(package: str) -> list[list[str]]:
    """Each group of ``package``'s modules that import one another in a circle (a strongly connected
    component of grimp's graph, which holds lazy and TYPE_CHECKING imports too), sorted."""
    graph = grimp.build_graph(package, cache_dir=None)
    mods = sorted(m for m in graph.modules if m == package or m.startswith(package + "."))
    edges = {m: sorted(set(graph.find_modules_directly_imported_by(m)) & set(mods) - {m}) for m in mods}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(group) > 1:
                out.append(sorted(group))

    for m in mods:
        if m not in index:
            visit(m)
    return sorted(out)


def test_offload_has_no_import_cycle():
    cycles = import_cycles("deepshard.offload")
    assert not cycles, "offload modules import each other in a circle: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_app_has_no_import_cycle():
    """The app's modules too (``config.layout_checks`` once imported ``config.settings`` for a type)."""
    cycles = import_cycles("deepshard.finetune")
    assert not cycles, "app modules import each other in a circle: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_a_lazy_import_cycle_is_caught(tmp_path, monkeypatch):
    """A circle closed by a function-level import (the old offload's trick) still counts."""
    pkg = tmp_path / "planted_cycle"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from planted_cycle import b  # noqa\n")
    (pkg / "b.py").write_text("def f():\n    from planted_cycle import a  # noqa\n")
    (pkg / "c.py").write_text("from planted_cycle import a  # noqa\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("planted_cycle") == [["planted_cycle.a", "planted_cycle.b"]]


# kernels may read DTensor placements (torch.distributed.tensor) but never communicate: whatever runs a
# collective belongs in core (import-linter cannot forbid torch.distributed while allowing its tensor part)
KERNELS_MAY_USE = {"torch.distributed.tensor", "torch.distributed.device_mesh"}
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
               "broadcast", "broadcast_object_list", "send", "recv", "isend", "irecv", "barrier",
               "batch_isend_irecv"}


def collective_uses(source: str) -> list[str]:
    """Where ``source`` imports torch.distributed beyond its tensor/mesh modules, or calls a collective."""
    import ast

    def allowed(module: str) -> bool:
        return not module.startswith("torch.distributed") or any(
            module == ok or module.startswith(ok + ".") for ok in KERNELS_MAY_USE)

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if not allowed(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] if node.module != "torch.distributed" else [
                f"torch.distributed.{a.name}" for a in node.names]
            found += [f"{node.lineno}: from {node.module} import ..." for n in names if not allowed(n)]
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in COLLECTIVES:
                found.append(f"{node.lineno}: {name}(...)")
    return found


def test_kernels_run_no_collectives():
    src = ROOT / "packages/kernels/src/deepshard/kernels"
    bad = {str(p.relative_to(src)): u for p in sorted(src.rglob("*.py")) if (u := collective_uses(p.read_text()))}
    assert not bad, f"deepshard.kernels is torch and Triton only; move collectives to core: {bad}"


def test_a_planted_collective_is_caught():
    planted = "import torch.distributed as dist\nfrom torch.distributed.tensor import DTensor\n\n" \
              "def f(x, g):\n    dist.all_gather_single(x, x, group=g)\n"
    assert collective_uses(planted) == ["1: import torch.distributed", "5: all_gather_single(...)"]
    assert collective_uses("from torch.distributed.tensor import Shard\nx.gather(1, i)\n") == []
