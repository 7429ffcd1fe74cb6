"""The shape of Lightning's GAN template (examples/pytorch/domain_templates/
generative_adversarial_net.py, Apache-2.0), in miniature: manual optimization, the generator's
Adam then the discriminator's in one `training_step`, `toggle_optimizer` around each, a
generator of Linear / BatchNorm1d / LeakyReLU blocks ending in Tanh, logits and
`binary_cross_entropy_with_logits`. Random images stand in for MNIST (no torchvision, no
download). Run as `python lightning_gan.py [--lr LR] [--max-steps N]`."""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.0002)
parser.add_argument("--max-steps", type=int, default=6)
args = parser.parse_args()
LATENT, IMAGE = 8, 16


def block(in_feat, out_feat, normalize=True):
    layers = [nn.Linear(in_feat, out_feat)]
    if normalize:
        layers.append(nn.BatchNorm1d(out_feat, 0.8))
    layers.append(nn.LeakyReLU(0.2, inplace=True))
    return layers


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(*block(LATENT, 32, normalize=False), *block(32, 64),
                                   nn.Linear(64, IMAGE), nn.Tanh())

    def forward(self, z):
        return self.model(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(IMAGE, 32), nn.LeakyReLU(0.2, inplace=True),
                                   nn.Linear(32, 16), nn.LeakyReLU(0.2, inplace=True),
                                   nn.Linear(16, 1))

    def forward(self, img):
        return self.model(img.view(img.size(0), -1))


class GAN(L.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.lr = lr
        self.automatic_optimization = False
        self.generator = Generator()
        self.discriminator = Discriminator()

    def forward(self, z):
        return self.generator(z)

    def training_step(self, batch):
        imgs, = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(imgs.shape[0], LATENT).type_as(imgs)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)

        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z).detach()),
                                                       fake)
        d_loss = (real_loss + fake_loss) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=self.lr, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=self.lr, betas=(0.5, 0.999))
        return opt_g, opt_d


if __name__ == "__main__":
    torch.manual_seed(0)
    images = TensorDataset(torch.rand(64, IMAGE) * 2 - 1)
    trainer = L.Trainer(max_steps=args.max_steps, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(GAN(args.lr), DataLoader(images, batch_size=8))
