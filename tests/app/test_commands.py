"""The commands users type (issue 41): ``deepshard-export``, ``-estimate``, ``-convert`` and ``-report``.

Each is run as the installed console script (found on PATH or beside this interpreter, as a user's
shell finds it after the editable install): ``--help`` exits 0 and says what the command does, a bad
argument is one line and exit 2, and the report's lines agree with what this test finds by itself
(package metadata, torch's own flags, its own O_DIRECT probe, the site-packages folders).
"""

from __future__ import annotations

import errno
import importlib.metadata
import importlib.util
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# a fresh interpreter per command (~3 s each): the full suite; the inner loop keeps test_config's CLI line
pytestmark = pytest.mark.slow

HELP_NAMES = {  # command -> words its --help must hold: what the command does
    "deepshard-export": ["HF model folder", "--adapter", "--merge"],
    "deepshard-estimate": ["per-rank memory", "--fit-memory"],
    "deepshard-convert": ["from-deepspeed", "to-deepspeed", "DeepSpeed"],
    "deepshard-report": ["versions", "accelerator", "ds_report"],
}


def command(name: str) -> str:
    """The console script's path, as a shell after ``pip install -e`` finds it."""
    path = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert path, f"{name} is not installed: pip install -e packages/compat -e apps/finetune (or sh setup.sh)"
    return path


def run(name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "DEEPSHARD_DEEPSPEED"}
    return subprocess.run([command(name), *args], capture_output=True, text=True, timeout=180,
                          env={**base, **(env or {})}, cwd=tempfile.gettempdir())


@pytest.mark.parametrize("name", sorted(HELP_NAMES))
def test_help_exits_0_and_says_what_the_command_does(name):
    proc = run(name, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for words in HELP_NAMES[name]:
        assert words in proc.stdout, (words, proc.stdout)
    # --help answers at once: no torch imported (python -X importtime names every module it imported)
    imported = subprocess.run([sys.executable, "-X", "importtime", command(name), "--help"], capture_output=True,
                              text=True, timeout=60).stderr
    assert not re.search(r"\|\s+torch$", imported, re.MULTILINE), name


@pytest.mark.parametrize("name, args, named", [
    ("deepshard-export", ["--bogus", "ckpt", "out"], "--bogus"),
    ("deepshard-estimate", ["train.max_stepz=3"], "train.max_stepz=3"),
    ("deepshard-convert", ["sideways"], "sideways"),
    ("deepshard-convert", ["to-deepspeed", "ckpt"], "out_dir"),
    ("deepshard-report", ["--bogus"], "--bogus"),
])
def test_a_bad_argument_is_one_line_and_exit_2(name, args, named):
    proc = run(name, *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and named in lines[0], proc.stderr
    assert proc.stdout == ""


def o_direct_works(directory: str) -> bool:
    """This test's own probe: one page written and read back through an O_DIRECT descriptor."""
    fd, path = tempfile.mkstemp(dir=directory)
    os.close(fd)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError as err:
        os.unlink(path)
        if err.errno == errno.EINVAL:
            return False
        raise
    try:
        page, back = mmap.mmap(-1, 4096), mmap.mmap(-1, 4096)  # anonymous maps are page-aligned
        page.write(bytes(range(256)) * 16)
        os.pwritev(fd, [page], 0)
        os.preadv(fd, [back], 0)
        return bytes(back) == bytes(page)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        return False
    finally:
        os.close(fd)
        os.unlink(path)


def answer(out: str, what: str) -> str:
    """``yes`` or ``no`` from the report's line for ``what``."""
    m = re.search(rf"^  {re.escape(what)} +(yes|no) ", out, re.M)
    assert m, (what, out)
    return m.group(1)


def test_the_report_prints_each_section_as_this_host_has_it():
    proc = run("deepshard-report")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert [line for line in out.splitlines() if not line.startswith(" ")] == ["versions", "accelerator", "available"]
    for dist in ("torch", "transformers", "accelerate", "trl", "peft", "triton", "deepshard-core", "deepshard-compat",
                 "deepshard-finetune"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        assert re.search(rf"^  {re.escape(dist)} +{re.escape(version)}$", out, re.M), (dist, version, out)
    cuda = torch.cuda.is_available()
    assert re.search(rf"^  device +{'cuda' if cuda else 'cpu'}", out, re.M), out
    triton = importlib.util.find_spec("triton") is not None
    assert answer(out, "triton kernels") == ("yes" if cuda and triton else "no")
    assert answer(out, "NVMe async I/O") == ("yes" if o_direct_works(tempfile.gettempdir()) else "no")
    assert answer(out, "gloo backend") == ("yes" if torch.distributed.is_gloo_available() else "no")
    assert answer(out, "nccl backend") == ("yes" if cuda and torch.distributed.is_nccl_available() else "no")
    assert answer(out, "deepspeed provider") == "no"  # not asked for: DEEPSHARD_DEEPSPEED unset
    installed = any((Path(p) / "deepspeed").is_dir() for p in sys.path if p and "site-packages" in p)
    assert answer(out, "real deepspeed") == ("yes" if installed else "no")


def test_the_report_says_the_provider_is_active_when_asked_for():
    proc = run("deepshard-report", env={"DEEPSHARD_DEEPSPEED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert answer(proc.stdout, "deepspeed provider") == "yes"


def test_exports_dtype_choices_are_the_dtypes_hf_export_writes():
    from deepshard.finetune.tools.export import DTYPE_NAMES
    from deepshard.finetune.tools.hf_export import DTYPES

    assert sorted(DTYPE_NAMES) == sorted(DTYPES)
