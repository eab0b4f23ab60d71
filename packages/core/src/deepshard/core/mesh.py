"""The process group and the one DeviceMesh (axes ``pp``, ``dp``, ``sp``, ``tp``) everything else hangs on.

``sp`` is Ulysses sequence parallelism (``deepshard.core.sequence_parallel``): its ranks hold the same
parameters and different slices of the same sequences, so ZeRO shards over ``dp x sp`` flattened
(:func:`zero_mesh`, as DeepSpeed's Ulysses does) while the data is split over ``dp`` only.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pp", "dp", "sp", "tp")  # sp next to tp: the two axes that talk inside every layer


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh axes; ``dp=-1`` means "whatever the world size leaves"."""

    pp: int = 1
    dp: int = -1
    tp: int = 1
    sp: int = 1  # Ulysses sequence parallelism: ranks sharing one sequence
    # HSDP (ZeRO-3 only): ZeRO-3 shards within groups of dp_shard ranks and all-reduces across dp_replicate
    # such groups; dp_shard x dp_replicate = dp (dp_shard=-1: dp / dp_replicate)
    dp_shard: int = -1
    dp_replicate: int = 1
    # expert parallelism (MoE): groups of ep consecutive dp ranks split the experts; carved out of dp
    # (ep divides dp), experts are ZeRO-sharded over the dp / ep ranks left (the ``edp`` axis)
    ep: int = 1

    def resolve(self, world_size: int) -> ParallelDims:
        """Fill in ``dp`` and check that the product is the world size (ValueError naming the keys)."""
        for key, value in (("parallel.pp", self.pp), ("parallel.tp", self.tp), ("parallel.sp", self.sp)):
            if value < 1:
                raise ValueError(f"{key}={value}: must be a positive integer")
        if self.dp == 0 or self.dp < -1:
            raise ValueError(f"parallel.dp={self.dp}: must be a positive integer, or -1 to derive it")
        dp = self.dp
        others = self.pp * self.sp * self.tp
        named = f"parallel.pp={self.pp} x parallel.tp={self.tp}" + (f" x parallel.sp={self.sp}" if self.sp > 1 else "")
        if dp == -1:
            if world_size % others:
                raise ValueError(
                    f"{named} = {others} does not divide the world size {world_size}: choose "
                    f"pp*tp{'*sp' if self.sp > 1 else ''} among the divisors of {world_size}"
                )
            dp = world_size // others
        if dp * others != world_size:
            raise ValueError(
                f"parallel.pp={self.pp} x parallel.dp={dp} x parallel.tp={self.tp}"
                + (f" x parallel.sp={self.sp}" if self.sp > 1 else "")
                + f" = {dp * others} != world size {world_size}: the product must equal the number of ranks"
            )
        shard, replicate = self._split_dp(dp)
        self._check_ep(dp, replicate)
        return ParallelDims(pp=self.pp, dp=dp, tp=self.tp, sp=self.sp, dp_shard=shard, dp_replicate=replicate,
                            ep=self.ep)

    def _check_ep(self, dp: int, replicate: int) -> None:
        """``ep`` divides ``dp``; the layouts it is not built with are refused by key."""
        if self.ep < 1:
            raise ValueError(f"parallel.ep={self.ep}: must be a positive integer")
        if self.ep == 1:
            return
        if dp % self.ep:
            raise ValueError(f"parallel.ep={self.ep} does not divide the data-parallel size parallel.dp={dp}: "
                             f"expert parallelism is carved out of dp; choose ep among the divisors of {dp}")
        for key, value in (("parallel.pp", self.pp), ("parallel.tp", self.tp), ("parallel.sp", self.sp),
                           ("parallel.dp_replicate", replicate)):
            if value > 1:
                raise ValueError(f"{key}={value} with parallel.ep={self.ep}: not built (experts split over dp "
                                 f"ranks only); use {key}=1")

    def _split_dp(self, dp: int) -> tuple[int, int]:
        """``(dp_shard, dp_replicate)`` for a data-parallel size ``dp``; their product must be ``dp``."""
        shard, replicate = self.dp_shard, self.dp_replicate
        if replicate < 1:
            raise ValueError(f"parallel.dp_replicate={replicate}: must be a positive integer")
        if shard == 0 or shard < -1:
            raise ValueError(f"parallel.dp_shard={shard}: must be a positive integer, or -1 to derive it")
        if shard == -1:
            if dp % replicate:
                raise ValueError(f"parallel.dp_replicate={replicate} does not divide the data-parallel size {dp}: "
                                 f"choose it among the divisors of {dp}")
            shard = dp // replicate
        if shard * replicate != dp:
            raise ValueError(f"parallel.dp_shard={shard} x parallel.dp_replicate={replicate} = {shard * replicate} != "
                             f"the data-parallel size {dp} (parallel.dp): the product must equal it")
        return shard, replicate


def device_type() -> str:
    """``cuda`` where a GPU exists, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


LOWEST_PORT = 20000  # free_port's draws: from here up to the kernel's ephemeral range


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections' local ports)."""
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port nothing is bound to now, for a store another process listens on a moment later.  Drawn
    below the ephemeral range: the kernel's own pick (bind to port 0) comes from that range, where an
    outgoing connection of any process beside us (a TCPStore client of another job) can take it before
    our store listens (EADDRINUSE at the rendezvous, seen with two test workers sharing a host)."""
    import random

    draw = random.Random()  # seeded from the OS: callers seed the global generator
    low = _ephemeral_low()
    for _ in range(64 if low > LOWEST_PORT + 1024 else 0):
        port = draw.randrange(LOWEST_PORT, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a host whose ephemeral range starts low: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 600.0) -> tuple[int, int]:
    """Join (or start) the default process group: nccl on CUDA, gloo on CPU.

    Without torchrun's environment this starts a 1-rank group, so one code path serves 1 or N ranks.
    Returns ``(rank, world_size)``.
    """
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        backend = "nccl" if device_type() == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(cuda_index(os.environ, torch.cuda.device_count()))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def build_mesh(dims: ParallelDims) -> DeviceMesh:
    """One mesh with all four named axes (size-1 axes included), so sub-meshes are ``mesh["dp"]`` etc."""
    world = dist.get_world_size()
    dims = dims.resolve(world)
    if dims.ep > 1:
        # dp split into (edp, ep), ep inner (an expert group is ep neighbouring ranks), flattened back into
        # ``dp`` for the dense params, the data and the loss counts; experts shard over ``edp``
        mesh = init_device_mesh(device_type(), (dims.pp, dims.dp // dims.ep, dims.ep, dims.sp, dims.tp),
                                mesh_dim_names=("pp", "edp", "ep", "sp", "tp"))
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
        mesh["edp", "ep"]._flatten("dp")
        return mesh
    if dims.dp_replicate == 1:
        return init_device_mesh(device_type(), (dims.pp, dims.dp, dims.sp, dims.tp), mesh_dim_names=AXES)
    # HSDP: dp split into (dp_replicate, dp_shard), flattened back into ``dp`` for everything else
    # (data loading, loss counts, checkpoints); ZeRO-3 shards over the two (zero.hsdp.hsdp_mesh)
    mesh = init_device_mesh(device_type(), (dims.pp, dims.dp_replicate, dims.dp_shard, dims.sp, dims.tp),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "sp", "tp"))
    # torch 2.13 still slices a flattened dim from the root (``mesh["dp"]``) and warns it may not forever
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


def axis_size(mesh: DeviceMesh, axis: str) -> int:
    """The size of ``axis``, 1 where the mesh lacks it (meshes built by hand name only what they use)."""
    return mesh[axis].size() if axis in (mesh.mesh_dim_names or ()) else 1


def expert_meshes(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh] | None:
    """``(ep, edp)`` sub-meshes of an expert-parallel mesh (``parallel.ep > 1``), None otherwise: the
    ranks that split the experts, and the dp ranks left after ep that ZeRO shards each expert over."""
    if axis_size(mesh, "ep") == 1:
        return None
    return mesh["ep"], mesh["edp"]


def zero_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh ZeRO shards over and gradients are averaged over: ``dp``, or ``dp x sp`` flattened
    when sequence parallelism is on (the sp ranks hold the same parameters, so they share the shards;
    DeepSpeed's Ulysses does the same).  The loss's valid-token count is summed over it too."""
    if axis_size(mesh, "sp") == 1:
        return mesh["dp"]
    return mesh["dp", "sp"]._flatten("dp_sp")


def cuda_index(env: Mapping[str, str], device_count: int) -> int:
    """The GPU this process takes, among the ``device_count`` it can see.

    torchrun sets ``LOCAL_RANK`` (SLURM's srun sets ``SLURM_LOCALID``) counting every process on the
    node, but a scheduler may show each process only its own GPU(s) (``--gpus-per-task``, a
    ``CUDA_VISIBLE_DEVICES`` per task): local rank 3 then sees one GPU, index 0.  The local rank
    modulo the visible count is right in both layouts.
    """
    if device_count < 1:
        raise ValueError(f"no CUDA device visible (CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r})")
    local_rank = env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    if not local_rank.isdigit():
        raise ValueError(f"LOCAL_RANK={local_rank!r}: must be a non-negative integer")
    return int(local_rank) % device_count


_override: torch.device | None = None


@contextlib.contextmanager
def use_local_device(device: torch.device | str) -> Iterator[torch.device]:
    """Within the block, ``local_device()`` is ``device``: tests run the collective paths with a
    compute device that is not the host (``meta``) to show no tensor there assumes the CPU."""
    global _override
    previous, _override = _override, torch.device(device)
    try:
        yield _override
    finally:
        _override = previous


def local_device() -> torch.device:
    """The device this rank computes on: every tensor handed to a collective lives here."""
    if _override is not None:
        return _override
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
