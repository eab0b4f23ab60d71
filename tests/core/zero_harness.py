"""Shared by the ZeRO tests: a micro Llama, fixed batches, a single-process reference and a
distributed run of the same steps through the engine."""

from __future__ import annotations

import torch

from deepshard.core import EngineConfig, OptimConfig, PrecisionConfig, ZeroConfig, initialize
from deepshard.core.mesh import local_device
from deepshard.finetune.models.llama import Llama, LlamaConfig

MICRO = LlamaConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=72, max_seq_len=32)
SEQ = 16
MBS = 2  # sequences per rank per micro-step


def build_model(cfg: LlamaConfig = MICRO, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(cfg)
    model.init_weights(seed)
    return model


def batches(num_steps: int, world: int, grad_accum: int, cfg: LlamaConfig = MICRO) -> torch.Tensor:
    """[step, micro, rank, MBS, SEQ+1] token ids: the global batch of each step, laid out per rank."""
    g = torch.Generator().manual_seed(1234)
    # a learnable rule (next = 5 * prev + 1 mod vocab) from random starts, so the loss really falls
    start = torch.randint(0, cfg.vocab_size, (num_steps, grad_accum, world, MBS, 1), generator=g)
    steps = [start]
    for _ in range(SEQ):
        steps.append((steps[-1] * 5 + 1) % cfg.vocab_size)
    return torch.cat(steps, dim=-1)


def reference(num_steps: int, world: int, grad_accum: int, optim: OptimConfig, cfg: LlamaConfig = MICRO):
    """Plain single-process torch: the whole global batch at once, torch.optim.AdamW."""
    model = build_model(cfg)
    params = list(model.parameters())
    # decay on matrices only, written here (the reference shares no code with the engine)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps)
    data = batches(num_steps, world, grad_accum, cfg)
    losses = []
    for step in range(num_steps):
        tokens = data[step].reshape(-1, SEQ + 1)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        if optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, optim.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def distributed_run(config: EngineConfig, num_steps: int, mesh=None, cfg: LlamaConfig = MICRO,
                    store_factory=None, inject_overflow_at: int = -1, meta: bool = False):
    """Run the engine on this rank; returns (global losses, full params, stats, memory)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    kwargs = {} if store_factory is None else {"store_factory": store_factory}
    if meta:  # ZeRO-3 sharded init: built on meta, each rank materializes only its shards
        with torch.device("meta"):
            model = Llama(cfg)
        kwargs["materialize"] = lambda m: m.init_weights(0)
    else:  # the seeded host init, then to the compute device (nccl reduces device tensors only)
        model = build_model(cfg).to(local_device())
    engine = initialize(model, config, mesh=mesh, **kwargs)
    data = batches(num_steps, world, config.grad_accum, cfg).to(local_device())
    losses, stats, memory = [], [], None
    for step in range(num_steps):
        total = torch.zeros((), device=local_device())
        for micro in range(config.grad_accum):
            tokens = data[step, micro, rank]
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            total += loss.detach().float()
            if step == inject_overflow_at and rank == world - 1:
                loss = loss * float("inf")
            engine.backward(loss)
        if step == 0:
            memory = engine.memory()
        s = engine.step()
        stats.append(s)
        dist.all_reduce(total)
        losses.append(total.item() / (world * config.grad_accum))
    full = {}
    for n, p in engine.model.named_parameters():
        t = p.data.full_tensor() if hasattr(p.data, "full_tensor") else p.data
        full[n.replace("_checkpoint_wrapped_module.", "")] = t.float().cpu().clone()  # beside the host reference
    return losses, full, stats, memory


# eps=1e-6: Adam divides by sqrt(v) + eps, so an element whose gradient is ~0 turns summation-order
# noise (1e-7 relative) into a full +-lr step; eps bounds that amplification without hiding a wrong
# reduction (a missing average or a lost shard shows up as errors of order 1e-2).
def engine_config(stage: int, grad_accum: int = 1, clip: float = 0.0, dtype: str = "fp32", *,
                  bucket: int = 3000, precision: dict | None = None, **zero) -> EngineConfig:
    return EngineConfig(
        zero=ZeroConfig(stage=stage, reduce_bucket_size=bucket, allgather_bucket_size=bucket, **zero),
        precision=PrecisionConfig(dtype=dtype, **(precision or {})),
        optim=OptimConfig(lr=2e-3, eps=1e-6, weight_decay=0.1, grad_clip=clip),
        grad_accum=grad_accum,
    )
