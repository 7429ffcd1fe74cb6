"""The shape of pytorch/examples word_language_model/main.py, in miniature: no torch.optim
optimizer by default (`p.data.add_(p.grad, alpha=-lr)` after `clip_grad_norm_`), `model.zero_grad()`
before the forward, an RNN whose hidden state is carried across batches (detached by
`repackage_hidden`), an evaluation under `torch.no_grad()` after each epoch, and an optional
AdamW (`--use-optimizer`). Run as `python word_lm_loop.py --data FILE [options]`; FILE is text."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--data", required=True)
parser.add_argument("--model", default="LSTM")            # RNN_TANH, RNN_RELU, LSTM
parser.add_argument("--lr", type=float, default=20)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch_size", type=int, default=4)
parser.add_argument("--bptt", type=int, default=8)
parser.add_argument("--nhid", type=int, default=16)
parser.add_argument("--seed", type=int, default=1111)
parser.add_argument("--use-optimizer", action="store_true")
args = parser.parse_args()
torch.manual_seed(args.seed)

words = open(args.data).read().split()
vocab = {w: i for i, w in enumerate(sorted(set(words)))}
ids = torch.tensor([vocab[w] for w in words])
nbatch = ids.size(0) // args.batch_size
train_data = ids[:nbatch * args.batch_size].view(args.batch_size, -1).t().contiguous()


class RNNModel(nn.Module):
    def __init__(self, ntoken):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, args.nhid)
        if args.model == "LSTM":
            self.rnn = nn.LSTM(args.nhid, args.nhid)
        else:
            self.rnn = nn.RNN(args.nhid, args.nhid, nonlinearity=args.model[4:].lower())
        self.decoder = nn.Linear(args.nhid, ntoken)

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return nn.functional.log_softmax(self.decoder(output), dim=-1).view(-1, len(vocab)), hidden

    def init_hidden(self, bsz):
        h = torch.zeros(1, bsz, args.nhid)
        return (h, h.clone()) if args.model == "LSTM" else h


def repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


model = RNNModel(len(vocab))
criterion = nn.NLLLoss()
if args.use_optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)


def evaluate():
    model.eval()
    total, hidden = 0.0, model.init_hidden(args.batch_size)
    with torch.no_grad():
        for i in range(0, train_data.size(0) - 1, args.bptt):
            data, targets = train_data[i:i + args.bptt], train_data[i + 1:i + 1 + args.bptt]
            data = data[:len(targets)]
            output, hidden = model(data, hidden)
            total += len(data) * criterion(output, targets.reshape(-1)).item()
    return total / len(train_data)


lr = args.lr
for epoch in range(1, args.epochs + 1):
    model.train()
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = train_data[i:i + args.bptt], train_data[i + 1:i + 1 + args.bptt]
        data = data[:len(targets)]
        if args.use_optimizer:
            optimizer.zero_grad()
        else:
            model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if args.use_optimizer:
            optimizer.step()
        else:
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
        print(f"epoch {epoch} batch {batch} loss {loss.item():.6f}")
    print(f"end of epoch {epoch} valid loss {evaluate():.4f}")
