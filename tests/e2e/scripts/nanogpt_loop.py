"""The shape of karpathy/nanoGPT's train.py, in miniature: globals overridden by `--key=value`,
a `get_batch` over an np.memmap of uint16 tokens with torch.randint, an `estimate_loss` under
`@torch.no_grad()` switching model.eval()/train() between steps, a cosine lr with warm-up set
by hand in every param group, gradient accumulation over `micro_step` with the loss divided by
the number of micro-steps and the next batch fetched between forward and backward,
`scaler.scale(loss).backward()` with a GradScaler enabled only for float16, unscale + clip,
`scaler.step`, `scaler.update`, `zero_grad(set_to_none=True)`, and an MFU estimate after the step.
Run as `python nanogpt_loop.py --data_dir=DIR [--key=value ...]`; DIR holds train.bin, val.bin."""

import math
import os
import sys
from ast import literal_eval
from contextlib import nullcontext

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

data_dir = "data"
gradient_accumulation_steps = 1
batch_size = 4
block_size = 16
n_embd = 16
vocab_size = 32
learning_rate = 1e-3
max_iters = 6
warmup_iters = 2
min_lr = 1e-4
eval_interval = 3
eval_iters = 2
grad_clip = 1.0
dtype = "float32"
for arg in sys.argv[1:]:                      # configurator.py, in short
    key, val = arg[2:].split("=")
    try:
        globals()[key] = literal_eval(val)
    except (SyntaxError, ValueError):
        globals()[key] = val

torch.manual_seed(1337)
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if dtype == "float32" else torch.amp.autocast(device_type="cpu",
                                                                  dtype=ptdtype)


def get_batch(split):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i + block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block_size]).astype(np.int64))
                     for i in ix])
    return x, y


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        q, k, v = self.c_attn(self.ln_1(x)).split(n_embd, dim=2)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = Block()
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1])
        x = self.h(self.wte(idx) + self.wpe(pos))
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        flops = 6 * sum(p.numel() for p in self.parameters()) * block_size * fwdbwd_per_iter
        return flops / max(dt, 1e-9) / 312e12


model = GPT()
scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95))


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    decay_ratio = (it - warmup_iters) / max(1, max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(decay_ratio, 1.0))) * (learning_rate - min_lr)


X, Y = get_batch("train")
iter_num = 0
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    micro_losses = []
    for micro_step in range(gradient_accumulation_steps):
        model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            micro_losses.append(loss.item())
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    mfu = model.estimate_mfu(batch_size * gradient_accumulation_steps, 0.1)
    print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}, "
          f"mean {sum(micro_losses) / len(micro_losses):.6f}, mfu {mfu * 100:.2f}%")
    iter_num += 1
    if iter_num > max_iters:
        break
