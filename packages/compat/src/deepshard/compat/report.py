"""``deepshard-report``: the versions, the accelerator, and what is usable here and what is not (DeepSpeed's ``ds_report``).

Three sections: the versions of the stack (torch, transformers, accelerate, TRL, PEFT, Triton and our
packages), the accelerator (CUDA devices or the CPU), and what is usable here and what is not, each
found by trying it rather than by reading flags: a Triton kernel launched and checked against its
reference, an O_DIRECT write and read through offload's own swap file and I/O engine in the temp dir,
the process-group backends, the opt-in ``deepspeed`` provider and a real DeepSpeed.  Nothing is
activated by asking: only the provider's machinery is imported here, never its activating line.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.metadata
import os
import platform
import shutil
import sys
import tempfile

STACK = ("torch", "transformers", "accelerate", "trl", "peft", "triton")
OURS = ("deepshard-kernels", "deepshard-core", "deepshard-offload", "deepshard-pipeline", "deepshard-launch",
        "deepshard-compat", "deepshard-finetune")
PROVIDER = "deepshard.compat.provide_deepspeed"  # the activating import (the machinery: deepspeed_provider)


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line and exit 2, as our other commands' errors are."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> list[tuple[str, str]]:
    """(name, version or 'not installed') for Python, the HF/torch stack and our distributions."""
    return [("python", platform.python_version()), *((d, _version(d)) for d in STACK + OURS)]


def accelerator() -> list[tuple[str, str]]:
    """The CUDA devices torch sees, or the CPU it will train on."""
    import torch

    if not torch.cuda.is_available():
        return [("device", f"cpu ({os.cpu_count()} cores; no CUDA device visible to torch "
                           f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")]
    rows = [("device", f"cuda, {torch.cuda.device_count()} device(s), CUDA {torch.version.cuda}")]
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        rows.append((f"cuda:{i}", f"{p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}"))
    return rows


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def triton_kernels() -> tuple[bool, str]:
    """A small RMSNorm launched with ``backend='triton'`` on the GPU and checked against the reference."""
    try:
        from deepshard.kernels import rms_norm, rms_norm_reference, triton_importable
    except ImportError as err:
        return False, f"deepshard-kernels not importable ({_first_line(err)})"
    import torch

    if not triton_importable():
        return False, "triton is not installed"
    if not torch.cuda.is_available():
        return False, ("no CUDA device: Triton has no CPU backend, the kernels run torch's path "
                       "(TRITON_INTERPRET=1 runs Triton's interpreter, for tests only)")
    try:
        x = torch.randn(5, 96, device="cuda")
        w = torch.randn(96, device="cuda")
        got = rms_norm(x, w, backend="triton")
        torch.testing.assert_close(got, rms_norm_reference(x, w), rtol=1e-5, atol=1e-5)
    except Exception as err:  # a driver, compiler or numerics failure: what the user needs to see
        return False, f"an RMSNorm launch failed: {_first_line(err)}"
    return True, f"an RMSNorm kernel compiled, ran on cuda:{torch.cuda.current_device()} and matched torch"


def nvme_aio(directory: str | None = None) -> tuple[bool, str]:
    """One O_DIRECT write and read of 1 MiB through offload's SwapFile and AioEngine, in ``directory``."""
    try:
        from deepshard.offload import AioConfig, AioEngine, SwapFile, aligned_empty
    except ImportError as err:
        return False, f"deepshard-offload not importable ({_first_line(err)})"
    import logging

    import torch

    where = directory or tempfile.gettempdir()
    scratch = tempfile.mkdtemp(prefix="deepshard-report-", dir=where)
    log = logging.getLogger("deepshard.offload.aio")
    level = log.level
    log.setLevel(logging.ERROR)  # the fallback's warning becomes this line's reason
    engine = None
    try:
        nbytes = 2**20
        swap = SwapFile(os.path.join(scratch, "probe.swp"), nbytes)
        engine = AioEngine(AioConfig(block_size=2**18))
        out, back = aligned_empty(nbytes), aligned_empty(nbytes)
        out.copy_(torch.arange(nbytes, dtype=torch.int64, device=out.device).remainder(251).to(torch.uint8))
        engine.write(swap.fd, memoryview(out.numpy()), 0).wait()
        engine.read(swap.fd, memoryview(back.numpy()), 0).wait()
        direct = swap.direct
        swap.close()
        if not torch.equal(out, back):
            return False, f"{where}: the 1 MiB read back differs from what was written"
        if not direct:
            return False, f"{where}: O_DIRECT refused by the filesystem; swap files fall back to buffered I/O"
        return True, f"{where}: 1 MiB written and read back with O_DIRECT (preadv/pwritev on a thread pool)"
    except OSError as err:
        return False, f"{where}: {_first_line(err)}"
    finally:
        log.setLevel(level)
        if engine is not None:
            engine.close()
        shutil.rmtree(scratch, ignore_errors=True)


def backends() -> list[tuple[str, bool, str]]:
    """gloo and nccl as this torch build has them (nccl needs CUDA devices as well)."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return [("gloo", False, "torch.distributed is not built in"), ("nccl", False, "torch.distributed is not built in")]
    gloo = dist.is_gloo_available()
    nccl = dist.is_nccl_available()
    cuda = torch.cuda.is_available()
    return [("gloo", gloo, "built in (CPU tensors)" if gloo else "not built into this torch"),
            ("nccl", nccl and cuda, ("built in" if nccl else "not built into this torch")
             + ("" if cuda else "; no CUDA device"))]


def provider() -> tuple[bool, str]:
    """Whether the opt-in ``deepspeed`` provider is active in this process, and how it is asked for."""
    from deepshard.compat.deepspeed_provider import ENV as PROVIDER_ENV
    from deepshard.compat.deepspeed_provider import active as provider_active

    asked = os.environ.get(PROVIDER_ENV, "")
    active = provider_active()
    if active:
        return True, f"`import deepspeed` gives deepshard's engine ({PROVIDER_ENV}={asked or 'unset'})"
    return False, (f"not active ({PROVIDER_ENV}={asked or 'unset'}); it is under `deepshard`, with "
                   f"{PROVIDER_ENV}=1, or after `import {PROVIDER}`")


def real_deepspeed() -> tuple[bool, str]:
    """A DeepSpeed installed on sys.path (looked up past the provider's finders)."""
    spec = importlib.machinery.PathFinder.find_spec("deepspeed")
    dists = [d for d in importlib.metadata.distributions(name="deepspeed")
             if isinstance(d, importlib.metadata.PathDistribution)]
    if spec is None and not dists:
        return False, "not installed"
    version = dists[0].version if dists else "no package metadata"
    return True, f"{version} at {spec.origin if spec else '?'}"


def render(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in rows)
    return [f"  {k:<{width}}  {v}" for k, v in rows]


def report() -> str:
    """The whole report, as printed."""
    mark = {True: "yes", False: "no "}
    checks = [("triton kernels", *triton_kernels()), ("NVMe async I/O", *nvme_aio())]
    checks += [(f"{name} backend", ok, why) for name, ok, why in backends()]
    checks += [("deepspeed provider", *provider()), ("real deepspeed", *real_deepspeed())]
    lines = ["versions", *render(versions()), "accelerator", *render(accelerator()), "available"]
    lines += render([(name, f"{mark[ok]}  {why}") for name, ok, why in checks])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the report; exit 0 (a missing capability is reported, not an error)."""
    _Parser(prog="deepshard-report", description=__doc__.splitlines()[0].split(": ", 1)[1]).parse_args(argv)
    print(report(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
