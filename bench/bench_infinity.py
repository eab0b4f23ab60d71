"""ZeRO-Infinity headline: inside a memory cgroup of limit L, the largest Llama that trains with
``offload.params=nvme`` + ``offload.device=nvme`` (ZeRO-3, world 1), JSON out.

For each size (largest first) 3 steps run in a fresh process confined to a cgroup v1 memory group
of ``--limit-mib``; the first that finishes is reported with model-state bytes (16 per param) / L
(goal >= 4), its step time, and the read/write bandwidth of the param + optimizer swapping next to a
plain O_DIRECT stream of the same bytes on the same path, measured in the same process right after
(goal >= 0.8).  That run overlaps its I/O with compute on the host's CPUs, so its busy time counts
compute's share of them too; the same size trained again with ``aio.overlap_events=false`` (every
request waited for as issued: I/O alone, as the plain stream is) gives the swap path's own
bandwidth beside it (each figure the median of ``--io-rounds`` such runs).  Then, at the largest
size that still trains in L *without* offload (searched the same way), the step time of
params=nvme + offload=nvme over no offload (goal <= 1.5: I/O hidden by prefetch; each ratio the
median of ``--compare-rounds`` rounds that run them in turn), at ``--compare-batch`` x ``--seq``
tokens per step (the swapped bytes per step are fixed by the model, the compute grows with the
tokens: ``--compare-batch 8`` shows the slowdown at half as many).  At that size every unit fits
the step's buffers (resident: a step reads nothing and writes 12 B/param), so the same run with
``buffer_count=1`` (``streaming``: every unit's state read and written each step) is reported
beside it, and both again over a run without offload under offload's malloc policy
(``same_malloc``: the page faults of a fixed mmap threshold apart from the swapping's cost).
DeepSpeed's own NVMe offload is tried last and, where it cannot run, the reason is said.

    python bench/bench_infinity.py [--limit-mib 384] [--nvme-path /var/tmp] [--sizes 200,150,125,100]
    python bench/bench_infinity.py app [--world 2] [--limit-gib 2.5] [--shapes 450m,358m]   (bench/bench_infinity_app.py)

Needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory.  ``worker`` is the
confined process's entry point (also used by tests/offload/test_param_swap_memory.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.* by package path

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
M = 1_000_000


def cgroup_available() -> bool:
    return os.geteuid() == 0 and (CGROUP_ROOT / "memory.limit_in_bytes").exists() and os.access(CGROUP_ROOT, os.W_OK)


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    """A fresh cgroup v1 memory group with ``limit_bytes`` (no swap here); removed after."""
    path = CGROUP_ROOT / f"deepshard-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        yield path
    finally:
        for _ in range(50):  # the group can be removed once its last task is gone
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def llama_spec(params_m: float, *, dim: int = 256, vocab: int = 512) -> dict:
    """A Llama of about ``params_m`` million parameters: width fixed, depth chosen (units stay small)."""
    ffn = int(dim * 8 / 3) // 16 * 16
    kv = dim // 2
    per_block = 2 * dim * dim + 2 * dim * kv + 3 * dim * ffn + 2 * dim
    root = 2 * vocab * dim + dim
    n_layers = max(1, round((params_m * M - root) / per_block))
    return {"vocab_size": vocab, "dim": dim, "n_layers": n_layers, "n_heads": 4, "n_kv_heads": 2,
            "ffn_hidden": ffn, "max_seq_len": 64}


def run_worker(spec: dict, *, limit_bytes: int | None, timeout_s: float = 900, env: dict | None = None) -> dict:
    """``spec`` trained in a fresh process (inside a memory cgroup when ``limit_bytes``, with ``env``
    added to its environment); its JSON, plus ``peak_bytes`` (the group's max usage) and ``ok``
    (False: killed, e.g. by the OOM killer)."""
    cmd = [sys.executable, os.path.abspath(__file__), "worker", json.dumps(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), **(env or {})}
    with contextlib.ExitStack() as stack:
        group = stack.enter_context(memory_cgroup(limit_bytes)) if limit_bytes else None
        if group is not None:  # join the group before exec: everything the worker maps is charged
            cmd = ["sh", "-c", 'echo $$ > "$1/tasks" && shift && exec "$@"', "sh", str(group), *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        peak = int((group / "memory.max_usage_in_bytes").read_text()) if group is not None else None
    out = {"ok": proc.returncode == 0, "returncode": proc.returncode, "peak_bytes": peak}
    if proc.returncode == 0:
        out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    else:
        out["stderr_tail"] = proc.stderr[-1500:]
    return out


# -- the confined process ---------------------------------------------------------------------------

def _plain_stream(path: str, nbytes: int, aio: dict) -> dict:
    """Write then read ``nbytes`` sequentially with O_DIRECT through the same engine and knobs."""
    from deepshard.offload import AioConfig, AioEngine, SwapFile
    from deepshard.offload.aio import align_up, aligned_empty, as_buffer

    chunk = 64 * 2**20
    nbytes = max(align_up(nbytes), chunk)
    buf = aligned_empty(chunk)
    buf.fill_(7)
    engine = AioEngine(AioConfig(**aio))
    f = SwapFile(path, nbytes)
    out = {}
    try:
        for name, op in (("write", engine.write), ("read", engine.read)):
            t0 = time.perf_counter()
            reqs = [op(f.fd, as_buffer(buf), off) for off in range(0, nbytes - chunk + 1, chunk)]
            for r in reqs:
                r.wait()
            out[f"{name}_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        f.close()
        engine.close()
        os.unlink(path)
    return out


def rss_anon() -> int:
    """This process's anonymous resident bytes (what a memory cgroup cannot reclaim without swap)."""
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(spec: dict) -> dict:
    import torch

    from deepshard.core import (
        EngineConfig,
        OptimConfig,
        PrecisionConfig,
        ZeroConfig,
        init_distributed,
        initialize,
    )
    from deepshard.finetune.models.llama import Llama, LlamaConfig
    from deepshard.offload import AioConfig, OffloadConfig, make_store_factory, param_offload
    from deepshard.offload.pinned import host_buffer_stats

    init_distributed()
    torch.manual_seed(0)
    cfg = EngineConfig(zero=ZeroConfig(stage=3, reshard_after_forward=spec.get("reshard", True)),
                       precision=PrecisionConfig(dtype="fp32"),
                       optim=OptimConfig(lr=1e-3, eps=1e-6, weight_decay=0.1, grad_clip=1.0),
                       ac=spec.get("ac", "full"))  # activations of every block would outgrow a small L
    on = spec["offload"]
    aio = spec.get("aio", {})
    off = OffloadConfig(device="nvme" if on else "none", nvme_path=spec.get("nvme_path") if on else None,
                        params="nvme" if on else "none", buffer_count=spec.get("buffer_count", 3),
                        param_buffer_count=spec.get("param_buffer_count", 4),
                        param_prefetch=spec.get("param_prefetch", 2), aio=AioConfig(**aio),
                        sub_group_size=spec.get("sub_group_size", 2**24), buffer_size=spec.get("sub_group_size", 2**24))
    factory = make_store_factory(off, 0, f"infinity{os.getpid()}")
    swap = getattr(factory, "param_swap", None)
    with torch.device("meta"):
        model = Llama(LlamaConfig(**spec["model"]))
    num_params = sum(p.numel() for p in model.parameters())

    def init(m: torch.nn.Module) -> None:
        m.init_weights(seed=0)

    t0 = time.perf_counter()
    engine = initialize(model, cfg, store_factory=factory, offload_params=param_offload(off, factory),
                        materialize=swap.materializer(init) if swap is not None else init)
    init_s = time.perf_counter() - t0
    anon = {"after_init": rss_anon()}
    mapped: dict[str, int] = {}  # the offload's own host buffers (pinned.pinned_empty), as allocated
    g = torch.Generator().manual_seed(1)
    seq, batch = spec.get("seq", 32), spec.get("batch", 2)
    vocab = spec["model"]["vocab_size"]
    losses, step_s, io, phases = [], [], [], []
    for _ in range(spec.get("steps", 3)):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        if swap is not None:
            swap.reset_io_stats()
        t0 = time.perf_counter()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        t1 = time.perf_counter()
        anon["after_forward"] = max(anon.get("after_forward", 0), rss_anon())
        mapped["after_forward"] = max(mapped.get("after_forward", 0), host_buffer_stats()["mapped_bytes"])
        engine.backward(loss)
        t2 = time.perf_counter()
        anon["after_backward"] = max(anon.get("after_backward", 0), rss_anon())
        mapped["after_backward"] = max(mapped.get("after_backward", 0), host_buffer_stats()["mapped_bytes"])
        engine.step()
        t3 = time.perf_counter()
        anon["after_step"] = max(anon.get("after_step", 0), rss_anon())
        step_s.append(t3 - t0)
        phases.append({"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2})
        losses.append(loss.item())
        if swap is not None:
            io.append(swap.io_stats())
    out = {"num_params": num_params, "model_state_bytes": 16 * num_params, "losses": losses, "step_s": step_s,
           "init_s": init_s, "rss_anon": anon, "buffers_mapped": mapped, "phase_s": phases[-1], "phases_s": phases}
    if swap is not None:
        last = io[-1]
        out["swap"] = {"read_bytes": last["read_bytes"], "write_bytes": last["write_bytes"],
                       "read_GBps": last["read_bytes"] / max(last["read_busy_s"], 1e-9) / 1e9,
                       "write_GBps": last["write_bytes"] / max(last["write_busy_s"], 1e-9) / 1e9,
                       # reads and writes share the engine's threads: both directions over the time any ran
                       "GBps": (last["read_bytes"] + last["write_bytes"]) / max(last["io_busy_s"], 1e-9) / 1e9,
                       "param_reads_prefetched": last["prefetched"], "param_reads_on_demand": last["demand"]}
        engine.store.close()
        out["plain"] = _plain_stream(os.path.join(spec["nvme_path"], f"plain{os.getpid()}.dat"),
                                     max(last["read_bytes"], last["write_bytes"]), aio)
    return out


# -- the search -------------------------------------------------------------------------------------

def search(sizes: list[float], *, offload: bool, limit: int, base: dict) -> tuple[float | None, dict | None, list]:
    tried = []
    for size in sizes:
        spec = {**base, "model": llama_spec(size, dim=base["dim"]), "offload": offload}
        res = run_worker(spec, limit_bytes=limit)
        tried.append({"size_m": size, "ok": res["ok"], "peak_bytes": res["peak_bytes"]})
        if res["ok"]:
            return size, res, tried
    return None, None, tried


def _bandwidths(swap: dict, plain: dict) -> dict:
    """A run's swap read/write rates beside the plain O_DIRECT stream's, and their ratios."""
    return {"swap_read_GBps": swap["read_GBps"], "swap_write_GBps": swap["write_GBps"],
            "plain_read_GBps": plain["read_GBps"], "plain_write_GBps": plain["write_GBps"],
            "read_vs_plain": swap["read_GBps"] / plain["read_GBps"],
            "write_vs_plain": swap["write_GBps"] / plain["write_GBps"]}


def _steady(res: dict) -> float:
    """The fastest step after the first (the first pays one-time costs): this shared host's load
    from other processes varies from step to step and only ever adds time."""
    return min(res["step_s"][1:])


def _slowdown(inf: dict, plain: dict) -> dict:
    """An offloaded run's step time over the run without offload, and the bytes its last step moved
    (a model whose units all fit the step's buffers, ``buffer_count >= units``, reads nothing)."""
    if not inf["ok"]:
        return {"step_s_infinity": None, "slowdown": None, "median_slowdown": None, "losses_equal": False}
    return {"step_s_infinity": _steady(inf), "slowdown": _steady(inf) / _steady(plain),
            "median_slowdown": statistics.median(inf["step_s"][1:]) / statistics.median(plain["step_s"][1:]),
            "read_bytes_per_step": inf["swap"]["read_bytes"], "write_bytes_per_step": inf["swap"]["write_bytes"],
            "losses_equal": inf["losses"] == plain["losses"]}


def compare(first_plain: dict, spec: dict, *, limit: int, rounds: int) -> dict:
    """Without offload, the default offload (resident at this size) and ``streaming``, run in turn
    ``rounds`` times (the first run without offload is the search's): this host's load varies by
    tens of percent from minute to minute, so each ratio is the median of its rounds' own ratios."""
    from deepshard.offload.param_init import MMAP_THRESHOLD

    per_round = []
    for r in range(rounds):
        plain = first_plain if r == 0 else run_worker({**spec, "offload": False}, limit_bytes=limit)
        if not plain["ok"]:
            continue
        inf = run_worker({**spec, "offload": True}, limit_bytes=limit)
        # a single buffer (resident needs one per unit): every step reads and writes every unit's state
        streaming = run_worker({**spec, "offload": True, "buffer_count": 1}, limit_bytes=limit)
        # no offload under the malloc policy the offload runs with (see same_malloc below)
        fixed = run_worker({**spec, "offload": False}, limit_bytes=limit,
                           env={"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)})
        per_round.append({"step_s_no_offload": _steady(plain), "default": _slowdown(inf, plain),
                          "streaming": _slowdown(streaming, plain), "phase_s_no_offload": plain["phase_s"],
                          "phase_s_infinity": inf.get("phase_s"),
                          "same_malloc": {"step_s_no_offload": _steady(fixed) if fixed["ok"] else None,
                                          "default": _slowdown(inf, fixed)["slowdown"] if fixed["ok"] else None,
                                          "streaming": _slowdown(streaming, fixed)["slowdown"] if fixed["ok"] else None}})

    def median_of(mode: str) -> dict:
        runs = [row[mode] for row in per_round]
        ok = [x for x in runs if x["slowdown"] is not None]
        out = {k: v for k, v in runs[-1].items() if k.endswith("_per_step")}
        out.update({"slowdown": statistics.median(x["slowdown"] for x in ok) if ok else None,
                    "median_slowdown": statistics.median(x["median_slowdown"] for x in ok) if ok else None,
                    "slowdown_rounds": [x["slowdown"] for x in runs],
                    "losses_equal": all(x["losses_equal"] for x in runs)})
        return out

    def same_malloc(key: str) -> float | None:
        vals = [row["same_malloc"][key] for row in per_round if row["same_malloc"][key] is not None]
        return statistics.median(vals) if vals else None

    return {"rounds": len(per_round),
            # Offload returns freed host blocks to the OS (param_init.fixed_mmap_threshold: 128 KiB),
            # so on a CPU host every activation is page-faulted in anew; the run without offload keeps
            # glibc's dynamic threshold and reuses them.  The same run without offload under the
            # fixed threshold separates that cost from the swapping's (on a GPU, activations live in
            # the CUDA caching allocator, which the threshold does not touch).
            "same_malloc": {k: same_malloc(k) for k in ("step_s_no_offload", "default", "streaming")},
            "step_s_no_offload": statistics.median(row["step_s_no_offload"] for row in per_round),
            **median_of("default"), "streaming": median_of("streaming"),
            "phase_s_no_offload": per_round[-1]["phase_s_no_offload"],
            "phase_s_infinity": per_round[-1]["phase_s_infinity"]}


def deepspeed_note() -> str:
    """Why DeepSpeed's own NVMe offload is (not) compared here, checked on this host."""
    try:
        import torch

        with contextlib.redirect_stdout(sys.stderr):  # its import logs a warning to stdout: keep the JSON clean
            from deepspeed.ops.op_builder import AsyncIOBuilder

        reasons = []
        if not AsyncIOBuilder().is_compatible(verbose=False):
            reasons.append("its async_io op cannot be built (no libaio headers: the libaio-dev package)")
        if not torch.cuda.is_available():
            reasons.append("no CUDA device (DeepSpeed falls back to its CPU accelerator; its NVMe swappers "
                           "need the async_io op above in any case)")
        if reasons:
            return "DeepSpeed's NVMe offload (offload_param/offload_optimizer device=nvme) not run: " + "; ".join(reasons)
        return "DeepSpeed's NVMe offload could run here: not compared in this version of the bench"
    except Exception as e:  # noqa: BLE001 - any import/build failure is the answer
        return f"DeepSpeed's NVMe offload not run: {type(e).__name__}: {e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit-mib", type=int, default=384)
    ap.add_argument("--dim", type=int, default=384, help="model width (depth follows the size)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--compare-batch", type=int, default=16,
                    help="batch of the with/without offload step-time comparison (more compute per byte swapped)")
    ap.add_argument("--compare-steps", type=int, default=8,
                    help="steps of the comparison runs; their step time is the fastest after the first")
    ap.add_argument("--io-rounds", type=int, default=3,
                    help="runs of the largest size with its I/O alone; bandwidth ratios are their medians")
    ap.add_argument("--compare-rounds", type=int, default=3,
                    help="rounds of the comparison (no offload, default, streaming, no offload's same_malloc "
                         "in turn); ratios are medians")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--sizes", default="200,150,125,100", help="millions of params, largest first")
    ap.add_argument("--plain-sizes", default="5,3,2", help="sizes for the no-offload search")
    args = ap.parse_args()
    if not cgroup_available():
        sys.exit("bench/bench_infinity.py: needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory")
    limit = args.limit_mib * 2**20
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as nvme:
        base = {"nvme_path": nvme, "steps": 3, "dim": args.dim, "seq": args.seq, "batch": args.batch,
                "buffer_count": 2}
        sizes = [float(s) for s in args.sizes.split(",") if s]  # --sizes '': only the comparison
        size, res, tried = search(sizes, offload=True, limit=limit, base=base)
        report: dict = {"limit_bytes": limit, "tried_infinity": tried}
        if res is not None:
            sw, pl = res["swap"], res["plain"]
            report["infinity"] = {
                "size_m": size, "num_params": res["num_params"],
                "model_state_over_limit": res["model_state_bytes"] / limit,
                "peak_over_limit": res["peak_bytes"] / limit, "step_s": res["step_s"][-1], "init_s": res["init_s"],
                **_bandwidths(sw, pl),
                # the same bytes streamed plainly: reads at the plain read rate, writes at the plain write rate
                "both_vs_plain": sw["GBps"] * (sw["read_bytes"] / pl["read_GBps"] + sw["write_bytes"] / pl["write_GBps"])
                / (sw["read_bytes"] + sw["write_bytes"]),
                "param_reads_prefetched": sw["param_reads_prefetched"],
                "param_reads_on_demand": sw["param_reads_on_demand"],
            }
            alone = []  # the disk's rate drifts by tens of percent between runs: median of the rounds
            for _ in range(args.io_rounds):
                serial = run_worker({**base, "model": llama_spec(size, dim=base["dim"]), "offload": True,
                                     "aio": {"overlap_events": False}}, limit_bytes=limit)
                if serial["ok"]:
                    alone.append({**_bandwidths(serial["swap"], serial["plain"]), "step_s": serial["step_s"][-1],
                                  "losses_equal": serial["losses"] == res["losses"]})
            if alone:
                report["infinity"]["io_alone"] = {
                    **{k: statistics.median(x[k] for x in alone) for k in alone[0] if k != "losses_equal"},
                    "rounds": len(alone), "read_vs_plain_rounds": [x["read_vs_plain"] for x in alone],
                    "write_vs_plain_rounds": [x["write_vs_plain"] for x in alone],
                    "losses_equal": all(x["losses_equal"] for x in alone)}
        base = {**base, "batch": args.compare_batch, "steps": args.compare_steps}
        psize, pres, ptried = search([float(s) for s in args.plain_sizes.split(",")], offload=False,
                                     limit=limit, base=base)
        report["tried_no_offload"] = ptried
        if pres is not None:
            report["at_largest_without_offload"] = {
                "size_m": psize, "batch": args.compare_batch, "seq": args.seq,
                "tokens_per_step": args.compare_batch * args.seq,
                **compare(pres, {**base, "model": llama_spec(psize, dim=base["dim"])}, limit=limit,
                          rounds=args.compare_rounds)}
        report["deepspeed"] = deepspeed_note()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))))
    elif len(sys.argv) > 1 and sys.argv[1] == "app":  # through apps/finetune/main.py at Llama-like shapes
        from bench.bench_infinity_app import main as app_main

        app_main(sys.argv[2:])
    else:
        main()
