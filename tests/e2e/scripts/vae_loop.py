"""The shape of pytorch/examples vae/main.py, in miniature: the reparameterization draws
`randn_like` inside the model's forward; the loss function takes the model's three outputs
(BCE of the reconstruction plus the KL term of `logvar.exp()`); `loss.item()` is summed before
`optimizer.step()`; each epoch ends with a test pass under `no_grad` and a sample decoded from
`torch.randn`, saved under results/. Run as `python vae_loop.py --data FILE [options]`; FILE
holds `torch.save(images)`, images N x 1 x 8 x 8 in [0, 1] (torchvision's MNIST, ToTensor and
save_image replaced by a tensor file and torch.save)."""

import argparse
import os

import torch
import torch.utils.data
from torch import nn, optim
from torch.nn import functional as F

parser = argparse.ArgumentParser(description='VAE MNIST Example')
parser.add_argument('--data', required=True)
parser.add_argument('--batch-size', type=int, default=16, metavar='N')
parser.add_argument('--epochs', type=int, default=2, metavar='N')
parser.add_argument('--seed', type=int, default=1, metavar='S')
parser.add_argument('--log-interval', type=int, default=1, metavar='N')
args = parser.parse_args()

torch.manual_seed(args.seed)
images = torch.load(args.data)
train_loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(images[:48], torch.zeros(48)),
    batch_size=args.batch_size, shuffle=True)
test_loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(images[48:], torch.zeros(len(images) - 48)),
    batch_size=args.batch_size, shuffle=False)


def save_image(tensor, path):
    torch.save(tensor, path)


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc21 = nn.Linear(32, 4)
        self.fc22 = nn.Linear(32, 4)
        self.fc3 = nn.Linear(4, 32)
        self.fc4 = nn.Linear(32, 64)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 64))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


model = VAE()
optimizer = optim.Adam(model.parameters(), lr=1e-3)


def loss_function(recon_x, x, mu, logvar):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 64), reduction='sum')
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


def train(epoch):
    model.train()
    train_loss = 0
    for batch_idx, (data, _) in enumerate(train_loader):
        optimizer.zero_grad()
        recon_batch, mu, logvar = model(data)
        loss = loss_function(recon_batch, data, mu, logvar)
        loss.backward()
        train_loss += loss.item()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print(f'Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}]\tLoss: {loss.item() / len(data):.6f}')
    print(f'====> Epoch: {epoch} Average loss: {train_loss / len(train_loader.dataset):.4f}')


def test(epoch):
    model.eval()
    test_loss = 0
    with torch.no_grad():
        for i, (data, _) in enumerate(test_loader):
            recon_batch, mu, logvar = model(data)
            test_loss += loss_function(recon_batch, data, mu, logvar).item()
            if i == 0:
                save_image(recon_batch[:4], 'results/reconstruction_' + str(epoch) + '.pt')
    test_loss /= len(test_loader.dataset)
    print(f'====> Test set loss: {test_loss:.4f}')


if __name__ == "__main__":
    os.makedirs('results', exist_ok=True)
    for epoch in range(1, args.epochs + 1):
        train(epoch)
        test(epoch)
        with torch.no_grad():
            sample = model.decode(torch.randn(8, 4))
            save_image(sample, 'results/sample_' + str(epoch) + '.pt')
