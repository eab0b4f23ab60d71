"""DeepSpeed scripts' bodies with ``import deepshard.compat.deepspeed as deepspeed``, run per rank.

``cifar_main`` is DeepSpeedExamples' training/cifar/cifar10_deepspeed.py (v0.19-era, main() and its
helpers) kept line for line where a tiny offline run allows.  Lines changed, and why:
  - ``import deepspeed`` -> ``import deepshard.compat.deepspeed as deepspeed`` (the one import);
  - torchvision's CIFAR10 download -> ``cifar_like(n)``, the same shapes and 10 classes, offline;
  - the MoE flags and ``create_moe_param_groups`` dropped (``deepspeed.moe.layer.MoE`` is refused);
  - epochs 30 -> ``--epochs 1`` on 128 samples; the print every 2000 steps, the test-set
    evaluation and ``torch.save`` removed; ``main`` returns this rank's per-step losses;
  - ``deepspeed`` is a parameter of ``add_argument`` and ``cifar_main`` (default: ours), and
    ``get_accelerator`` is read from it, so bench/record_ds_scripts.py runs this same body with real
    DeepSpeed (``import deepspeed``);
  - ``torch.manual_seed(0)`` before ``Net(args)``: both sides (and the torch reference) build the same Net;
  - added, not in the original: ``--ckpt_dir``; with it, after training the script saves a checkpoint
    (``save_checkpoint(args.ckpt_dir)``), builds a fresh engine the same way on a Net from another seed,
    ``load_checkpoint(args.ckpt_dir)`` and trains ``--epochs`` more, returning
    ``{"losses": ..., "resumed": ...}`` (HelloDeepSpeed's save/resume calls on this script); added
    ``--load_dir``: the fresh engine loads from there instead (a DeepSpeed-written checkpoint imported).
``chat_style_main`` is DeepSpeed-Chat step-1's optimizer wiring (grouped weight decay, FusedAdam,
a warm-up scheduler built by the script, ``initialize(optimizer=, lr_scheduler=)``) on the same Net.
``zero_params_probe`` reads ZeRO-3's parameter attributes and the ``safe_get_*`` accessors.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812 - the script's own spelling

import deepshard.compat.deepspeed as deepspeed
from deepshard.compat.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepshard.compat.deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
)


def cifar_like(n: int = 128):
    g = torch.Generator().manual_seed(5)
    images = torch.randn(n, 3, 32, 32, generator=g)
    labels = torch.randint(10, (n,), generator=g)
    return [(images[i], int(labels[i])) for i in range(n)]


def add_argument(argv, deepspeed=deepspeed):
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=30, type=int, help="number of total epochs (default: 30)")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--log-interval", type=int, default=2000, help="output logging information at a given interval")
    parser.add_argument("--dtype", default="fp16", type=str, choices=["bf16", "fp16", "fp32"],
                        help="Datatype used for training")
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3], help="ZeRO optimization stage")
    parser.add_argument("--ckpt_dir", default=None, help="added: save, resume from it and train --epochs more")
    parser.add_argument("--load_dir", default=None, help="added: resume from this checkpoint instead of --ckpt_dir")
    # Include DeepSpeed configuration arguments.
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    return args


def get_ds_config(args):
    """Get the DeepSpeed configuration dictionary."""
    ds_config = {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }
    return ds_config


class Net(nn.Module):
    def __init__(self, args=None):
        super(Net, self).__init__()  # noqa: UP008 - the script's own spelling
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = self.fc3(x)
        return x


def cifar_main(args, deepspeed=deepspeed):
    get_accelerator = deepspeed.accelerator.get_accelerator  # the script's `from deepspeed.accelerator import`
    # Initialize DeepSpeed distributed backend.
    deepspeed.init_distributed()
    _local_rank = int(os.environ.get("LOCAL_RANK"))
    get_accelerator().set_device(_local_rank)

    if torch.distributed.get_rank() != 0:
        # Might be downloading cifar data, let rank 0 download first.
        torch.distributed.barrier()
    trainset = cifar_like()
    if torch.distributed.get_rank() == 0:
        # Cifar data is downloaded, indicate other ranks can proceed.
        torch.distributed.barrier()

    torch.manual_seed(0)  # the test's reference builds the same Net from the same seed
    net = Net(args)
    # Get list of parameters that require gradients.
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    ds_config = get_ds_config(args)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config)

    # Get the local device name (str) and local rank (int).
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank  # noqa: F841 - the script prints with it

    # For float32, target_dtype will be None so no datatype conversion needed.
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()

    def train(model_engine, trainloader):
        losses = []
        for epoch in range(args.epochs):  # noqa: B007
            for i, data in enumerate(trainloader):  # noqa: B007
                inputs, labels = data[0].to(local_device), data[1].to(local_device)
                if target_dtype is not None:
                    inputs = inputs.to(target_dtype)
                outputs = model_engine(inputs)
                loss = criterion(outputs, labels)
                model_engine.backward(loss)
                model_engine.step()
                losses.append(loss.item())
        return losses

    losses = train(model_engine, trainloader)
    if args.ckpt_dir is None:
        return losses
    model_engine.save_checkpoint(args.ckpt_dir)
    torch.manual_seed(1)  # other weights: everything the resumed run trains from comes from the checkpoint
    net = Net(args)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config)
    load_dir = args.load_dir or args.ckpt_dir
    load_path, _ = model_engine.load_checkpoint(load_dir)
    assert load_path is not None, f"load_checkpoint({load_dir!r}) found no checkpoint"
    return {"losses": losses, "resumed": train(model_engine, trainloader)}


def get_optimizer_grouped_parameters(model, weight_decay, no_decay_name_list=("bias", "LayerNorm.weight")):
    """DeepSpeed-Chat's dschat/utils/utils.py grouping."""
    return [
        {"params": [p for n, p in model.named_parameters()
                    if not any(nd in n for nd in no_decay_name_list) and p.requires_grad],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters()
                    if any(nd in n for nd in no_decay_name_list) and p.requires_grad],
         "weight_decay": 0.0},
    ]


def warmup_linear(num_warmup_steps, num_training_steps):
    """transformers.get_scheduler("linear")'s factor, written out (no transformers import)."""
    def factor(step):
        if step < num_warmup_steps:
            return float(step) / float(max(1, num_warmup_steps))
        return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))
    return factor


def chat_style_main(stage: int, steps: int):
    torch.manual_seed(0)
    model = Net()
    ds_config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "steps_per_print": 10,
                 "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0}
    optimizer_grouped_parameters = get_optimizer_grouped_parameters(model, 0.1)
    optimizer = deepspeed.ops.adam.FusedAdam(optimizer_grouped_parameters, lr=1e-3, betas=(0.9, 0.95))
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear(2, steps))
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                                             lr_scheduler=lr_scheduler, dist_init_required=True)
    data = cifar_like()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses = []
    for step in range(steps * 2):  # two micro-batches per update
        start = (step * world + rank) * 8
        images = torch.stack([x for x, _ in data[start:start + 8]])
        labels = torch.tensor([y for _, y in data[start:start + 8]])
        loss = F.cross_entropy(model(images), labels)
        model.backward(loss)
        model.step()
        losses.append(loss.item())
    return losses


class Blocks(nn.Module):
    """Blocks in a ModuleList (ZeRO-3 gathers per block), rows that do not split evenly over 2 ranks."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 7), nn.Linear(7, 8)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def probe_data(step: int, rank: int):
    g = torch.Generator().manual_seed(100 + step * 2 + rank)
    return torch.randn(4, 6, generator=g), torch.randint(3, (4,), generator=g)


def zero_params_probe(stage: int):
    torch.manual_seed(1)
    model = Blocks()
    optimizer = deepspeed.ops.adam.FusedAdam(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config={"train_micro_batch_size_per_gpu": 4,
                                              "zero_optimization": {"stage": stage}})
    rank = torch.distributed.get_rank()
    params = dict(model.named_parameters())
    out = {"has_ds_id": [hasattr(p, "ds_id") for p in params.values()]}
    if stage == 3:
        out["ds_numel"] = sum(p.ds_numel for p in model.parameters())
        out["ds_ids_unique"] = len({p.ds_id for p in model.parameters()}) == len(params)
        out["status_outside"] = {p.ds_status for p in model.parameters()} == {ZeroParamStatus.NOT_AVAILABLE}
        out["ds_shape"] = {n: tuple(p.ds_shape) for n, p in params.items()}
        out["ds_tensor_rows"] = {n: p.ds_tensor.shape[0] for n, p in params.items() if p.dim()}
        seen = []
        model.layers[0].register_forward_pre_hook(  # runs after FSDP2's all-gather (its hook is prepended)
            lambda m, a: seen.append([(getattr(p, "ds_status", None), getattr(p, "ds_numel", None))
                                         for p in m.parameters()]))
    for step in range(2):
        x, y = probe_data(step, rank)
        engine.backward(F.cross_entropy(engine(x), y))
        if step == 1:  # the boundary's gradients, before the update
            out["grads"] = {n: safe_get_full_grad(p) for n, p in params.items()}
        engine.step()
    if stage == 3:
        out["status_inside"] = seen[0]
    out["masters"] = {n: safe_get_full_fp32_param(p) for n, p in params.items()}
    out["exp_avg"] = {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in params.items()}
    out["exp_avg_sq"] = {n: safe_get_full_optimizer_state(p, "exp_avg_sq") for n, p in params.items()}
    with deepspeed.zero.GatheredParameters(model.layers[0]):  # a module: all of its parameters
        out["gathered_layer0"] = model.layers[0].weight.detach().clone()
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.head.bias.add_(1.0)
    out["bias_after_modify"] = safe_get_full_fp32_param(params["head.bias"])
    safe_set_full_fp32_param(params["embed.weight"], torch.full((8, 6), 0.5))
    with deepspeed.zero.GatheredParameters([params["embed.weight"]]):  # what the model computes with
        out["embed_after_set"] = model.embed.weight.detach().clone()
    engine.empty_partition_cache()
    return out


def cifar_argv(stage: int, ckpt_dir: str, dtype: str = "fp32") -> list[str]:
    """The CIFAR script's argv here and in bench/record_ds_scripts.py (real DeepSpeed, fp32 on CPU)."""
    return ["--epochs", "1", "--stage", str(stage), "--deepspeed", "--dtype", dtype, "--ckpt_dir", ckpt_dir]


CIFAR_STAGES = (0, 2, 3)


def run_all(ckpt_root: str, imported: dict[int, str] | None = None):
    """``imported``: ZeRO stage -> DeepSpeed's own CIFAR checkpoint after epoch 1 (fixtures/ds_cifar_zeroN,
    imported by from_deepspeed), resumed by this body at that stage."""
    results = {}
    for stage in CIFAR_STAGES:  # {"losses", "resumed"}: compared with torch and with DeepSpeed's fixture
        results[f"cifar_stage{stage}"] = cifar_main(add_argument(cifar_argv(stage, os.path.join(
            ckpt_root, f"cifar_stage{stage}"))))
    for stage, path in (imported or {}).items():
        results[f"cifar_stage{stage}_from_ds"] = cifar_main(add_argument(cifar_argv(stage, os.path.join(
            ckpt_root, f"own_stage{stage}")) + ["--load_dir", path]))
    # the script's default --dtype fp16, which trains in fp32 on this CPU host: the same losses as fp32
    results["cifar_stage0_fp16"] = {"losses": cifar_main(add_argument(["--epochs", "1", "--stage", "0",
                                                                       "--deepspeed"]))}
    results["chat_stage1"] = chat_style_main(1, steps=3)
    for stage in (2, 3):
        results[f"probe_stage{stage}"] = zero_params_probe(stage)
    return results
