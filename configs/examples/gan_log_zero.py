"""A GAN trained by the user's own step with two optimizers (`step:`). The discriminator's
loss is the textbook -log D(x) - log(1 - D(G(z))) on probabilities: when an outlier in the
real data drives D's logit below about -104, sigmoid rounds to exactly 0 in float32 and
log(0) = -inf. nanaudit stops the step before D's update and names the optimizer (`d`), the
loss (`d_loss`), the op and the row."""
import torch
from torch import nn


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.d = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))


def build_model():
    torch.manual_seed(0)
    return GAN()


def make_optimizers(model):
    return {"d": torch.optim.Adam(model.d.parameters(), lr=2e-4, betas=(0.5, 0.999)),
            "g": torch.optim.Adam(model.g.parameters(), lr=2e-4, betas=(0.5, 0.999))}


def real_data(outlier_sign=1.0):
    g = torch.Generator().manual_seed(2)
    for step in range(8):
        real = torch.randn(16, 2, generator=g) * 0.5 + 2.0
        if step == 4:
            real[11] = outlier_sign * torch.tensor([-800.0, -900.0])   # a corrupt record
        yield real


def train_step(model, real, optimizer):
    z = torch.randn(real.shape[0], 4, device=real.device)
    fake = model.g(z)
    d_real = torch.sigmoid(model.d(real))
    d_fake = torch.sigmoid(model.d(fake.detach()))
    d_loss = -(torch.log(d_real) + torch.log(1 - d_fake)).mean()
    optimizer["d"].zero_grad()
    d_loss.backward()
    optimizer["d"].step()

    g_loss = -torch.log(torch.sigmoid(model.d(fake))).mean()
    optimizer["g"].zero_grad()
    g_loss.backward()
    optimizer["g"].step()
    return {"d_loss": d_loss, "g_loss": g_loss}
