"""Issue 34 item 4: checkpoint exchange with DeepSpeed on ordinary scripts, per rank of a gloo group."""

from __future__ import annotations

from ds_fixture_model import SAVE_STEP, TOTAL_STEPS, ds_config, tiny_model, train_steps


def resume_tied_worker(imported: str, stage: int) -> dict:
    """A fresh tied-embedding engine (other weights) at our ZeRO ``stage`` resumes the import of
    DeepSpeed's checkpoint and trains DeepSpeed's next steps."""
    import deepshard.compat.deepspeed as deepspeed

    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    model = tiny_model(seed=1, tied=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(stage, world))
    path, client_state = engine.load_checkpoint(imported)
    assert path is not None and engine.global_steps == SAVE_STEP
    step = client_state["step"]  # what the script reads back (DeepSpeedExamples' scripts: the epoch/step)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return {"client_state": client_state, "step": step, "tied": tied,
            "losses": train_steps(engine, range(SAVE_STEP, TOTAL_STEPS), rank, world)}


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
    from ds_zero3_patterns_harness import TinyLM, batch

    import deepshard.compat.deepspeed as deepspeed

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
    from ds_zero3_patterns_harness import TinyLM, batch

    import deepshard.compat.deepspeed as deepspeed

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
