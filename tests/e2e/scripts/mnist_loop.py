"""The shape of pytorch/examples mnist/main.py, in miniature: a Dataset whose transform is an
nn.Module without parameters (torchvision's `transforms.Normalize` is one), called by the
DataLoader on each sample before the model runs; a conv net; Adadelta with StepLR; `--dry-run`.
Run as `python mnist_loop.py --data FILE [options]`; FILE holds `torch.save((images, labels))`,
images N x 1 x 8 x 8."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR


class Normalize(nn.Module):
    """As torchvision.transforms.Normalize: a module, with no parameters."""

    def __init__(self, mean, std):
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, tensor):
        return (tensor - self.mean) / self.std


class Digits(torch.utils.data.Dataset):
    def __init__(self, path, transform):
        self.images, self.labels = torch.load(path)
        self.transform = transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.transform(self.images[index]), int(self.labels[index])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.fc1 = nn.Linear(4 * 3 * 3, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        return F.log_softmax(self.fc1(torch.flatten(x, 1)), dim=1)


parser = argparse.ArgumentParser()
parser.add_argument("--data", required=True)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=1.0)
parser.add_argument("--gamma", type=float, default=0.7)
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--dry-run", action="store_true")
args = parser.parse_args()
torch.manual_seed(args.seed)

loader = torch.utils.data.DataLoader(Digits(args.data, Normalize(0.1307, 0.3081)),
                                     batch_size=args.batch_size, shuffle=True)
model = Net()
optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
for epoch in range(1, args.epochs + 1):
    model.train()
    for batch_idx, (data, target) in enumerate(loader):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(loader.dataset)}]\t"
              f"Loss: {loss.item():.6f}")
        if args.dry_run:
            break
    scheduler.step()
