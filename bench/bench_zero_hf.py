"""``bench/bench_zero.py --hf``: our ZeRO stages on HF ``LlamaForCausalLM`` through the public library API
(``deepshard.core.initialize``, the way a user with their own loop calls it), beside DDP (torch fused
AdamW), raw FSDP2 (``fully_shard`` per decoder layer + root, torch fused AdamW) and DeepSpeed where
installed: the same weights, the same batches, the same AdamW hyper-parameters and global-norm clip.

One launch runs every engine in each of ``rounds`` interleaved rounds (odd rounds in reverse order,
so a drift of the machine's load evens out; DeepSpeed's engines last in every round, as a dropped
DeepSpeed engine keeps memory alive); each figure is the median over rounds of the engine's median
step time, and each ratio also the median over rounds of that round's ratio (``*_paired``).  Per
engine and round, in the same processes:

- step time: forward + backward + optimizer step, warm-up steps excluded, the slower rank's;
- peak RSS growth: the process's VmHWM, reset (``/proc/self/clear_refs``) after the previous engine
  is freed and its memory handed back (``malloc_trim``), minus the RSS at that moment: what building
  and training the engine added on top of the interpreter, torch, transformers and DeepSpeed (an
  absolute peak in a shared process would carry the previous engines' heap fragmentation);
- census: every distinct tensor storage reachable from Python after the last optimizer step, minus
  those alive before the model was built (the batches, the imports' own tensors): the model state and
  every buffer the engine keeps between steps; beside ours, ``engine.memory()``'s ``live_total`` and
  the ZeRO formula (``deepshard.core.memory.expected_bytes``) for the same stage;
- losses: the global mean loss of every step (all engines must equal DDP's).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

SEQ, MBS = 128, 1
LR, BETAS, EPS, CLIP = 1e-4, (0.9, 0.95), 1e-8, 1.0
STAGE_OF = {"ddp": 0, "fsdp2": 3, "ours1": 1, "ours2": 2, "ours3": 3, "ds1": 1, "ds2": 2, "ds3": 3,
            "ours2cpu": 2, "ds2cpu": 2}  # *cpu: optimizer state and step on the host (ZeRO-Offload)


def parse_engine(name: str) -> tuple[str, int, dict]:
    """``ours2+reduce_bucket_size=2000000+overlap_allgather=true`` -> ("ours2", 2, {...}): an engine and
    ZeroConfig overrides of its own (bucket sweeps in one launch)."""
    base, *pairs = name.split("+")
    if base not in STAGE_OF:
        raise ValueError(f"--engines: {base!r} is not one of {sorted(STAGE_OF)}")
    overrides = {k: json.loads(v.lower()) for k, v in (p.split("=", 1) for p in pairs)}
    return base, STAGE_OF[base], overrides


def hf_config(dim: int, layers: int, vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=int(dim * 2.75) // 64 * 64,
                       num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                       max_position_embeddings=SEQ, tie_word_embeddings=False, attn_implementation="sdpa")


def hf_model(cfg) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)  # the same weights on every rank and for every engine
    return LlamaForCausalLM(cfg).float()


def batches(rank: int, n: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, vocab, (MBS, SEQ), generator=g) for _ in range(n)]


_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes(ptr: int, nbytes: int) -> int:
    """Bytes of ``[ptr, ptr + nbytes)`` in resident pages (mincore): an allocated buffer never written
    (DeepSpeed's stage-3 ``empty`` buckets) costs address space, not memory."""
    if nbytes < 1 << 20:
        return nbytes
    start = ptr - ptr % _PAGE
    pages = -(-(ptr + nbytes - start) // _PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * _PAGE), vec) != 0:
        return nbytes
    return min(nbytes, sum(v & 1 for v in vec) * _PAGE)


def census() -> dict[int, int]:
    """data_ptr -> resident bytes of every tensor storage reachable from Python (a DTensor: its local
    tensor)."""
    from torch.distributed.tensor import DTensor

    gc.collect()
    out = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
        except Exception:  # noqa: BLE001 - exotic proxies in gc's list
            continue
        t = obj._local_tensor if isinstance(obj, DTensor) else obj
        storage = t.untyped_storage()
        if t.device.type == "cpu" and storage.nbytes():
            out[storage.data_ptr()] = resident_bytes(storage.data_ptr(), storage.nbytes())
        elif t.device.type not in ("meta", "cpu") and storage.nbytes():
            out[storage.data_ptr()] = storage.nbytes()
    return out


def _release_and_reset_peak() -> None:
    gc.collect()
    _LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(key))
    return int(line.split()[1]) / 1024


BACKWARD_END = [0.0]  # set by each engine's step between backward and the optimizer step


# --- the engines: each returns (step(tokens) -> loss tensor, memory() -> dict or None) -------------

def _loss(model, tokens):
    return model(input_ids=tokens, labels=tokens).loss


def _torch_adamw_steps(wrapped, model):
    """The torch baselines' step: ``wrapped`` (DDP or the FSDP2 root) forward, torch's fused AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)

    def step(tokens):
        loss = _loss(wrapped, tokens)
        loss.backward()
        BACKWARD_END[0] = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step, None


def build_ddp(model, _stage):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return _torch_adamw_steps(DDP(model), model)


def build_fsdp2(model, _stage):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return _torch_adamw_steps(model, model)


def _engine_steps(engine):
    """The step of an engine with DeepSpeed's API (``engine(...)``, ``backward``, ``step``): ours and DeepSpeed's."""
    def step(tokens):
        loss = _loss(engine, tokens)
        engine.backward(loss)
        BACKWARD_END[0] = time.perf_counter()
        engine.step()
        return loss
    return step


def build_ours(model, stage, zero_kwargs, offload: bool = False):
    """``offload``: the optimizer state and its step in host memory (``offload.device=cpu``'s store)."""
    from deepshard.core import DeviceStateStore, EngineConfig, OptimConfig, ZeroConfig, initialize

    config = EngineConfig(zero=ZeroConfig(stage=stage, **zero_kwargs),
                          optim=OptimConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, grad_clip=CLIP))
    store_factory = DeviceStateStore
    if offload:
        from deepshard.offload import OffloadConfig, make_store_factory

        store_factory = make_store_factory(OffloadConfig(device="cpu"), dist.get_rank(), "bench")
    engine = initialize(model, config, blocks=model.model.layers, store_factory=store_factory)

    return _engine_steps(engine), lambda: {k: v.as_dict() for k, v in engine.memory().items()}


def build_deepspeed(model, stage, zero_kwargs, offload: bool = False):
    """``offload``: ``offload_optimizer: cpu``, stepped by DeepSpeed's C++ CPU Adam (its ZeRO-Offload);
    otherwise torch's AdamW."""
    import deepspeed

    from deepshard.core import ZeroConfig

    ours = ZeroConfig(**zero_kwargs)  # DeepSpeed gets the bucket sizes ours runs with
    zero = {"stage": stage, "overlap_comm": True, "reduce_bucket_size": ours.reduce_bucket_size,
            "allgather_bucket_size": ours.allgather_bucket_size}
    if offload:  # pinning needs an accelerator
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    ds_config = {
        "train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": 0.0,
                                                  "torch_adam": not offload}},
        "zero_optimization": zero, "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    return _engine_steps(engine), None


def _builder(name: str, zero_kwargs: dict) -> Callable:
    base, _, overrides = parse_engine(name)
    zero_kwargs = {**zero_kwargs, **overrides}
    if base == "ddp":
        return build_ddp
    if base == "fsdp2":
        return build_fsdp2
    offload = base.endswith("cpu")
    if base.startswith("ours"):
        return lambda m, s: build_ours(m, s, zero_kwargs, offload)
    return lambda m, s: build_deepspeed(m, s, zero_kwargs, offload)


def run_engine(name: str, cfg, steps: int, warmup: int, zero_kwargs: dict) -> dict:
    """Build ``name`` on fresh weights, train ``steps`` steps; step time, losses, peak RSS and census."""
    from deepshard.core.memory import expected_bytes

    world, rank = dist.get_world_size(), dist.get_rank()
    data = batches(rank, steps, cfg.vocab_size)
    _release_and_reset_peak()
    start_rss = _status_mib("VmRSS")
    before = census()
    model = hf_model(cfg)
    num_params = sum(p.numel() for p in model.parameters())
    stage = parse_engine(name)[1]
    step, memory = _builder(name, zero_kwargs)(model, stage)
    times, opt_times, losses = [], [], []
    for i, tokens in enumerate(data):
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(tokens)
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
            opt_times.append(t0 + elapsed - BACKWARD_END[0])
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        del loss, total
    after = census()
    out = {"step_s": statistics.median(times), "opt_s": statistics.median(opt_times), "losses": losses, "peak_rss_mib": _status_mib("VmHWM"),
           "start_rss_mib": start_rss, "start_census_mib": sum(before.values()) / 2**20,
           "census_mib": sum(n for p, n in after.items() if p not in before) / 2**20,
           "formula_mib": expected_bytes(stage, num_params, world, "fp32").total / 2**20,
           "num_params": num_params}
    if memory is not None:
        mem = memory()
        out["reported_live_mib"] = mem["measured"]["live_total"] / 2**20
        out["reported_buffers"] = {k: v / 2**20 for k, v in mem["measured"].items() if k.startswith("buffers.")}
    del step, memory, model
    return out


def worker(names: list[str], dim: int, layers: int, vocab: int, steps: int, warmup: int, rounds: int,
           zero_kwargs: dict) -> dict:
    import sys

    sys.stdout.flush()
    os.dup2(2, 1)  # DeepSpeed's banners go to stderr: stdout carries the JSON alone
    if any(n.startswith("ds") for n in names):
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        import deepspeed  # noqa: F401 - imported before any engine, so every engine's baseline holds it
    from deepshard.core import init_distributed

    init_distributed()
    import transformers  # noqa: F401

    cfg = hf_config(dim, layers, vocab)
    results: dict[str, list[dict]] = {n: [] for n in names}
    ours_first = [n for n in names if not n.startswith("ds")] + [n for n in names if n.startswith("ds")]
    for r in range(rounds):
        order = ours_first if r % 2 == 0 else [n for n in reversed(ours_first) if not n.startswith("ds")] + \
            [n for n in reversed(ours_first) if n.startswith("ds")]
        for name in order:
            results[name].append(run_engine(name, cfg, steps, warmup, zero_kwargs))
            res = results[name][-1]
            print(f"rank {dist.get_rank()} round {r} {name}: {res['step_s']:.3f} s, RSS {res['start_rss_mib']:.0f} (tensors "
                  f"{res['start_census_mib']:.0f}) -> "
                  f"peak {res['peak_rss_mib']:.0f} MiB", file=sys.stderr, flush=True)
    return results


def summarize(per_rank: list[dict], names: list[str]) -> dict:
    """Median over rounds of the slower rank's step time; ratios to DDP, FSDP2 and DeepSpeed's same stage."""
    rows = {}
    for name in names:
        rounds = list(zip(*(r[name] for r in per_rank)))  # per round: every rank's result
        step = statistics.median(max(x["step_s"] for x in rnd) for rnd in rounds)
        first = rounds[-1][0]
        row = {"step_s": round(step, 4),
               "opt_s": round(statistics.median(max(x["opt_s"] for x in rnd) for rnd in rounds), 4),
               "step_s_rounds": [round(max(x["step_s"] for x in rnd), 4) for rnd in rounds],
               "peak_rss_growth_mib": round(statistics.median(
                   max(x["peak_rss_mib"] - x["start_rss_mib"] for x in rnd) for rnd in rounds), 1),
               "census_mib": round(first["census_mib"], 1), "formula_mib": round(first["formula_mib"], 1),
               "final_loss": round(first["losses"][-1], 6), "losses": first["losses"]}
        if "reported_live_mib" in first:
            row["reported_live_mib"] = round(first["reported_live_mib"], 1)
            row["reported_buffers_mib"] = {k: round(v, 1) for k, v in first["reported_buffers"].items()}
        rows[name] = row
    for name, row in rows.items():
        if "ddp" in rows:
            row["max_loss_diff_vs_ddp"] = max(abs(a - b) for a, b in zip(row["losses"], rows["ddp"]["losses"]))
        row.update(ratios(rows, name))
    for row in rows.values():
        del row["losses"]
    return rows


def ratios(rows: dict, name: str) -> dict:
    """Step time of ``name`` over DDP's, FSDP2's and DeepSpeed's same stage: the ratio of the medians
    (``x_*``) and the median of each round's ratio (``x_*_paired``: engines of one round run minutes
    apart, so a load that drifts over the run cancels out of the pair); and its RSS growth over
    DeepSpeed's."""
    base, _, _ = parse_engine(name)
    ds = base.replace("ours", "ds") if base.startswith("ours") else None
    mine, out = rows[name], {}
    for key, ref in (("x_ddp", "ddp"), ("x_fsdp2", "fsdp2"), ("x_deepspeed", ds)):
        if ref in rows:
            theirs = rows[ref]
            out[key] = round(mine["step_s"] / theirs["step_s"], 3)
            out[key + "_paired"] = round(statistics.median(
                a / b for a, b in zip(mine["step_s_rounds"], theirs["step_s_rounds"])), 3)
    if ds in rows:
        out["rss_x_deepspeed"] = round(mine["peak_rss_growth_mib"] / rows[ds]["peak_rss_growth_mib"], 3)
    return out


def table(rows: dict) -> str:
    """The closing note's markdown table."""
    cols = [n for n in ("ddp", "fsdp2", "ds1", "ds2", "ds3", "ds2cpu") if n in rows] + \
        [n for n in rows if n.startswith("ours")]
    lines = ["| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for label, key in (("step s", "step_s"), ("x DDP", "x_ddp"), ("x FSDP2", "x_fsdp2"),
                       ("x DeepSpeed (same stage)", "x_deepspeed"), ("x DDP, median of rounds' ratios", "x_ddp_paired"),
                       ("x FSDP2, median of rounds' ratios", "x_fsdp2_paired"),
                       ("x DeepSpeed, median of rounds' ratios", "x_deepspeed_paired"),
                       ("optimizer step s (after backward)", "opt_s"), ("peak RSS growth MiB/rank", "peak_rss_growth_mib"),
                       ("RSS growth x DeepSpeed", "rss_x_deepspeed"), ("census MiB/rank", "census_mib"),
                       ("engine.memory() live MiB", "reported_live_mib"), ("ZeRO formula MiB", "formula_mib"),
                       ("final loss", "final_loss")):
        lines.append(f"| {label} | " + " | ".join(str(rows[c].get(key, "")) for c in cols) + " |")
    return "\n".join(lines)
