"""Issue 32: the DeepSpeed names scripts touch, with DeepSpeed's meanings (or a refusal naming them).

In-process (a 1-rank group), each against plain torch written here or DeepSpeed 0.19.8's source
(its ``add_config_arguments``, ``RepeatingLoader``, ``set_random_seed`` and FusedAdam/CPUAdam math).
The ZeRO 1-3 parts (parameter attributes, ``safe_get_*``) run at world 2 in test_ds_zero_params.
"""

from __future__ import annotations

import argparse
import random

import numpy
import pytest
import torch
from torch import nn

import deepshard.compat.deepspeed as deepspeed
from deepshard.compat.deepspeed.runtime.utils import set_random_seed
from deepshard.compat.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepshard.compat.deepspeed.utils import RepeatingLoader

DS = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 7}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))

    def describe(self) -> str:  # reached through the engine, as DeepSpeed's __getattr__ passes through
        return "tiny"


def data(steps: int = 4):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 6, generator=g), torch.randint(3, (4,), generator=g)) for _ in range(steps)]


def test_add_config_arguments_is_deepspeeds():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == (True, "ds.json", False,
                                                                                              None)
    assert parser.parse_args([]).deepspeed is False


def test_repeating_loader_restarts():
    loader = RepeatingLoader(torch.utils.data.DataLoader(list(range(5)), batch_size=2))
    got = [next(loader).tolist() for _ in range(5)]
    assert got == [[0, 1], [2, 3], [4], [0, 1], [2, 3]]
    assert deepspeed.utils.RepeatingLoader is RepeatingLoader


def test_set_random_seed_seeds_random_numpy_torch():
    set_random_seed(2**40 + 5)  # larger than numpy accepts: DeepSpeed reduces it mod 2**32
    a = (random.random(), numpy.random.rand(), torch.rand(1).item())
    random.seed(2**40 + 5)
    numpy.random.seed((2**40 + 5) % 2**32)
    torch.manual_seed(2**40 + 5)
    assert a == (random.random(), numpy.random.rand(), torch.rand(1).item())


def test_accelerator_answers_for_this_host():
    acc = deepspeed.get_accelerator()
    assert acc is deepspeed.accelerator.get_accelerator()
    assert acc.device_name() == "cpu" and acc.device_name(1) == "cpu"
    assert acc.communication_backend_name() == "gloo"
    assert acc.is_bf16_supported() and not acc.is_fp16_supported()  # fp16 trains in fp32 on CPU
    acc.set_device(0)
    acc.empty_cache()
    acc.manual_seed(11)
    x = torch.rand(3)
    acc.manual_seed_all(11)
    assert torch.equal(x, torch.rand(3))
    with pytest.raises(AttributeError, match="not provided"):
        acc.create_graph()


@pytest.mark.parametrize("cls", ["FusedAdam", "DeepSpeedCPUAdam"])
@pytest.mark.parametrize("adamw", [True, False])
def test_ds_adam_classes_step_like_deepspeed(cls, adamw):
    """DeepSpeed's Adam math: adam_w_mode decoupled decay, else L2 added to the gradient (torch's Adam)."""
    torch.manual_seed(0)
    ours, ref = Tiny(), Tiny()
    ref.load_state_dict(ours.state_dict())
    mode = {"adam_w_mode": adamw} if cls == "FusedAdam" else {"adamw_mode": adamw}
    opt = getattr(deepspeed.ops.adam, cls)(ours.parameters(), lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, **mode)
    ref_opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(ref.parameters(), lr=1e-2, betas=(0.8, 0.99),
                                                                  weight_decay=0.1)
    for x, y in data():
        for model, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            o.step()
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="amsgrad"):
        getattr(deepspeed.ops.adam, cls)(Tiny().parameters(), amsgrad=True)


def test_zero_param_status_and_moe_refusals():
    assert [s.value for s in ZeroParamStatus] == [1, 2, 3]  # AVAILABLE, NOT_AVAILABLE, INFLIGHT
    assert deepspeed.runtime.zero.partition_parameters.ZeroParamStatus is ZeroParamStatus
    with pytest.raises(ValueError, match=r"use_tutel=True: not built here"):  # the layer itself: tests/compat/test_ds_moe.py
        deepspeed.moe.layer.MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, use_tutel=True)
    with pytest.raises(ValueError, match=r"ep_size=2: expert parallelism needs an initialized process group"):
        deepspeed.moe.layer.MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, ep_size=2)


@pytest.mark.parametrize("make, match", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), r"SGD\): not supported"),
    (lambda ps: deepspeed.ops.adam.FusedAdam(ps, adam_w_mode=False, weight_decay=0.1), "adam_w_mode=True"),
    (lambda ps: torch.optim.AdamW([{"params": ps[:2], "lr": 1e-3}, {"params": ps[2:], "lr": 1e-2}]),
     "different 'lr'"),
    (lambda ps: torch.optim.RMSprop(ps), "only Adam-family"),
])
def test_optimizers_we_cannot_map_are_refused(make, match):
    model = Tiny()
    with pytest.raises(ValueError, match=match):
        deepspeed.initialize(model=model, optimizer=make(list(model.parameters())), config=dict(DS))


def reference_losses(steps, make_opt, make_sched, clip=0.0):
    torch.manual_seed(0)
    model = Tiny()
    opt = make_opt(model.parameters())
    sched = make_sched(opt)
    losses, norms = [], []
    for x, y in data(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item())
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, norms


def lambda_schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))


@pytest.mark.parametrize("as_callable", [False, True])
def test_script_optimizer_and_scheduler_drive_the_engine(as_callable):
    """FusedAdam + a torch LambdaLR built by the script (DeepSpeed-Chat's pattern) equal torch's AdamW loop."""
    torch.manual_seed(0)
    model = Tiny()
    opt = deepspeed.ops.adam.FusedAdam(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    sched = lambda_schedule if as_callable else lambda_schedule(opt)
    engine, _, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                                      config={**DS, "gradient_clipping": 0.5})
    assert engine.lr_scheduler is lr_scheduler and lr_scheduler.optimizer is opt
    losses, norms = [], []
    for x, y in data():
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    ref_losses, ref_norms = reference_losses(
        4, lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0), lambda_schedule, clip=0.5)
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert engine.get_lr() == pytest.approx([1e-2 / 5])


def test_engine_queries_and_passthrough(capsys):
    model = Tiny()
    config = {**DS, "fp16": {"enabled": True}, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}
    engine, _, _, sched = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert not engine.fp16_enabled()  # an fp16 ds_config trains in fp32 on a CPU host (the notice says so)
    assert not engine.bfloat16_enabled()
    assert engine.zero_optimization_stage() == 1 and engine.zero_optimization()
    assert engine.config == config and engine.steps_per_print() == 7
    assert engine.get_global_grad_norm() is None  # before the first update, as in DeepSpeed
    assert engine.describe() == "tiny"  # module attributes pass through
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        _ = engine.nonexistent
    with pytest.raises(AttributeError, match="gradient_checkpointing_enable"):
        engine.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="pipeline engine"):
        engine.train_batch(iter([]))
    for x, y in data(3):
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
    assert engine.tput_timer.global_step_count == 3 and engine.tput_timer.avg_samples_per_sec() > 0
    assert engine.get_global_grad_norm() > 0
    assert sched.get_last_lr() == engine.get_lr()
    with pytest.raises(ValueError, match="advanced by engine.step"):
        sched.step()
    engine.empty_partition_cache()


def test_gradient_checkpointing_passthrough_keeps_non_reentrant():
    seen = {}

    class WithCheckpointing(Tiny):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            seen.update(gradient_checkpointing_kwargs)

    model = WithCheckpointing()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=dict(DS))
    engine.gradient_checkpointing_enable()
    assert seen == {"use_reentrant": False}
    with pytest.raises(ValueError, match="use_reentrant=True"):
        engine.gradient_checkpointing_enable({"use_reentrant": True})


def test_client_scheduler_resumes_from_a_checkpoint(tmp_path):
    """DeepSpeed saves the client lr_scheduler's state; a resumed run continues the same rates and losses."""
    def run(load: bool, steps: range):
        torch.manual_seed(0)
        model = Tiny()
        opt = deepspeed.ops.adam.FusedAdam(model.parameters(), lr=1e-2)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=lambda_schedule(opt),
                                          config=dict(DS))
        if load:
            engine.load_checkpoint(tmp_path)
        losses = []
        for k, (x, y) in enumerate(data(4)):
            if k not in steps:
                continue
            loss = nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if k == 1 and not load:
                engine.save_checkpoint(tmp_path)
        return losses, engine.get_lr()

    whole, lr_whole = run(False, range(4))
    resumed, lr_resumed = run(True, range(2, 4))
    assert resumed == pytest.approx(whole[2:], abs=1e-7) and lr_resumed == pytest.approx(lr_whole)



def test_script_stepped_scheduler_resumes_at_the_saved_rate(tmp_path):
    """transformers' Trainer: its scheduler, not given to initialize, is stepped by the script over the optimizer's
    groups and restored by its own ``load_state_dict`` (which sets no rate): the checkpoint's optimizer groups
    give the next update's rate, as DeepSpeed's load restores them (without it the resumed update used the
    schedule's first rate)."""
    def run(load: bool, steps: range):
        torch.manual_seed(0)
        model = Tiny()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=dict(DS))
        sched = lambda_schedule(opt)
        if load:
            engine.load_checkpoint(tmp_path)
            sched.load_state_dict(saved)
        losses = []
        for k, (x, y) in enumerate(data(4)):
            if k not in steps:
                continue
            loss = nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            sched.step()
            losses.append(loss.item())
            if k == 1 and not load:
                engine.save_checkpoint(tmp_path)
                saved.update(sched.state_dict())
        return losses

    saved: dict = {}
    whole = run(False, range(4))
    assert run(True, range(2, 4)) == pytest.approx(whole[2:], abs=1e-7)


class Shared(nn.Module):
    """A block uses a parameter it does not own (DeepSpeed scripts register it as external)."""

    def __init__(self, owner: str) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 6)
        self.layers = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.owner = owner
        shared = self.embed.weight if owner == "root" else self.layers[0].weight
        deepspeed.zero.register_external_parameter(self.layers[1], shared)

    def forward(self, x):
        shared = self.embed.weight if self.owner == "root" else self.layers[0].weight
        x = self.layers[0](self.embed(x))
        return self.layers[1](x) + x @ shared.t()


def test_register_external_parameter_at_zero3():
    """A root parameter used inside a block is gathered for the whole forward (accepted, trains); a block's
    parameter used by another block is only gathered in its own: refused, naming the fix."""
    z3 = {**DS, "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=Shared("root"), config=z3)
    x = torch.randn(4, 6)
    engine.backward(engine(x).square().mean())
    engine.step()
    with pytest.raises(ValueError, match=r"register_external_parameter\(Linear, <param of block 0 \(weight\)>\).*"
                                         r"move the shared parameter out of the blocks"):
        deepspeed.initialize(model=Shared("block"), config=z3)


def test_optimizer_as_a_callable_of_the_parameters():
    """DeepSpeed's optimizer=Callable: called with model_parameters, its result mapped like an instance."""
    torch.manual_seed(0)
    model = Tiny()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=dict(DS),
                                      optimizer=lambda ps: deepspeed.ops.adam.FusedAdam(ps, lr=1e-2, betas=(0.9, 0.95)))
    losses = []
    for x, y in data():
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    ref, _ = reference_losses(4, lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0),
                              lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0))
    assert losses == pytest.approx(ref, abs=1e-6)
