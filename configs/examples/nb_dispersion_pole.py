"""A negative-binomial count model (the scVI / DCA `log_nb_positive` likelihood for single-cell
counts): the dispersion theta = softplus(head(h)). For one cell with extreme library size the
head's output is below -104, softplus underflows to exactly 0 in float32, and lgamma(theta) hits
its pole at 0: lgamma(0) = inf, and lgamma(x + theta) - lgamma(theta) is inf - inf = NaN where the
count is 0."""
import torch
import torch.nn.functional as F
from torch import nn


class CountDecoder(nn.Module):
    def __init__(self, genes: int = 10, latent: int = 4):
        super().__init__()
        self.encoder = nn.Linear(genes, latent)
        self.mean = nn.Linear(latent, genes)
        self.dispersion = nn.Linear(latent, genes)

    def forward(self, counts):
        h = torch.tanh(self.encoder(torch.log1p(counts)))
        mu = torch.exp(self.mean(h))
        theta = F.softplus(self.dispersion(h) * counts.sum(1, keepdim=True).sqrt())
        return mu, theta


def log_nb_positive(x, mu, theta, eps=1e-8):
    log_theta_mu_eps = torch.log(theta + mu + eps)
    return (theta * (torch.log(theta + eps) - log_theta_mu_eps)
            + x * (torch.log(mu + eps) - log_theta_mu_eps)
            + torch.lgamma(x + theta) - torch.lgamma(theta) - torch.lgamma(x + 1))


def build_model():
    torch.manual_seed(0)
    return CountDecoder()


def batches():
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        counts = torch.poisson(torch.full((8, 10), 3.0), generator=g)
        if step == 1:
            counts[6] = torch.poisson(torch.full((10,), 3000.0), generator=g)   # a doublet
            counts[6, 2] = 0.0
        yield counts


def loss(model, counts):
    mu, theta = model(counts)
    return -log_nb_positive(counts, mu, theta).sum(1).mean()
