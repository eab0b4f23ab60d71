"""Issue 34 item 4: checkpoint exchange with DeepSpeed on ordinary scripts, per rank of a gloo group."""

from __future__ import annotations

import torch

from tests.compat.ds_fixture_model import (
    SAVE_STEP,
    TOTAL_STEPS,
    ds_config,
    param_groups,
    tiny_model,
    train_steps,
)


def resume_tied_worker(imported: str, stages: list[int]) -> dict[int, dict]:
    """At each of our ZeRO ``stages``: a fresh tied-embedding engine (other weights) resumes the import of
    DeepSpeed's checkpoint and trains DeepSpeed's next steps."""
    import deepshard.compat.deepspeed as deepspeed

    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    out = {}
    for stage in stages:
        model = tiny_model(seed=1, tied=True)
        # the groups DeepSpeed trained with (bench/record_ds_exchange.py): matrices decayed, vectors not
        engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model),
                                          config=ds_config(stage, world))
        path, client_state = engine.load_checkpoint(imported)
        assert path is not None and engine.global_steps == SAVE_STEP
        step = client_state["step"]  # what the script reads back (DeepSpeedExamples' scripts: the epoch/step)
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        losses = train_steps(engine, range(SAVE_STEP, TOTAL_STEPS), rank, world)
        with deepspeed.zero.GatheredParameters([model.lm_head.weight, model.model.embed_tokens.weight]):
            same = bool(torch.equal(model.lm_head.weight.detach(), model.model.embed_tokens.weight.detach()))
        out[stage] = {"client_state": client_state, "step": step, "tied": tied, "same_after": same, "losses": losses}
    return out


def decay_groups(model) -> list[dict]:
    """Per-group weight decay as scripts write it, chosen so that no rule by shape gives it: the embedding
    (a matrix) undecayed, norms and biases decayed more than the other matrices."""
    embed = [p for n, p in model.named_parameters() if n.startswith("embed.")]
    vectors = [p for n, p in model.named_parameters() if p.dim() < 2]
    rest = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("embed.")]
    return [{"params": rest, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.5},
            {"params": embed, "weight_decay": 0.0}]


def group_decay_worker(stages: list[int], steps: int) -> dict:
    """``initialize(optimizer=torch.optim.AdamW(groups))`` at each ZeRO stage; the full weights after ``steps``."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    import deepshard.compat.deepspeed as deepspeed
    from tests.compat.ds_zero3_patterns_harness import TinyLM, batch

    deepspeed.init_distributed()
    rank = deepspeed.comm.get_rank()
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        model = TinyLM()
        optimizer = torch.optim.AdamW(decay_groups(model), lr=5e-2, betas=(0.9, 0.95))
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config={"train_micro_batch_size_per_gpu": 4,
                                                  "zero_optimization": {"stage": stage}})
        for step in range(steps):
            inputs, labels = batch(step, rank)
            engine.backward(F.cross_entropy(engine(inputs).flatten(0, 1), labels.flatten()))
            engine.step()
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            out[stage] = {n: p.detach().clone().cpu() for n, p in engine.module.named_parameters()}
    return out


def per_rank_tag_worker(save_dir: str) -> dict:
    """DeepSpeed-Chat's ``save_checkpoint(dir, tag=loss.item())``: each rank's own loss as the tag."""
    import warnings

    import torch
    import torch.nn.functional as F  # noqa: N812

    import deepshard.compat.deepspeed as deepspeed
    from tests.compat.ds_zero3_patterns_harness import TinyLM, batch

    deepspeed.init_distributed()
    rank = deepspeed.comm.get_rank()
    torch.manual_seed(0)
    model = TinyLM()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}})
    inputs, labels = batch(0, rank)
    loss = F.cross_entropy(engine(inputs).flatten(0, 1), labels.flatten())
    engine.backward(loss)
    engine.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.save_checkpoint(save_dir, tag=f"{loss.item():.6f}")
    return {"tag": f"{loss.item():.6f}", "warnings": [str(w.message) for w in caught if "checkpoint tag" in str(w.message)]}


CLIENT_STATE = {"step": SAVE_STEP, "epoch": 0, "best_loss": 3.5}


def ours_to_deepspeed_worker(root: str, stage: int) -> dict:
    """Ours (a tied-embedding model, ``optimizer=AdamW(model.parameters())``: one group) trains 3 steps,
    saves with a client_state, trains 3 more; DeepSpeed (one group, its own ds_config optimizer) resumes
    the export (``--groups 1``) and trains the same 3 steps."""
    import os
    import sys

    import torch

    import deepshard.compat.deepspeed as ours
    from deepshard.compat.deepspeed.ds_export import export_checkpoint

    ours.init_distributed()
    rank, world = ours.comm.get_rank(), ours.comm.get_world_size()
    model = tiny_model(tied=True)
    ds_cfg = ds_config(stage, world)
    opt = ds_cfg["optimizer"]["params"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=opt["betas"], eps=opt["eps"],
                                  weight_decay=opt["weight_decay"])
    engine, *_ = ours.initialize(model=model, optimizer=optimizer,
                                 config={k: v for k, v in ds_cfg.items() if k != "optimizer"})
    train_steps(engine, range(SAVE_STEP), rank, world)
    engine.save_checkpoint(f"{root}/ours", client_state=dict(CLIENT_STATE))
    ours_after = train_steps(engine, range(SAVE_STEP, TOTAL_STEPS), rank, world)
    if rank == 0:
        export_checkpoint(f"{root}/ours/global_step{SAVE_STEP}", f"{root}/ds", stage=stage, world=world, num_groups=1)
    torch.distributed.barrier()

    sys.stdout.flush()
    os.dup2(2, 1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    m = tiny_model(seed=1, tied=True)
    ds, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=ds_cfg)
    path, client_state = ds.load_checkpoint(f"{root}/ds")
    assert path is not None and ds.global_steps == SAVE_STEP
    return {"ours": ours_after, "ds": train_steps(ds, range(SAVE_STEP, TOTAL_STEPS), rank, world),
            "client_state": {k: client_state.get(k) for k in CLIENT_STATE}}


def aligned_to_deepspeed_worker(root: str) -> dict:
    """Ours (TinyLM: odd parameter sizes; two groups, vectors undecayed; fp32) trains 3 steps, saves, trains 3
    more; DeepSpeed with ``zero_optimization.parameter_alignment`` (each parameter padded to 16 bytes in its
    flat groups) resumes the ``--parameter-alignment`` export and trains the same 3 steps."""
    import os
    import sys

    import torch
    import torch.nn.functional as F  # noqa: N812

    import deepshard.compat.deepspeed as ours
    from deepshard.compat.deepspeed.ds_export import export_checkpoint
    from tests.compat.ds_zero3_patterns_harness import TinyLM, batch

    ours.init_distributed()
    rank, world = ours.comm.get_rank(), ours.comm.get_world_size()
    cfg = {**ds_config(2, world), "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
           "zero_optimization": {"stage": 2, "parameter_alignment": True}}

    def steps(engine, which: range) -> list[float]:
        out = []
        for step in which:
            inputs, labels = batch(step, rank)
            loss = F.cross_entropy(engine(inputs.to(engine.device)).flatten(0, 1), labels.to(engine.device).flatten())
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            out.append(mean.item() / world)
        return out

    torch.manual_seed(0)
    model = TinyLM()
    engine, *_ = ours.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    steps(engine, range(SAVE_STEP))
    engine.save_checkpoint(f"{root}/ours")
    ours_after = steps(engine, range(SAVE_STEP, TOTAL_STEPS))
    if rank == 0:
        export_checkpoint(f"{root}/ours/global_step{SAVE_STEP}", f"{root}/ds", stage=2, world=world,
                          num_groups=2, parameter_alignment=True)
    torch.distributed.barrier()

    sys.stdout.flush()
    os.dup2(2, 1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    torch.manual_seed(1)
    m = TinyLM()
    ds, *_ = deepspeed.initialize(model=m, model_parameters=param_groups(m), config=cfg)
    path, _ = ds.load_checkpoint(f"{root}/ds")
    assert path is not None and ds.global_steps == SAVE_STEP
    paddings = ds.optimizer.round_robin_bit16_padding
    return {"ours": ours_after, "ds": steps(ds, range(SAVE_STEP, TOTAL_STEPS)), "paddings": paddings}
