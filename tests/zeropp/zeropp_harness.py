"""Shared by the ZeRO++ tests: a small Llama, masked prompt/response data, a plain-torch reference
and an engine run of the same steps on a given mesh layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepshard.finetune.models.llama import Llama, LlamaConfig

# the README model's shape, scaled down so a world-4 launch on 2 cores stays short
MICRO = LlamaConfig(vocab_size=96, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=72, max_seq_len=32)
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


def reference(num_steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process, the whole global batch at once: summed token loss / valid count, AdamW with
    decay on matrices, clip_grad_norm_.  Shares no code with the engine."""
    m = model()
    decay = [p for p in m.parameters() if p.dim() >= 2]
    no_decay = [p for p in m.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    ids, labels = data(num_steps)
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


def engine_config(**zero):
    from deepshard.core import EngineConfig, OptimConfig, PrecisionConfig, ZeroConfig

    return EngineConfig(zero=ZeroConfig(stage=3, **zero), precision=PrecisionConfig(dtype="fp32"),
                        optim=OptimConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, grad_clip=CLIP))


def build_engine(dp_replicate: int, cfg: LlamaConfig = MICRO, **zero):
    """The engine on a world-size mesh: flat dp (``dp_replicate=1``) or HSDP (dp_replicate x rest)."""
    from deepshard.core import ParallelDims, build_mesh, initialize
    from deepshard.core.mesh import local_device

    mesh = build_mesh(ParallelDims(dp_replicate=dp_replicate))
    return initialize(model(cfg).to(local_device()), engine_config(**zero), mesh=mesh)


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


def full_params(engine) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in engine.model.named_parameters():
        t = p.data.full_tensor() if hasattr(p.data, "full_tensor") else p.data
        out[n.replace("_checkpoint_wrapped_module.", "")] = t.float().cpu().clone()
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
