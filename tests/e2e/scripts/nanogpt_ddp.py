"""The DDP shape of karpathy/nanoGPT's train.py (MIT), in miniature, for torchrun on CPU: the
process group from RANK / LOCAL_RANK / WORLD_SIZE (`--backend=gloo`), a seed offset per rank,
the accumulation steps divided by the world size, `DDP(model)`, the gradients synchronised only
at the last micro-step by toggling `model.require_backward_grad_sync` (not `no_sync()`), the
next batch fetched between forward and backward, a linear warm-up of the learning rate set in
every param group (`learning_rate * (it + 1) / (warmup_iters + 1)`), AdamW over decayed and
non-decayed groups, clipping, an `estimate_loss` under no_grad, and the master process saving
`ckpt.pt` into `out_dir` (`raw_model = model.module`). nanoGPT's own DDP branch hard-codes
`cuda:{local_rank}`; here the device is the CPU, the one change.
Run as `torchrun --nproc-per-node 2 nanogpt_ddp.py --data_dir=DIR [--key=value ...]`."""

import math
import os
import sys
from ast import literal_eval

import numpy as np
import torch
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

data_dir = "data"
out_dir = "out"
backend = "gloo"
gradient_accumulation_steps = 4
batch_size = 4
block_size = 16
n_embd = 32
vocab_size = 32
learning_rate = 1e-3
weight_decay = 0.1
max_iters = 6
warmup_iters = 2
min_lr = 1e-4
eval_interval = 3
eval_iters = 2
grad_clip = 1.0
for arg in sys.argv[1:]:                      # configurator.py, in short
    key, val = arg[2:].split("=")
    try:
        globals()[key] = literal_eval(val)
    except (SyntaxError, ValueError):
        globals()[key] = val

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)


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

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))


model = GPT()
optimizer = model.configure_optimizers()
if ddp:
    model = DDP(model)
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
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
best_val_loss = 1e9
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if iter_num > 0 and losses["val"] < best_val_loss:
            best_val_loss = losses["val"]
            torch.save({"model": raw_model.state_dict(), "iter_num": iter_num},
                       os.path.join(out_dir, "ckpt.pt"))
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master_process:
        print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}")
    iter_num += 1
    if iter_num > max_iters:
        break

if ddp:
    destroy_process_group()
