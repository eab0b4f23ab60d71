"""Shared by the pipeline tests: a 4-layer micro Llama, learnable batches, the single-process
AdamW reference, and one distributed run of a (pp, dp, tp, schedule, zero stage) case."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepshard.core import EngineConfig, OptimConfig, ParallelDims, PrecisionConfig, ZeroConfig
from deepshard.core.mesh import local_device
from deepshard.finetune.models.llama import Llama, LlamaConfig

MICRO = LlamaConfig(vocab_size=96, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=72, max_seq_len=32)
SEQ = 16
MBS = 2  # rows per microbatch
STEPS = 5
OPTIM = OptimConfig(lr=2e-3, weight_decay=0.1, grad_clip=0.05)  # clip below the norm: clipping is live


@dataclass(frozen=True)
class Case:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 2
    zero: int = 0
    partition: str = "uniform"
    ac: str = "none"
    dtype: str = "fp32"

    @property
    def rows(self) -> int:
        """Rows of the global batch per step."""
        return self.dp * self.microbatches * MBS


def build_model(cfg: LlamaConfig = MICRO, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(cfg)
    model.init_weights(seed)
    return model


def batches(num_steps: int, rows: int, cfg: LlamaConfig = MICRO) -> torch.Tensor:
    """[step, rows, SEQ+1] token ids following next = 5 * prev + 1 (mod vocab) from random starts."""
    g = torch.Generator().manual_seed(1234)
    seq = [torch.randint(0, cfg.vocab_size, (num_steps, rows, 1), generator=g)]
    for _ in range(SEQ):
        seq.append((seq[-1] * 5 + 1) % cfg.vocab_size)
    return torch.cat(seq, dim=-1)


def reference(rows: int, num_steps: int = STEPS, optim: OptimConfig = OPTIM):
    """Single-process torch: the whole global batch at once, torch.optim.AdamW, global-norm clip."""
    model = build_model()
    params = list(model.parameters())
    # decay on matrices only, written here (the reference shares no code with the engine)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps)
    data = batches(num_steps, rows)
    losses = []
    for step in range(num_steps):
        loss = model(data[step, :, :-1], data[step, :, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, optim.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_config(case: Case) -> EngineConfig:
    return EngineConfig(zero=ZeroConfig(stage=case.zero, reduce_bucket_size=3000, allgather_bucket_size=3000),
                        precision=PrecisionConfig(dtype=case.dtype), optim=OPTIM, ac=case.ac)


def run_case(case: Case, num_steps: int = STEPS) -> dict:
    """On every rank: train ``num_steps`` and return losses, this rank's full params by FQN, sizes."""
    from deepshard.core import build_mesh
    from deepshard.finetune.models.llama.parallelize import pipeline_llama

    mesh = build_mesh(ParallelDims(pp=case.pp, dp=case.dp, tp=case.tp))
    pipe_engine = pipeline_llama(build_model(), mesh, engine_config(case), schedule=case.schedule,
                             microbatches=case.microbatches, partition=case.partition)
    local_numel = pipe_engine.local_param_numel()
    dp_rank, per_dp = mesh["dp"].get_local_rank(), case.rows // case.dp
    data = batches(num_steps, case.rows)[:, dp_rank * per_dp:(dp_rank + 1) * per_dp].to(local_device())
    losses, norms, scales = [], [], []
    for step in range(num_steps):
        result = pipe_engine.train_step(data[step, :, :-1], data[step, :, 1:])
        losses.append(result.loss)
        norms.append(result.stats.grad_norm)
        scales.append((result.stats.loss_scale, result.stats.applied))
    params = {}
    for m in pipe_engine.pipeline.modules:
        for n, p in m.named_parameters():
            t = p.data.full_tensor() if hasattr(p.data, "full_tensor") else p.data
            params[n.replace("_checkpoint_wrapped_module.", "")] = t.float().cpu().clone()  # beside the host reference
    return {"losses": losses, "norms": norms, "scales": scales, "params": params, "local_numel": local_numel,
            "ranges": [(r.start, r.stop) for r in pipe_engine.pipeline.ranges]}
