"""Shared by the ZeRO++ tests: a small Llama, masked prompt/response data, a plain-torch reference
and an engine run of the same steps on a given mesh layout."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from deepshard.finetune.models.llama import Llama, LlamaConfig

# the README model's shape, scaled down so a world-4 launch on 2 cores stays short
MICRO = LlamaConfig(vocab_size=96, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=72, max_seq_len=32)
# HSDP + qgZ's test (tests/zeropp/test_hsdp_qgz.py): its checks are per unit, on bytes per step and on final
# losses; two blocks (three FSDP2 units with the root) make every kind of unit and hop that four do, for less CPU
TWO_BLOCKS = replace(MICRO, n_layers=2)
SEQ, ROWS = 16, 4  # global batch: 4 rows, one per rank at world 4
LR, BETAS, EPS, WD, CLIP = 2e-3, (0.9, 0.95), 1e-6, 0.1, 0.05


def model(cfg: LlamaConfig = MICRO) -> Llama:
    torch.manual_seed(0)
    m = Llama(cfg)
    m.init_weights(0)
    return m


def data(num_steps: int, rows: int = ROWS, seed: int = 7, cfg: LlamaConfig = MICRO) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [step, rows, SEQ] following next = 5 * prev + 1 (mod vocab); labels with a masked prompt of
    random length and right padding (1 to 15 valid tokens per row)."""
    g = torch.Generator().manual_seed(seed)
    seq = [torch.randint(0, cfg.vocab_size, (num_steps, rows, 1), generator=g)]
    for _ in range(SEQ):
        seq.append((seq[-1] * 5 + 1) % cfg.vocab_size)
    tokens = torch.cat(seq, dim=-1)
    ids, labels = tokens[..., :-1].clone(), tokens[..., 1:].clone()
    pos = torch.arange(SEQ)
    for s in range(num_steps):
        for r in range(rows):
            prompt = int(torch.randint(0, SEQ - 1, (1,), generator=g))
            end = int(torch.randint(prompt + 1, SEQ + 1, (1,), generator=g))
            labels[s, r][(pos < prompt) | (pos >= end)] = -100
    return ids, labels


def reference(num_steps: int, rows: int = ROWS, cfg: LlamaConfig = MICRO) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process, the whole global batch at once: summed token loss / valid count, AdamW with
    decay on matrices, clip_grad_norm_.  Shares no code with the engine."""
    m = model(cfg)
    decay = [p for p in m.parameters() if p.dim() >= 2]
    no_decay = [p for p in m.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    ids, labels = data(num_steps, rows)
    losses = []
    for s in range(num_steps):
        logits = m(ids[s])
        loss = F.cross_entropy(logits.flatten(0, 1), labels[s].flatten(), ignore_index=-100, reduction="sum")
        loss = loss / (labels[s] != -100).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(m.parameters()), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in m.named_parameters()}


def engine_config(grad_accum: int = 1, **zero):
    from deepshard.core import EngineConfig, OptimConfig, PrecisionConfig, ZeroConfig

    return EngineConfig(zero=ZeroConfig(stage=3, **zero), precision=PrecisionConfig(dtype="fp32"),
                        optim=OptimConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, grad_clip=CLIP),
                        grad_accum=grad_accum)


def build_engine(dp_replicate: int, cfg: LlamaConfig = MICRO, grad_accum: int = 1, **zero):
    """The engine on a world-size mesh: flat dp (``dp_replicate=1``) or HSDP (dp_replicate x rest)."""
    from deepshard.core import ParallelDims, build_mesh, initialize
    from deepshard.core.mesh import local_device

    mesh = build_mesh(ParallelDims(dp_replicate=dp_replicate))
    return initialize(model(cfg).to(local_device()), engine_config(grad_accum, **zero), mesh=mesh)


def train(engine, ids: torch.Tensor, labels: torch.Tensor, steps: range, census: dict | None = None) -> list[float]:
    """Global-batch steps: this dp rank takes its rows; returns each step's global token-mean loss.
    ``census``: filled with the measured model-state bytes after the first backward."""
    import torch.distributed as dist

    from deepshard.core.mesh import local_device

    dp = engine.mesh["dp"]
    rank, size = dp.get_local_rank(), dp.size()
    per = ids.shape[1] // size
    losses = []
    for s in steps:
        x = ids[s, rank * per:(rank + 1) * per].to(local_device())
        y = labels[s, rank * per:(rank + 1) * per].to(local_device())
        count = engine.global_num_items((y != -100).sum())
        loss = engine(x, y, reduction="sum")
        total = loss.detach().clone()
        engine.backward(loss, num_items=count)
        if census is not None and not census:
            memory = engine.memory()
            census.update(memory["measured"].as_dict(), expected=memory["expected"].as_dict())
        engine.step()
        dist.all_reduce(total, group=dp.get_group())
        losses.append((total / count).item())
    return losses


def train_accumulating(engine, ids: torch.Tensor, labels: torch.Tensor, steps: range) -> list[float]:
    """As :func:`train`, each rank's rows as ``engine.config.grad_accum`` micro-batches of one row."""
    import torch.distributed as dist

    from deepshard.core.mesh import local_device

    dp = engine.mesh["dp"]
    rank, size = dp.get_local_rank(), dp.size()
    per = ids.shape[1] // size
    assert per == engine.config.grad_accum
    losses = []
    for s in steps:
        x = ids[s, rank * per:(rank + 1) * per].to(local_device())
        y = labels[s, rank * per:(rank + 1) * per].to(local_device())
        count = engine.global_num_items((y != -100).sum())
        total = torch.zeros((), device=local_device())
        for m in range(per):
            loss = engine(x[m:m + 1], y[m:m + 1], reduction="sum")
            total += loss.detach()
            engine.backward(loss, num_items=count)
        engine.step()
        dist.all_reduce(total, group=dp.get_group())
        losses.append((total / count).item())
    return losses


class ByteCounter:
    """Bytes this rank hands to ranks of another "node" (``node`` consecutive ranks) while ``on``, counted
    at the torch.distributed call as a direct algorithm moves them: an all-reduce ``2 x size / G`` to
    each peer, an all-to-all chunk ``j`` to peer ``j``, a broadcast its tensor to every peer."""

    def __init__(self, node: int) -> None:
        import torch.distributed as dist

        self.dist, self.node, self.on, self.cross = dist, node, False, 0
        self.me = dist.get_rank()
        for name in ("all_reduce", "all_to_all_single", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor"):
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, fn):
        def counted(*args, **kwargs):
            if self.on:
                self._count(name, args, kwargs)
            return fn(*args, **kwargs)
        return counted

    def _count(self, name: str, args: tuple, kwargs: dict) -> None:
        group = kwargs.get("group")
        peers = self.dist.get_process_group_ranks(group) if group is not None else list(range(self.dist.get_world_size()))
        far = [p for p in peers if p // self.node != self.me // self.node]
        if name == "all_reduce":
            self.cross += len(far) * 2 * args[0].nbytes / len(peers)
        elif name in ("all_to_all_single", "reduce_scatter_tensor"):
            self.cross += len(far) * args[1].nbytes / len(peers)
        elif name == "broadcast":
            src = kwargs.get("src", args[1] if len(args) > 1 else None)
            self.cross += len(far) * args[0].nbytes if src == self.me else 0
        elif name == "all_gather_into_tensor":
            self.cross += len(far) * args[1].nbytes


def full_params(engine) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in engine.model.named_parameters():
        t = p.data.full_tensor() if hasattr(p.data, "full_tensor") else p.data
        out[n.replace("_checkpoint_wrapped_module.", "")] = t.float().cpu().clone()
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
