"""The shape of pytorch/examples dcgan/main.py, in miniature: a generator and a discriminator
ending in Sigmoid, `nn.BCELoss` (which raises on an input outside [0, 1], NaN included), two Adam
optimizers stepped in turn (the discriminator on two backward calls, real then fake, then the
generator through the discriminator). Run as `python dcgan_loop.py [--lr LR] [--iters N]`."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=2e-4)
parser.add_argument("--beta1", type=float, default=0.5)
parser.add_argument("--iters", type=int, default=6)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--manualSeed", type=int, default=1)
opt = parser.parse_args()
torch.manual_seed(opt.manualSeed)

nz, width = 4, 16
netG = nn.Sequential(nn.Linear(nz, 32), nn.BatchNorm1d(32), nn.ReLU(True), nn.Linear(32, width),
                     nn.Tanh())
netD = nn.Sequential(nn.Linear(width, 32), nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 32),
                     nn.BatchNorm1d(32), nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 1),
                     nn.Sigmoid())
criterion = nn.BCELoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
real_label, fake_label = 1.0, 0.0

for i in range(opt.iters):
    real = torch.rand(opt.batch_size, width) * 2 - 1
    netD.zero_grad()
    label = torch.full((opt.batch_size,), real_label)
    errD_real = criterion(netD(real).view(-1), label)
    errD_real.backward()
    fake = netG(torch.randn(opt.batch_size, nz))
    label.fill_(fake_label)
    errD_fake = criterion(netD(fake.detach()).view(-1), label)
    errD_fake.backward()
    optimizerD.step()

    netG.zero_grad()
    label.fill_(real_label)
    errG = criterion(netD(fake).view(-1), label)
    errG.backward()
    optimizerG.step()
    print(f"[{i}/{opt.iters}] Loss_D: {(errD_real + errD_fake).item():.4f} "
          f"Loss_G: {errG.item():.4f}")
