"""DeepSpeedExamples' training/gan/gan_deepspeed_train.py (DCGAN: two engines in one process, each over a
client ``torch.optim.Adam``; the discriminator's engine takes two ``backward`` calls per ``step``; the
modules are called directly, not through their engines), run per rank with ``deepspeed`` given as a
parameter (default: ``import deepshard.compat.deepspeed as deepspeed``; bench/record_ds_more_scripts.py
passes real DeepSpeed).  ``Generator`` / ``Discriminator`` / ``weights_init`` are the DCGAN of that
folder's gan_model.py (PyTorch's dcgan example): ConvTranspose2d/Conv2d stacks with BatchNorm, 64x64 images.

Lines changed, and why:
  - ``import deepspeed`` -> ``deepspeed`` parameter (the one import);
  - ``--dataset fake`` (torchvision's FakeData) -> ``fake_images``: random 3x64x64 images in [0, 1]
    (torchvision does not import beside this machine's torch; FakeData is random images too);
  - sizes: ngf 64 -> 4, ndf 64 -> 4, nz 100 -> 8, batchSize 64 -> 8, 16 images, one epoch (2 steps);
  - ``torch.cuda.set_device`` / ``device = torch.device("cuda", local_rank)`` -> the accelerator's device
    name (no GPU here); ``cudnn.benchmark``, ``torch.cuda.synchronize``, ``vutils.save_image``, the
    TensorBoard writer, ``create_folder`` and the timing print dropped (no effect on training);
  - the ds_config file of ``--deepspeed_config``: the folder's JSON is not in our copy; written as
    ``{"train_batch_size": 16, "steps_per_print": 10}`` (the script passes its own optimizers);
  - ``train`` returns each step's (errD, errG, D_x, D_G_z1, D_G_z2) instead of printing them.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch
import torch.nn as nn

import deepshard.compat.deepspeed as ours


class Generator(nn.Module):
    def __init__(self, ngpu, ngf, nc, nz):
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh(),
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ngpu, ndf, nc):
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False), nn.Sigmoid(),
        )

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        m.weight.data.normal_(0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        m.weight.data.normal_(1.0, 0.02)
        m.bias.data.fill_(0)


def get_argument_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", default="fake")
    parser.add_argument("--dataroot", default=None)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batchSize", type=int, default=64)
    parser.add_argument("--imageSize", type=int, default=64)
    parser.add_argument("--nz", type=int, default=100)
    parser.add_argument("--ngf", type=int, default=64)
    parser.add_argument("--ndf", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.0002)
    parser.add_argument("--beta1", type=float, default=0.5)
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--netG", default="")
    parser.add_argument("--netD", default="")
    parser.add_argument("--manualSeed", type=int, default=999)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


def set_seed(value):
    random.seed(value)
    torch.manual_seed(value)


def fake_images(n: int, size: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.rand(3, size, size, generator=g), 0) for _ in range(n)]


def train(args, deepspeed):
    get_accelerator = deepspeed.accelerator.get_accelerator
    set_seed(args.manualSeed)
    dataset, nc = fake_images(16, args.imageSize), 3
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=args.batchSize, shuffle=True,
                                             num_workers=int(args.workers))
    get_accelerator().set_device(args.local_rank)
    device = torch.device(get_accelerator().device_name(args.local_rank))
    ngpu = 0
    nz, ngf, ndf = int(args.nz), int(args.ngf), int(args.ndf)

    netG = Generator(ngpu, ngf, nc, nz).to(device)  # noqa: N806 - the script's names
    netG.apply(weights_init)
    netD = Discriminator(ngpu, ndf, nc).to(device)  # noqa: N806
    netD.apply(weights_init)
    criterion = nn.BCELoss()
    real_label, fake_label = 1, 0

    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))  # noqa: N806
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))  # noqa: N806
    model_engineD, optimizerD, _, _ = deepspeed.initialize(args=args, model=netD,  # noqa: N806
                                                           model_parameters=netD.parameters(), optimizer=optimizerD)
    model_engineG, optimizerG, _, _ = deepspeed.initialize(args=args, model=netG,  # noqa: N806
                                                           model_parameters=netG.parameters(), optimizer=optimizerG)
    rows = []
    for epoch in range(args.epochs):  # noqa: B007
        for i, data in enumerate(dataloader, 0):  # noqa: B007
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            real = data[0].to(device)
            batch_size = real.size(0)
            label = torch.full((batch_size,), real_label, dtype=real.dtype, device=device)
            output = netD(real)
            errD_real = criterion(output, label)  # noqa: N806
            model_engineD.backward(errD_real)
            D_x = output.mean().item()  # noqa: N806
            noise = torch.randn(batch_size, nz, 1, 1, device=device)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)  # noqa: N806
            model_engineD.backward(errD_fake)
            D_G_z1 = output.mean().item()  # noqa: N806
            errD = errD_real + errD_fake  # noqa: N806
            model_engineD.step()
            # (2) Update G network: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(real_label)
            output = netD(fake)
            errG = criterion(output, label)  # noqa: N806
            model_engineG.backward(errG)
            D_G_z2 = output.mean().item()  # noqa: N806
            model_engineG.step()
            rows.append([errD.item(), errG.item(), D_x, D_G_z1, D_G_z2])
    return rows


def gan_main(argv, deepspeed=ours):
    parser = get_argument_parser()
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    return train(args, deepspeed)


def gan_argv(config_dir: str) -> list[str]:
    """Writes the ds_config file the run names (per rank: ranks may not share a directory)."""
    path = os.path.join(config_dir, f"gan_deepspeed_config.rank{os.environ.get('RANK', '0')}.json")
    with open(path, "w") as f:
        json.dump({"train_batch_size": 16, "steps_per_print": 10}, f)
    return ["--dataset", "fake", "--batchSize", "8", "--nz", "8", "--ngf", "4", "--ndf", "4", "--epochs", "1",
            "--local_rank", os.environ.get("LOCAL_RANK", "0"), "--deepspeed", "--deepspeed_config", path]
