"""DeepSpeedExamples' CIFAR-10 MoE script (training/cifar/cifar10_deepspeed.py with ``--moe``), small and
offline, run by real DeepSpeed 0.19.8 (bench/record_ds_moe.py) and by deepshard (tests/compat/test_ds_moe_ep.py).

    deepshard --nproc 4 bench/bench_ds_moe_cifar.py --moe --ep-world-size 2 --num-experts 2 4 --top-k 1 \\
        --noisy-gate-policy RSample --moe-param-group --deepspeed

Kept from the original: its MoE flags (``--moe --ep-world-size --num-experts ... --mlp-type --top-k
--min-capacity --noisy-gate-policy --moe-param-group``), its ``Net`` (fc3 = ``Linear(84, 84)`` the expert
of one ``deepspeed.moe.layer.MoE`` per ``--num-experts`` entry, then fc4), ``create_moe_param_groups``,
the ds_config of the v0.19-era script (Adam, WarmupLR, clipping 1.0), ``initialize(training_data=)``
and its loop (the aux loss unused, as there).  Changed: ``import deepspeed`` is a parameter (``main(argv,
deepspeed)``; run as a script: ``import deepspeed``, which is deepshard's under the ``deepshard``
launcher); CIFAR-10 -> 64 random 3x32x32 images (nothing downloads); 1 epoch; ``--dtype fp32`` (DeepSpeed's
CPU accelerator would pick fp16); ``torch.manual_seed(0)`` before ``Net`` and ``torch.manual_seed(1)``
before the loop, so both sides draw the gates' noise (RSample's Gumbel, the random token selection) from
the same RNG state; no printing, plots or test-set evaluation; ``main`` returns this rank's losses.
Added: ``--ckpt_dir`` (save, resume a fresh engine from it, train one more epoch) and ``--load_dir``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812 - the script's own spelling


def add_argument(argv, deepspeed):
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=1, type=int, help="number of total epochs")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3], help="ZeRO optimization stage")
    parser.add_argument("--moe", default=False, action="store_true", help="use deepspeed mixture of experts (moe)")
    parser.add_argument("--ep-world-size", default=1, type=int, help="(moe) expert parallel world size")
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1], help="number of experts list, MoE related.")
    parser.add_argument("--mlp-type", type=str, default="standard",
                        help="Only applicable when num-experts > 1, accepts [standard, residual]")
    parser.add_argument("--top-k", default=1, type=int, help="(moe) gating top 1 and 2 supported")
    parser.add_argument("--min-capacity", default=0, type=int,
                        help="(moe) minimum capacity of an expert regardless of the capacity_factor")
    parser.add_argument("--noisy-gate-policy", default=None, type=str,
                        help="(moe) noisy gating (only supported with top-1). Valid values are None, RSample, and Jitter")
    parser.add_argument("--moe-param-group", default=False, action="store_true",
                        help="(moe) create separate moe param groups, required when using ZeRO w. MoE")
    parser.add_argument("--ckpt_dir", default=None, help="added: save, resume from it and train --epochs more")
    parser.add_argument("--load_dir", default=None, help="added: resume from this checkpoint instead of --ckpt_dir")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def get_ds_config(args):
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16"},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


def cifar_like(n: int = 64):
    g = torch.Generator().manual_seed(5)
    images = torch.randn(n, 3, 32, 32, generator=g)
    labels = torch.randint(10, (n,), generator=g)
    return [(images[i], int(labels[i])) for i in range(n)]


class Net(nn.Module):
    def __init__(self, args, deepspeed):
        super(Net, self).__init__()  # noqa: UP008 - the script's own spelling
        self.args = args
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        if args.moe:
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = []
            for n_e in args.num_experts:
                # create moe layers based on the number of experts
                self.moe_layer_list.append(
                    deepspeed.moe.layer.MoE(hidden_size=84, expert=fc3, num_experts=n_e, ep_size=args.ep_world_size,
                                            use_residual=args.mlp_type == "residual", k=args.top_k,
                                            min_capacity=args.min_capacity, noisy_gate_policy=args.noisy_gate_policy))
            self.moe_layer_list = nn.ModuleList(self.moe_layer_list)
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.args.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            x = self.fc4(x)
        else:
            x = self.fc3(x)
        return x


def create_moe_param_groups(model, deepspeed):
    split = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split(parameters)


def build(args, deepspeed, trainset, seed: int):
    torch.manual_seed(seed)
    net = Net(args, deepspeed)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = create_moe_param_groups(net, deepspeed)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=get_ds_config(args))
    return model_engine, trainloader


def train(args, model_engine, trainloader, local_device) -> list[float]:
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _epoch in range(args.epochs):
        for data in trainloader:
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    return losses


def main(argv, deepspeed) -> list[float] | dict[str, list[float]]:
    """One epoch of the script: this rank's per-step losses; with ``--ckpt_dir``, also the losses of one
    more epoch after ``save_checkpoint`` and ``load_checkpoint`` (from ``--load_dir`` if given) into a
    fresh engine on a Net from another seed (``--load_dir`` alone: no save)."""
    args = add_argument(argv, deepspeed)
    deepspeed.init_distributed()
    trainset = cifar_like()
    model_engine, trainloader = build(args, deepspeed, trainset, seed=0)
    local_device = deepspeed.accelerator.get_accelerator().device_name(model_engine.local_rank)
    torch.manual_seed(1)  # the gates' noise from the same RNG state on both sides
    losses = train(args, model_engine, trainloader, local_device)
    if args.ckpt_dir is None and args.load_dir is None:
        return losses
    if args.ckpt_dir is not None:
        model_engine.save_checkpoint(args.ckpt_dir)
    model_engine, trainloader = build(args, deepspeed, trainset, seed=2)
    load_path, _ = model_engine.load_checkpoint(args.load_dir or args.ckpt_dir)
    assert load_path is not None, f"no checkpoint in {args.load_dir or args.ckpt_dir}"
    torch.manual_seed(3)
    return {"losses": losses, "resumed": train(args, model_engine, trainloader, local_device)}


if __name__ == "__main__":
    import deepspeed as _deepspeed

    out = main(sys.argv[1:], _deepspeed)
    if int(os.environ.get("RANK", "0")) == 0:
        print("losses:", " ".join(f"{v:.6f}" for v in out))
