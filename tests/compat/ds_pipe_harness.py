"""DeepSpeed's pipeline API as DeepSpeedExamples' pipeline_parallelism script uses it, per rank:
``PipelineModule(layers=[LayerSpec, TiedLayerSpec, callables], num_stages, loss_fn, partition_method)``
and ``engine.train_batch(data_iter)`` / ``engine.eval_batch(data_iter)``.

``deepspeed`` is a parameter (default: ours) so bench/record_ds_scripts.py runs these same bodies with
real DeepSpeed; ``init`` (default none) runs on the PipelineModule before ``initialize`` (the recorder
gives DeepSpeed's stage-local build the one-process weights, see there).  The data-parallel rank is
``rank % (world // num_stages)``, DeepSpeed's pipe-outer, data-inner topology."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812

import deepshard.compat.deepspeed as deepspeed

VOCAB, HIDDEN, SEQ, MICRO = 11, 8, 5, 2


def lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def head(embedding, x):
    return x @ embedding.weight.t()


def micro_batch(k: int):
    g = torch.Generator().manual_seed(50 + k)
    ids = torch.randint(VOCAB, (MICRO, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def tied_layers(deepspeed=deepspeed):
    LayerSpec, TiedLayerSpec = deepspeed.pipe.LayerSpec, deepspeed.pipe.TiedLayerSpec  # noqa: N806
    return [TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN), LayerSpec(nn.Linear, HIDDEN, HIDDEN), torch.tanh,
            LayerSpec(nn.Linear, HIDDEN, HIDDEN), TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN, forward_fn=head)]


def run_pipe(num_stages: int, stage: int, steps: int, gas: int, clip: float = 0.0, deepspeed=deepspeed, init=None):
    torch.manual_seed(0)
    model = deepspeed.pipe.PipelineModule(layers=tied_layers(deepspeed), num_stages=num_stages, loss_fn=lm_loss,
                                          partition_method="parameters")
    if init is not None:
        init(model)
    ds_config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
                 "zero_optimization": {"stage": stage}, "gradient_clipping": clip}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    dp = torch.distributed.get_world_size() // num_stages
    rank = torch.distributed.get_rank() % dp
    data_iter = iter([micro_batch(k * dp + rank) for k in range(steps * gas)])
    losses, norms = [], []
    for _ in range(steps):
        losses.append(engine.train_batch(data_iter).item())
        norms.append(engine.get_global_grad_norm())
    eval_iter = iter([micro_batch(1000 + k * dp + rank) for k in range(gas)])
    out = {"losses": losses, "norms": norms, "eval": engine.eval_batch(eval_iter).item(),
           "ranges": engine.pipeline.ranges if hasattr(engine, "pipeline") else model.parts,
           "first": engine.is_first_stage(), "last": engine.is_last_stage()}
    try:
        engine(torch.zeros(1))
    except Exception as err:  # ours: ValueError; DeepSpeed: PipelineError
        out["forward_refused"] = str(err)
    return out


def pipeline_example_style(steps: int, gas: int, deepspeed=deepspeed, init=None):
    """DeepSpeedExamples' pipeline_parallelism/train.py shape: training_data= to initialize, then
    ``engine.train_batch()`` with no iterator (the engine's RepeatingLoader over its own loader)."""
    torch.manual_seed(0)
    net = deepspeed.pipe.PipelineModule(layers=tied_layers(deepspeed), loss_fn=lm_loss, num_stages=2,
                                        partition_method="uniform")
    if init is not None:
        init(net)
    trainset = [row for k in range(steps * gas) for row in zip(*micro_batch(k))]  # one (ids, labels) per row
    ds_config = {"train_batch_size": MICRO * gas, "train_micro_batch_size_per_gpu": MICRO,
                 "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=trainset, config=ds_config)
    return [engine.train_batch().item() for _ in range(steps)]


def run_all():
    return {"pp2": run_pipe(2, 0, steps=3, gas=4, clip=0.5), "dp2": run_pipe(1, 1, steps=3, gas=2),
            "pp2_noclip": run_pipe(2, 0, steps=3, gas=4), "pp2_zero1": run_pipe(2, 1, steps=3, gas=4, clip=0.5),
            "loader": pipeline_example_style(steps=2, gas=4)}
