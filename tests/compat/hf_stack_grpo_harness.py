"""What TRL's GRPO generation does to a ZeRO-3 engine, on each rank of a pool (tests/compat/test_hf_stack_grpo.py).

``trl.models.utils._unwrap_model_for_generation`` at ZeRO-3, step by step as TRL writes it:
``deepspeed.zero.GatheredParameters(model.parameters())``, ``remove_hooks(model)`` (``optimizer.
parameter_offload``: ``module``, ``ds_external_parameters()``, each parameter's ``ds_active_sub_modules``,
``forward_hooks``/``backward_hooks``), generate, ``add_hooks(model)`` (``param_coordinator.is_invalid_trace``/
``_invalidate_trace``, ``_register_deepspeed_module``).  The oracle is the plain model's greedy generation and
its loss, in this process, sharing no code with the engine."""

from __future__ import annotations

from typing import Any


def _block_params_gathered(model: Any, sharded: set[int]) -> list[bool]:
    """Per decoder layer: whether FSDP2 holds it gathered (its module has FSDP2's unsharded parameter in
    place of the sharded one, which ``GatheredParameters`` swaps in place and so keeps its identity)."""
    return [id(layer.mlp.up_proj.weight) not in sharded for layer in model.model.layers]


def generation_hooks() -> dict[str, Any]:
    import torch
    from trl.models.utils import add_hooks, remove_hooks

    import deepshard.compat.deepspeed as deepspeed
    from tests.compat.hf_trainer_harness import collate, rows, tiny_llama

    rank = torch.distributed.get_rank()
    prompt = torch.tensor([[5, 9, 3, 17], [12, 7, 7, 4]]) + rank
    batch = collate(rows(4)[2 * rank:][:2])
    plain = tiny_llama().eval()
    greedy = {"max_new_tokens": 6, "do_sample": False, "attention_mask": torch.ones_like(prompt), "pad_token_id": 0}
    with torch.no_grad():
        expected = plain.generate(prompt, **greedy)
        expected_loss = plain(**batch).loss.item()
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=tiny_llama(), config=config)
    offload = engine.optimizer.parameter_offload
    out: dict[str, Any] = {"units": len(offload.forward_hooks), "backward_hooks": len(offload.backward_hooks),
                           "module_is_model": offload.module is engine.module,
                           "external": list(offload.module.ds_external_parameters()),
                           "trace_invalid": offload.param_coordinator.is_invalid_trace()}
    engine.eval()
    sharded = {id(p) for p in engine.module.parameters()}
    with deepspeed.zero.GatheredParameters(engine.parameters()):  # TRL passes the engine's parameters
        remove_hooks(engine)
        out["hooks_after_remove"] = len(offload.forward_hooks)
        with torch.no_grad():
            got = engine.module.generate(prompt, **greedy)
        out["gathered_through_generation"] = _block_params_gathered(engine.module, sharded)
        out["active_sub_modules"] = sorted({len(p.ds_active_sub_modules) for p in engine.module.parameters()})
        add_hooks(engine)
    out["gathered_after"] = _block_params_gathered(engine.module, sharded)
    out["hooks_after_add"] = len(offload.forward_hooks)
    out["same_tokens"] = torch.equal(got, expected)
    engine.train()  # training forward/backward after: FSDP2's own gathering is back
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    out["loss_gap"] = abs(loss.item() - expected_loss)
    return out
