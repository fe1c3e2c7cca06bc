"""Sliding-window attention against the full causal run it is a part of (issue 24's goal: a 4k window
over 32k tokens costs about its share of the full causal run).

    python benchmarks/window_bench.py                        # bf16, d64 and d128, 32k tokens, window 4k
    python benchmarks/window_bench.py --seqlen 8192 --window 1024 2048 --head-dims 128

For each head_dim, one sequence of ``--seqlen`` tokens (heads = ``--hidden`` / head_dim) runs causal,
and causal with ``window_size=(W, 0)`` (flash-attn's convention: query i sees keys i - W .. i) for
each ``--window`` W. The window's "share" is the fraction of the causal run's (query, key) pairs it
keeps, and its "tile share" the fraction of the causal run's K/V tiles it visits at the kernel's tiles
(no kernel can skip less than a whole tile). "cost / share" is the window's time over the causal
run's, divided by the share: 1.00 means the window costs exactly its share. Each windowed output is
checked first against float32 attention with the same mask (its last 1024 queries, two heads, under
flash-attn's error rule). Times are ``tvmflash.bench.time_backends``' (interleaved rounds).
"""

from __future__ import annotations

import argparse
import math

import torch

import tvmflash
from tvmflash import bench


def pairs(seqlen: int, window: int | None) -> int:
    """(query, key) pairs a causal run keeps (``window``: only keys at most that far back)."""
    if window is None or window >= seqlen:
        return seqlen * (seqlen + 1) // 2
    # queries 0 .. window see i + 1 keys, the rest window + 1
    return (window + 1) * (window + 2) // 2 + (seqlen - window - 1) * (window + 1)


def tiles(seqlen: int, window: int | None, block_m: int, block_n: int) -> int:
    """K/V tiles visited by the Q blocks of a causal run (``window``: those that reach the window)."""
    total = 0
    for start in range(0, seqlen, block_m):
        last = min(seqlen, start + block_m) - 1  # the block's last query sees keys up to itself
        first = 0 if window is None else max(0, start - window)  # its first query's oldest key
        total += last // block_n - first // block_n + 1
    return total


def error_vs_float32(out, q, k, v, window: int, rows: int = 1024, heads: int = 2) -> tuple[float, float]:
    """The windowed output's error on its last ``rows`` queries and first ``heads`` heads against
    float32 attention with the same mask, and flash-attn's bound (2x torch's own error + 1e-5)."""
    seqlen = q.shape[1]
    rows = min(rows, seqlen)
    keys = slice(max(0, seqlen - rows - window), seqlen)
    q_, k_, v_ = q[:1, -rows:, :heads], k[:1, keys, :heads], v[:1, keys, :heads]
    i = torch.arange(seqlen - rows, seqlen, device=q.device)[:, None]
    j = torch.arange(keys.start, seqlen, device=q.device)[None, :]
    hidden = (j > i) | (j < i - window)

    def attend(dtype):
        s = torch.einsum("bqhd,bkhd->bhqk", q_.to(dtype), k_.to(dtype)) / math.sqrt(q.shape[-1])
        p = torch.softmax(s.float().masked_fill(hidden, -math.inf), -1).to(dtype)
        return torch.einsum("bhqk,bkhd->bqhd", p, v_.to(dtype))

    ref = attend(torch.float32)
    return (out[:1, -rows:, :heads].float() - ref).abs().max().item(), \
        2 * (attend(q.dtype).float() - ref).abs().max().item() + 1e-5


def run(seqlen: int, windows: list[int], head_dim: int, heads: int, dtype, device, repeat: int) -> None:
    gen = torch.Generator(device=device).manual_seed(head_dim)
    q, k, v = (torch.randn(1, seqlen, heads, head_dim, device=device, dtype=dtype, generator=gen) for _ in range(3))
    causal = tvmflash.compile(head_dim=head_dim, dtype=dtype, causal=True)
    calls = {"causal": lambda: causal(q, k, v)}
    knobs = causal.info()["knobs"]
    block_m, block_n = knobs["block_m"], knobs["block_n"]
    for window in windows:
        kernel = tvmflash.compile(head_dim=head_dim, dtype=dtype, causal=True, window_size=(window, 0))
        out = kernel(q, k, v)
        error, bound = error_vs_float32(out, q, k, v, window)
        if not error <= bound:
            raise SystemExit(f"d{head_dim} window {window}: max error {error:.3e} > {bound:.3e} (flash-attn's rule)")
        calls[f"window {window}"] = lambda kernel=kernel: kernel(q, k, v)
    times = bench.time_backends(calls, device, repeat)
    flops = bench.attention_flops(1, heads, seqlen, seqlen, head_dim, True)
    print(f"d{head_dim}, {seqlen} tokens, {heads} heads: causal {times['causal']:.3f} ms "
          f"({flops / times['causal'] / 1e9:.1f} TFLOP/s); tiles {block_m} x {block_n}")
    for window in windows:
        ms = times[f"window {window}"]
        share = pairs(seqlen, window) / pairs(seqlen, None)
        tile_share = tiles(seqlen, window, block_m, block_n) / tiles(seqlen, None, block_m, block_n)
        print(f"  window {window}: {ms:.3f} ms, {ms / times['causal']:.3f}x the causal run's time; share "
              f"{share:.3f}, tile share {tile_share:.3f}; cost / share {ms / times['causal'] / share:.2f}, "
              f"cost / tile share {ms / times['causal'] / tile_share:.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seqlen", type=int, default=32768)
    parser.add_argument("--window", type=int, nargs="+", default=[4096], help="left window sizes")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--hidden", type=int, default=2048, help="heads * head_dim")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--build-jobs", type=int, default=8, help="kernels built at once, before timing")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda" and args.build_jobs > 1:
        bench.build_in_parallel([("compile", {"head_dim": d, "dtype": "bfloat16", "causal": True, "window_size": w,
                                              "heads_q": max(1, args.hidden // d)})
                                 for d in args.head_dims for w in [(-1, -1)] + [(w, 0) for w in args.window]],
                                args.build_jobs)
    for head_dim in args.head_dims:
        run(args.seqlen, args.window, head_dim, max(1, args.hidden // head_dim), dtype, device, args.repeat)


if __name__ == "__main__":
    main()
