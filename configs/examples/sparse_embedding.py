"""Issue 15: a recommender with sparse embeddings (`nn.Embedding(sparse=True)`, trained by
`torch.optim.SparseAdam`, which takes only sparse gradients). The loss adds a small penalty on
each user vector's length, written by hand as sqrt(sum(u * u)). A cold-start user's vector is
all zeros: sqrt(0) is finite, so the loss is too, but the derivative of sqrt at 0 is infinite
and only the sparse gradient of `users.weight` goes NaN."""
import torch
from torch import nn

COLD_USER = 7


class Recommender(nn.Module):
    def __init__(self, users=40, items=60, width=8):
        super().__init__()
        self.users = nn.Embedding(users, width, sparse=True)
        self.items = nn.Embedding(items, width, sparse=True)

    def forward(self, user, item):
        u, v = self.users(user), self.items(item)
        length = torch.sqrt((u * u).sum(dim=-1))
        return (u * v).sum(dim=-1), length


def build_model():
    torch.manual_seed(0)
    model = Recommender()
    with torch.no_grad():
        model.users.weight[COLD_USER] = 0.0     # a user with no history yet
    return model


def make_optimizer(model, lr=0.01):
    return torch.optim.SparseAdam(model.parameters(), lr=lr)


def batches(cold_at=(2, 6), steps=5, size=16):
    """(user, item, liked) interactions of warm users; `cold_at` (step, row) is the cold-start
    user's first interaction (None for a clean run)."""
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        user = torch.randint(COLD_USER + 1, 40, (size,), generator=g)
        item = torch.randint(0, 60, (size,), generator=g)
        if cold_at is not None and step == cold_at[0]:
            user[cold_at[1]] = COLD_USER
        yield {"user": user, "item": item,
               "liked": torch.randint(0, 2, (size,), generator=g).float()}


def loss(model, batch):
    score, length = model(batch["user"], batch["item"])
    fit = nn.functional.binary_cross_entropy_with_logits(score, batch["liked"])
    return fit + 1e-3 * length.mean()
