"""Train a small GPT with tvmflash's attention (forward and backward), or SDPA, or plain attention.

    python examples/train_gpt.py --attn tvmflash            # on the GPU if there is one (bf16), else the CPU
    python examples/train_gpt.py --attn sdpa                # the same model and data on PyTorch's SDPA
    python examples/train_gpt.py --attn sdpa-flash          # SDPA's flash backend (FA2); sdpa-cudnn: cuDNN's
    python examples/train_gpt.py --attn naive --steps 50    # softmax(q kᵀ) v written out

A character-level GPT (6 layers, width 384, 6 heads of 64 by default) trained on text this script
generates itself (templated sentences and sums: no download), with the same seed for every --attn
so that the loss curves can be compared. It prints the loss, tokens/s and peak memory.
"""

from __future__ import annotations

import argparse
import math
import random
import resource
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import tvmflash


def make_text(chars: int, seed: int = 0) -> str:
    """Text with structure for a model to learn: templated sentences and correct sums."""
    rng = random.Random(seed)
    names = ["ada", "bob", "cleo", "dan", "eve", "finn", "gus", "hana", "ivo", "juno"]
    things = ["apples", "books", "coins", "drums", "eggs", "flags", "gems", "hats"]
    verbs = ["has", "wants", "sells", "finds", "keeps", "counts"]
    lines, size = [], 0
    while size < chars:
        if rng.random() < 0.5:
            a, b = rng.randrange(100), rng.randrange(100)
            line = f"{a} + {b} = {a + b}."
        else:
            n = rng.randrange(2, 20)
            line = f"{rng.choice(names)} {rng.choice(verbs)} {n} {rng.choice(things)}, then {n + 1}."
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


SDPA_BACKENDS = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}
ATTENTIONS = ["tvmflash", "sdpa", *SDPA_BACKENDS, "naive"]


def attention(q, k, v, kind: str):
    """Causal attention of (batch, seqlen, heads, head_dim) tensors, in the same layout."""
    if kind == "tvmflash":
        return tvmflash.attention(q, k, v, causal=True)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if kind == "sdpa":  # PyTorch's choice of backend
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif kind in SDPA_BACKENDS:  # one backend, named
        with sdpa_kernel(SDPA_BACKENDS[kind]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif kind == "naive":
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        out = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v
    else:
        raise ValueError(f"attn: expected one of {ATTENTIONS}, got {kind!r}")
    return out.transpose(1, 2)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, attn: str):
        super().__init__()
        self.heads, self.attn = heads, attn
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1)).unbind(2)
        x = x + self.proj(attention(q, k, v, self.attn).flatten(-2))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, layers: int, width: int, heads: int, attn: str):
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads, attn) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attn", choices=ATTENTIONS, default="tvmflash",
                        help="sdpa: PyTorch's choice of backend; sdpa-flash, sdpa-cudnn: that backend")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="autocast dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--compile", action="store_true", help="torch.compile(model, fullgraph=True)")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def train(args) -> list[float]:
    """Train as ``args`` say; print progress; return the loss of every step."""
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    text = make_text(max(200_000, 4 * args.batch_size * (args.seq_len + 1)), seed=args.seed)
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    model = GPT(len(vocab), args.seq_len, args.layers, args.width, args.heads, args.attn).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    step_fn = torch.compile(model, fullgraph=True) if args.compile else model
    batches = torch.Generator().manual_seed(args.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, timed_tokens, timed_seconds = [], 0, 0.0
    for step in range(args.steps):
        starts = torch.randint(len(data) - args.seq_len - 1, (args.batch_size,), generator=batches)
        window = torch.stack([data[s:s + args.seq_len + 1] for s in starts.tolist()]).to(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = step_fn(window[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # (synchronises)
        if step >= min(3, args.steps - 1):  # the first steps build kernels and warm up
            timed_tokens += args.batch_size * args.seq_len
            timed_seconds += time.perf_counter() - start
        if step % args.log_every == 0 or step == args.steps - 1:
            rate = f"{timed_tokens / timed_seconds:,.0f} tokens/s" if timed_seconds else "warming up"
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {rate}", flush=True)
    if device.type == "cuda":
        peak = f"{torch.cuda.max_memory_allocated(device) / 2**20:,.0f} MiB (GPU, torch allocator)"
    else:
        peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB (process max RSS)"
    rate = timed_tokens / timed_seconds if timed_seconds else float("nan")
    print(f"attn={args.attn} {dtype} {args.layers} layers, width {args.width}, {args.heads} heads, batch "
          f"{args.batch_size} x {args.seq_len}: final loss {losses[-1]:.4f}, {rate:,.0f} tokens/s, peak memory {peak}")
    return losses


if __name__ == "__main__":
    train(parse_args())
