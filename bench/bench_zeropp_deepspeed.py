"""ZeRO++ against DeepSpeed's own, at world 4 (gloo, "nodes" of 2 consecutive ranks): bytes each
step sends (total and across nodes) for DeepSpeed's ZeRO-3, hpZ (``zero_hpz_partition_size: 2``),
qwZ (``zero_quantized_weights``), qgZ (``zero_quantized_gradients``) and all three, each in its own
launch, next to ours on the same model, data and batch (bench/bench_zeropp.py's rows of the same names).

Counted as bench/bench_zeropp.py counts ours, at the collective: DeepSpeed reaches the wire through
``deepspeed.comm``, which calls ``torch.distributed``; its worker initializes the gloo group first,
wraps torch.distributed's collectives (bench/bench_zeropp.py's ``Counter``, plus the list-based and
``distributed_c10d`` entry points DeepSpeed also uses) and only then lets ``deepspeed.init_distributed``
build its backend, so the functions it captures are the counted ones.

The model is the README's tiny Llama (deepshard's ``Llama``, 6 layers, fp32, vocab 2048, dim 256)
with plain logits (``loss_chunk_size=0``: the head runs through ``lm_head``'s own forward, where
DeepSpeed's ZeRO-3 hooks gather it); the optimizer torch's AdamW (lr 1e-3), global-norm clip 1.0,
as ours.  DeepSpeed is run with ``stage3_param_persistence_threshold: 0``, ``stage3_max_reuse_distance: 0``
and ``stage3_prefetch_bucket_size: 0`` so that it, like FSDP2, partitions every parameter and
gathers it again for backward, as it does on a model larger than its prefetch bucket: with its
defaults the bucket (5e7 elements) covers this 5.5M-parameter model, the prefetcher marks every
backward use as already fetched and no parameter is released between forward and backward (one
all-gather per step, which leaves hpZ nothing to save; ``--ds-defaults`` shows it).  A variant that
does not run on this host records its error in one line, with the DeepSpeed line that raised it.
Where DeepSpeed is not installed, its side is skipped with that reason.

    python bench/bench_zeropp_deepspeed.py [--steps 6] [--warmup 2] [--layers 6] [--ds-defaults] [--only hpz,qwz] [--no-ours]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.* and tests.* by package path

from bench.bench_zeropp import MBS, NODE, SEQ, Counter  # noqa: E402
from deepshard.launch.local import launch_local  # noqa: E402

_QGZ = {"zero_quantized_gradients": True}
DS_VARIANTS = {  # name (as bench/bench_zeropp.py's rows) -> zero_optimization keys on top of stage 3
    "zero3": {},
    "hpz": {"zero_hpz_partition_size": NODE},
    "qwz": {"zero_quantized_weights": True},
    "qgz": _QGZ,
    "qwz+hpz+qgz": {"zero_quantized_weights": True, "zero_hpz_partition_size": NODE, **_QGZ},
}
COMPARABLE = {"zero3", "hpz", "qwz", "qgz", "qwz+hpz+qgz"}  # our rows of the same names


class DSCounter(Counter):
    """bench/bench_zeropp.py's counter, also over the entry points DeepSpeed uses: keyword arguments, the
    list-based collectives, ``distributed_c10d``'s own names (its coalescing manager calls those),
    counting only the outermost call (a deprecated ``_all_gather_base`` calls another)."""

    EXTRA = ("all_gather", "reduce_scatter", "all_reduce_coalesced", "reduce", "all_to_all",
             "_all_gather_base", "_reduce_scatter_base", "send", "isend")

    def __init__(self) -> None:
        super().__init__()
        import torch.distributed.distributed_c10d as c10d

        self.depth, self.by_op = 0, {}
        for name in self.EXTRA:
            if hasattr(self.dist, name):
                setattr(self.dist, name, self._wrap(name, getattr(self.dist, name)))
        for name in self.NAMES + self.EXTRA:
            if hasattr(c10d, name):
                setattr(c10d, name, self._wrap(name, getattr(c10d, name)))

    def _count(self, name: str, args: tuple, kwargs: dict) -> None:
        kw = dict(kwargs)
        first = kw.pop("tensor", None)
        if first is not None:
            args = (first, *args)
        if name in ("all_gather_into_tensor", "_all_gather_base"):
            inp = kw.get("input_tensor", args[1] if len(args) > 1 else None)
            return super()._count("all_gather_into_tensor", (None, inp), {"group": kw.get("group")})
        if name in ("reduce_scatter_tensor", "_reduce_scatter_base"):
            inp = kw.get("input", kw.get("input_tensor", args[1] if len(args) > 1 else None))
            return super()._count("reduce_scatter_tensor", (None, inp), {"group": kw.get("group")})
        if name in self.NAMES:
            return super()._count(name, args, kw)
        peers = self._peers(kw.get("group"))
        if name == "all_gather":
            for p in peers:
                self._send(p, args[1].nbytes if len(args) > 1 else args[0].nbytes)
        elif name in ("reduce_scatter", "all_to_all"):
            lst = kw.get("input_list", kw.get("input_tensor_list", args[1] if len(args) > 1 else None))
            for p, t in zip(peers, lst):
                self._send(p, t.nbytes)
        elif name == "all_reduce_coalesced":
            tensors = kw.get("tensors", args[0] if args else None)
            for p in peers:
                self._send(p, 2 * sum(t.nbytes for t in tensors) / len(peers))
        elif name == "reduce":
            self._send(kw.get("dst", args[1] if len(args) > 1 else None), args[0].nbytes)
        elif name in ("send", "isend"):
            self._send(kw.get("dst", args[1] if len(args) > 1 else None), args[0].nbytes)

    def _wrap(self, name: str, fn):
        def counted(*args, **kwargs):
            outer = self.depth == 0
            if self.on and outer:
                before = self.total
                self._count(name, args, kwargs)
                self.by_op[name] = self.by_op.get(name, 0) + self.total - before
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return counted


def ds_config(zero: dict, defaults: bool) -> dict:
    """DeepSpeed's config for one variant: fp32, stage 3, the batch and clip of our rows."""
    tuned = {} if defaults else {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                                 "stage3_prefetch_bucket_size": 0}
    return {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "wall_clock_breakdown": False,
            "zero_optimization": {"stage": 3, **tuned, **zero}}


def _first_line(e: BaseException) -> str:
    """The error in one line, with the innermost DeepSpeed frame above its op builders (where it was asked for)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "deepspeed" in f.filename and "op_builder" not in f.filename]
    at = f" (at deepspeed/{frames[-1].filename.split('deepspeed/', 1)[-1]}:{frames[-1].lineno} " \
         f"{frames[-1].name}: {frames[-1].line})" if frames else ""
    return f"{type(e).__name__}: {lines[-1] if lines else ''}{at}"[:400]


def _ds_worker(name: str, steps: int, warmup: int, layers: int, defaults: bool) -> dict:
    sys.stdout.flush()
    os.dup2(2, 1)  # DeepSpeed's banners go to stderr, the JSON stays clean
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_SIZE"] = str(NODE)  # the CPU accelerator's device_count: ranks per "node" (qgZ's groups)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    counter = DSCounter()  # before DeepSpeed's backend captures torch.distributed's functions
    import deepspeed

    from deepshard.finetune.models.llama import Llama, LlamaConfig

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = LlamaConfig(n_layers=layers, max_seq_len=SEQ, loss_chunk_size=0)
    g = torch.Generator().manual_seed(1000 + dist.get_rank())  # bench/bench_zeropp.py's tokens
    tokens = torch.randint(0, cfg.vocab_size, (steps + warmup, MBS, SEQ + 1), generator=g)
    try:
        torch.manual_seed(0)
        model = Llama(cfg)
        model.init_weights(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(DS_VARIANTS[name], defaults))
        times, losses = [], []
        for s in range(steps + warmup):
            counter.on = s >= warmup
            dist.barrier()
            t0 = time.perf_counter()
            loss = engine(tokens[s, :, :-1], tokens[s, :, 1:])
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t0)
            counter.on = False
            losses.append(loss.item())
    except Exception as e:  # noqa: BLE001 - the reason this variant cannot run here is the result
        return {"error": _first_line(e)}
    return {"total": counter.total / steps, "cross": counter.cross / steps,
            "step_s": statistics.median(times[warmup:]), "last_loss": losses[-1], "version": deepspeed.__version__,
            "by_op": {k: v / steps for k, v in counter.by_op.items()}}


def _ours_worker(steps: int, warmup: int, layers: int) -> dict:
    from bench import bench_zeropp as zeropp

    zeropp.CONFIGS = {k: v for k, v in zeropp.CONFIGS.items() if k in COMPARABLE}
    return zeropp._worker(steps, warmup, layers)


def _rows(ranks: list[dict], base: dict) -> dict:
    total, cross = sum(r["total"] for r in ranks), sum(r["cross"] for r in ranks)
    step = max(r["step_s"] for r in ranks)
    return {"MB_per_step": round(total / 1e6, 3), "cross_node_MB_per_step": round(cross / 1e6, 3),
            "ratio_total": round(total / base["total"], 3), "ratio_cross_node": round(cross / base["cross"], 3),
            "step_s": round(step, 3), "last_loss": round(ranks[0]["last_loss"], 4), "_total": total, "_cross": cross,
            **({"MB_by_op": {k: round(sum(r["by_op"].get(k, 0) for r in ranks) / 1e6, 3) for k in ranks[0]["by_op"]}}
               if "by_op" in ranks[0] else {})}


def _deepspeed(a: argparse.Namespace) -> dict:
    hidden = "deepspeed" in sys.modules and sys.modules["deepspeed"] is None  # import blocked
    if hidden or importlib.util.find_spec("deepspeed") is None:
        return {"skipped": "DeepSpeed is not installed (pip install -r bench/requirements.txt)"}
    raw = {}
    for name in DS_VARIANTS:
        if a.only and name not in a.only.split(",") and name != "zero3":
            continue
        try:
            raw[name] = launch_local(_ds_worker, 4, name, a.steps, a.warmup, a.layers, a.ds_defaults)
        except Exception as e:  # noqa: BLE001 - a rank that died outside the step loop
            raw[name] = [{"error": _first_line(e)}]
    out: dict = {"version": next((r[0]["version"] for r in raw.values() if "version" in r[0]), None),
                 "config": "defaults" if a.ds_defaults else
                 "stage3_param_persistence_threshold 0, stage3_max_reuse_distance 0, "
                           "stage3_prefetch_bucket_size 0"}
    base = raw["zero3"]
    if "error" in base[0]:
        return {**out, "zero3": {"not_run": base[0]["error"]}}
    base_sums = {k: sum(r[k] for r in base) for k in ("total", "cross")}
    for name, ranks in raw.items():
        errors = sorted({r["error"] for r in ranks if "error" in r})
        out[name] = {"not_run": errors[0]} if errors else _rows(ranks, base_sums)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--ds-defaults", action="store_true", help="DeepSpeed's own stage-3 defaults (see above)")
    ap.add_argument("--only", default="", help="DeepSpeed variants to run (comma list; zero3 always)")
    ap.add_argument("--no-ours", action="store_true", help="only DeepSpeed's side")
    a = ap.parse_args()
    result: dict = {"world": 4, "ranks_per_node": NODE, "model": f"README tiny Llama, {a.layers} layers, fp32",
                    "tokens_per_rank_step": MBS * SEQ, "measured_steps": a.steps}
    ds = _deepspeed(a)
    ours = {}
    if not a.no_ours:
        ranks = launch_local(_ours_worker, 4, a.steps, a.warmup, a.layers)
        base = {k: sum(r["zero3"][k] for r in ranks) for k in ("total", "cross")}
        ours = {name: _rows([r[name] for r in ranks], base) for name in ranks[0]}
    for name, row in ds.items():  # DeepSpeed's bytes over ours, variant by variant
        if isinstance(row, dict) and "_total" in row and name in ours:
            row["ds_over_ours_total"] = round(row["_total"] / ours[name]["_total"], 3)
            row["ds_over_ours_cross_node"] = round(row["_cross"] / ours[name]["_cross"], 3)
    for rows in (ds, ours):
        for row in rows.values():
            if isinstance(row, dict):
                row.pop("_total", None)
                row.pop("_cross", None)
    result["deepspeed"] = ds
    if ours:
        result["ours"] = ours
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
