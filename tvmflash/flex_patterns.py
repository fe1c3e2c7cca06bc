"""The FlexAttention patterns of issue 45's goal list, as mods for ``tvmflash.flex_attention``: what
``examples/flex_patterns.py`` checks and times, and what ``tvmflash tune --flex NAME`` tunes.

Each pattern is made for one call's shape (``make``): its score_mod or mask_mod, the tensors they capture
(made for that shape: document ids, prefix lengths, ALiBi slopes, a bias table), and where tvmflash has
the same attention built in, ``tvmflash.attention``'s keywords for it (``builtin``). The mods' constants
(the window, the softcap, the table's reach) are the pattern's, never the shape's, so that one pattern
traces to one module at every sequence length (``flex_trace``: a new constant is a new module).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

# name -> what it is, in a line
PATTERNS = {
    "causal": "causal, as a mask_mod",
    "sliding-window": "a causal sliding window (by default WINDOW keys back), as a mask_mod",
    "document": "causal within each document of packed sequences (captured document ids), as a mask_mod",
    "prefix-lm": "prefix-LM: the prefix (a captured length per batch) seen whole, the rest causal, as a mask_mod",
    "alibi": "ALiBi (captured per-head slopes), as a score_mod",
    "softcap": "a tanh softcap (SOFTCAP), as a score_mod",
    "relative-bias": "a learnable relative-position bias (a captured table that requires grad), as a score_mod",
}
WINDOW = 1024  # sliding-window: the keys a query sees behind it (FlexAttention's own example's), by default
SOFTCAP = 30.0  # softcap: Gemma 2's
RELATIVE_REACH = 128  # relative-bias: distances beyond it share the table's last entry


@dataclass
class Pattern:
    """One pattern made for a shape. ``builtin``: ``tvmflash.attention``'s keywords for the same
    attention, or None; ``learned``: the captured tensors that require grad."""

    name: str
    score_mod: object = None
    mask_mod: object = None
    builtin: dict | None = None
    learned: list = field(default_factory=list)

    def visible(self, batch: int, seqlen_q: int, seqlen_k: int, device) -> float:
        """The share of (query, key) pairs the mask_mod keeps (1 without one): what counts toward FLOPs."""
        if self.mask_mod is None:
            return 1.0
        kept = 0
        j = torch.arange(seqlen_k, device=device)[None, None, None, :]
        h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
        b = torch.arange(batch, device=device)[:, None, None, None]
        for start in range(0, seqlen_q, 1024):  # rows a chunk: (batch, 1024, seqlen_k) bools at most
            i = torch.arange(start, min(seqlen_q, start + 1024), device=device)[None, None, :, None]
            kept += int(self.mask_mod(b, h, i, j).expand(batch, 1, i.shape[2], seqlen_k).sum())
        return kept / (batch * seqlen_q * seqlen_k)


def documents(batch: int, seqlen: int, device, seed: int = 0) -> torch.Tensor:
    """Document ids of packed sequences, int32 (batch, seqlen): documents of random lengths from 1/16 to
    1/2 of the sequence, each batch its own."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.empty(batch, seqlen, dtype=torch.int32)
    for b in range(batch):
        at, doc = 0, 0
        while at < seqlen:
            length = int(torch.randint(max(1, seqlen // 16), max(2, seqlen // 2) + 1, (1,), generator=gen))
            ids[b, at:at + length] = doc
            at, doc = at + length, doc + 1
    return ids.to(device)


def alibi_slopes(heads: int, device) -> torch.Tensor:
    """ALiBi's slopes, float32 (heads,): 2^(-8 (h + 1) / heads)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32, device=device)


def make(name: str, batch: int, heads: int, seqlen: int, device, seed: int = 0, window: int = WINDOW) -> Pattern:
    """Pattern ``name`` (``PATTERNS``) for (batch, heads, seqlen, seqlen) calls on ``device``; ``window``: the
    sliding window's (a constant of its trace: another window is another module)."""
    if name not in PATTERNS:
        raise ValueError(f"pattern: expected one of {list(PATTERNS)}, got {name!r}")
    gen = torch.Generator().manual_seed(seed)
    if name == "causal":
        return Pattern(name, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, builtin={"causal": True})
    if name == "sliding-window":
        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
        return Pattern(name, mask_mod=sliding_window, builtin={"window_size": (window, 0)})
    if name == "document":
        doc = documents(batch, seqlen, device, seed)

        def document(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])
        return Pattern(name, mask_mod=document)
    if name == "prefix-lm":
        prefix = torch.randint(seqlen // 8, seqlen // 2 + 1, (batch,), generator=gen, dtype=torch.int32).to(device)

        def prefix_lm(b, h, q_idx, kv_idx):
            return (kv_idx < prefix[b]) | (q_idx >= kv_idx)
        return Pattern(name, mask_mod=prefix_lm)
    if name == "alibi":
        slopes = alibi_slopes(heads, device)

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx).abs()
        return Pattern(name, score_mod=alibi, builtin={"alibi_slopes": slopes})
    if name == "softcap":
        def softcap(score, b, h, q_idx, kv_idx):
            return torch.tanh(score / SOFTCAP) * SOFTCAP
        return Pattern(name, score_mod=softcap, builtin={"softcap": SOFTCAP})
    table = (torch.randn(heads, 2 * RELATIVE_REACH + 1, generator=gen) * 0.5).to(device).requires_grad_()

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(q_idx - kv_idx, -RELATIVE_REACH, RELATIVE_REACH) + RELATIVE_REACH]
    return Pattern(name, score_mod=relative_bias, learned=[table])


def reference(q, k, v, pattern: Pattern, dtype):
    """Attention with the pattern's mods applied to the whole score matrix in ``dtype``; (batch, heads,
    seqlen, head_dim) in and out, b and h counted from 0 (a slice starts at the first batch and head). The
    captured tensors are read as they are (a float32 table promotes a lower dtype's scores; the mod's
    result is rounded back to ``dtype``). Every row of the patterns sees a key."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    batch, heads, seqlen_q, seqlen_k = s.shape
    device = q.device
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.arange(heads, device=device)[None, :, None, None]
    i = torch.arange(seqlen_q, device=device)[None, None, :, None]
    j = torch.arange(seqlen_k, device=device)[None, None, None, :]
    if pattern.score_mod is not None:
        s = pattern.score_mod(s, b, h, i, j).to(dtype)
    if pattern.mask_mod is not None:
        s = s.masked_fill(~pattern.mask_mod(b, h, i, j).expand(s.shape), -math.inf)
    return torch.softmax(s, dim=-1) @ v.to(dtype)


@dataclass
class TuningCase:
    """What ``tvmflash tune --flex NAME`` tunes: pattern ``name``'s mods, traced, with its BlockMask
    (``block_mask``: of BLOCK_SIZE 128) or without. Called with a tuning shape, it gives the traced mods
    (``program_flex.FlexMods``), the tensors a kernel of them takes at each call (``captures=``) and a
    reference of the attention in the kernels' (batch, seqlen, heads, head_dim) layout, for the tuner's
    check (``tvmflash.tune.measured.FlexForward``, which is below the API and so neither traces nor
    evaluates a mod)."""

    name: str
    block_mask: bool = False
    window: int = WINDOW

    def __post_init__(self):
        if self.name not in PATTERNS:
            raise ValueError(f"--flex: expected one of {list(PATTERNS)}, got {self.name!r}")
        if self.block_mask and make(self.name, 1, 1, 8, "cpu").mask_mod is None:
            raise ValueError(f"--block-mask: the {self.name} pattern has no mask_mod to make a BlockMask of")

    def __str__(self) -> str:
        return f"flex {self.name}{' block-mask' if self.block_mask else ''}"

    def __call__(self, batch: int, heads: int, seqlen: int, device):
        from torch.nn.attention.flex_attention import create_block_mask

        from tvmflash.flex_block_mask import block_sparse_arguments
        from tvmflash.flex_trace import trace_mods

        pattern = make(self.name, batch, heads, seqlen, device, window=self.window)
        mods, captured = trace_mods(pattern.score_mod, pattern.mask_mod)
        lists = []
        if self.block_mask:
            block_mask = create_block_mask(pattern.mask_mod, batch, None, seqlen, seqlen, device=device)
            sparse, lists = block_sparse_arguments(block_mask, batch, heads, seqlen, seqlen, torch.device(device))
            mods = dataclasses.replace(mods, sparse=sparse)

        def layout_reference(q, k, v, dtype):
            return reference(*(t.transpose(1, 2) for t in (q, k, v)), pattern, dtype).transpose(1, 2)
        return mods, [t.detach() for t in captured] + lists, layout_reference
