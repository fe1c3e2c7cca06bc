"""A block-sparse ``BlockMask`` against the dense run (issue 45's goal: a 10%-dense block mask at 0.9x the
ideal or better, the ideal being the dense time times the density).

    python benchmarks/block_sparse_bench.py                            # bf16, d128, 8k tokens, 16 heads
    python benchmarks/block_sparse_bench.py --seqlen 16384 --densities 1 0.25 0.1 --partial 0.5 --backward
    python benchmarks/block_sparse_bench.py --device cpu --seqlen 1024 --heads 2    # (slowly) on the CPU
    OMP_NUM_THREADS=1 python benchmarks/block_sparse_bench.py --host-time --device cpu   # the host's time a call

For each density d, a random BlockMask (``BLOCK_SIZE`` ``--block``) keeps that share of each Q block's K/V
blocks (each row keeps at least one, the diagonal's), ``--partial`` of them partial (mask_mod applies: an
element pattern that keeps half) and the rest full; d = 1 keeps every block, full: the dense run. Each is
checked first against torch's flex_attention (eager, float32 math) on its first batch and heads, under
flash-attn's error rule, then timed (``tvmflash.bench.time_ms``: forward, or with ``--backward`` forward and
backward through autograd). "vs ideal" is (the dense time x d) / the time: 1.00 means the mask costs exactly
its share. With ``--torch`` torch.compile'd FlexAttention is timed beside it on the same masks.

``--host-time``: instead, the time a call takes on a tiny problem (batch 1, 1 head, 128 tokens, d32; float32 on
the CPU), where the host's Python work is most of it: tvmflash.flash_attn_func, and flex_attention without mods,
with a causal BlockMask (create_block_mask), with a mask_mod and with a score_mod, forward (no grad) and forward
+ backward (``out.sum().backward()``), back to back. Beside each wall time, the kernels' share (the modules'
functions timed around each call; on a GPU their launches) and the rest, the host's.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import tvmflash
from tvmflash import bench


def random_block_mask(seqlen: int, heads: int, block: int, density: float, partial: float, device, seed: int = 0):
    """A BlockMask over one batch and ``heads`` heads keeping ``density`` of each Q block's K/V blocks (the
    diagonal block always), ``partial`` of the kept ones partial, and the share it keeps."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-seqlen // block)
    keep = torch.rand(1, heads, blocks, blocks, generator=gen) < density
    keep |= torch.eye(blocks, dtype=torch.bool)
    partial_ = keep & (torch.rand(1, heads, blocks, blocks, generator=gen) < partial)
    full_ = keep & ~partial_

    def lists(hit):
        order = torch.argsort((~hit).to(torch.int32), dim=-1, stable=True)
        return hit.sum(-1).to(torch.int32).to(device), order.to(torch.int32).to(device)

    kept, full = keep[0].to(device), full_[0].to(device)

    def half(b, h, q, kv):  # consistent with the lists (torch's eager path applies it to every block)
        return kept[h, q // block, kv // block] & (full[h, q // block, kv // block] | ((q + kv) % 2 == 0))

    (num, indices), (full_num, full_indices) = lists(partial_), lists(full_)
    mask = BlockMask.from_kv_blocks(num, indices, full_num, full_indices, BLOCK_SIZE=block, mask_mod=half,
                                    seq_lengths=(seqlen, seqlen))
    return mask, keep.float().mean().item()


def check(q, k, v, block_mask, heads: int = 2) -> tuple[float, float]:
    """Our error on batch 0 and the first ``heads`` heads against torch's flex_attention in float64, and
    flash-attn's bound (2x torch's in the inputs' dtype + 1e-5)."""
    q_, k_, v_ = (t[:1, :heads] for t in (q, k, v))
    sub = block_mask
    if block_mask.kv_num_blocks.shape[1] > heads:
        sub = block_mask[:, :heads]
        sub.mask_mod = block_mask.mask_mod  # (a slice starts at head 0: the same positions)
    ours = tvmflash.flex_attention(q_, k_, v_, block_mask=sub).double()
    with torch.no_grad():
        reference = flex_attention(*(t.double() for t in (q_, k_, v_)), block_mask=sub)
        theirs = flex_attention(q_, k_, v_, block_mask=sub).double()
    return (ours - reference).abs().max().item(), 2 * (theirs - reference).abs().max().item() + 1e-5


def host_time(device, dtype, calls: int = 300) -> None:
    """``--host-time`` (see the module docstring): the best of 5 rounds of ``calls`` calls, microseconds a call."""
    from torch.nn.attention.flex_attention import create_block_mask

    from tvmflash.kernels import build

    spent = [0.0]

    def timed(fn):
        def call(*args):
            start = time.perf_counter()
            result = fn(*args)
            spent[0] += time.perf_counter() - start
            return result
        return call

    module_for, wrapped = build.Build.module_for, {}

    def timed_module_for(self, *args, **kwargs):  # each module's functions timed around their calls
        module = module_for(self, *args, **kwargs)
        if id(module) not in wrapped:
            function = module.function
            function = {k: timed(f) for k, f in function.items()} if isinstance(function, dict) else timed(function)
            wrapped[id(module)] = (module, dataclasses.replace(module, function=function))
        return wrapped[id(module)][1]

    build.Build.module_for = timed_module_for
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 128, 32, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = create_block_mask(causal, 1, 1, 128, 128, device=device)
    cases = {
        "flash_attn_func": lambda: tvmflash.flash_attn_func(qt, kt, vt),
        "flex, no mods": lambda: tvmflash.flex_attention(q, k, v),
        "flex, BlockMask": lambda: tvmflash.flex_attention(q, k, v, block_mask=block_mask),
        "flex, mask_mod": lambda: tvmflash.flex_attention(q, k, v, block_mask=causal),
        "flex, score_mod": lambda: tvmflash.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 0.5),
    }

    def measure(step, n):
        for _ in range(20):
            step()
        best = None
        for _ in range(5):
            spent[0] = 0.0
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(n):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / n * 1e6
            if best is None or wall < best[0]:
                best = (wall, spent[0] / n * 1e6)
        return best

    print(f"host time a call, us ({bench.device_name(device)}, {dtype}, b1 h1 s128 d32, "
          f"{torch.get_num_threads()} threads): wall, kernels, host (wall - kernels)")
    print(f"{'':<18}{'forward':>24}{'forward + backward':>30}")
    for name, fn in cases.items():
        def forward(fn=fn):
            with torch.no_grad():
                fn()

        def both(fn=fn):
            fn().sum().backward()
        line = f"{name:<18}"
        for step, n in ((forward, calls), (both, calls // 2)):
            wall, kernels = measure(step, n)
            line += f"   {wall:7.1f} {kernels:7.1f} {wall - kernels:7.1f}"
        print(line)
    build.Build.module_for = module_for


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.1])
    parser.add_argument("--partial", type=float, default=0.0, help="share of the kept blocks that are partial")
    parser.add_argument("--backward", action="store_true", help="time forward and backward")
    parser.add_argument("--torch", action="store_true", help="time torch.compile'd flex_attention too")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--host-time", action="store_true",
                        help="the time a call on a tiny problem instead: wall, the kernels' and the host's")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.host_time:
        return host_time(device, torch.float32 if device.type == "cpu" else dtype)
    q, k, v = (torch.randn(1, args.heads, args.seqlen, args.head_dim, device=device, dtype=dtype,
                           requires_grad=args.backward) for _ in range(3))
    dout = torch.randn_like(q)
    compiled = torch.compile(flex_attention) if args.torch else None

    def timed(attend):
        def step():
            out = attend()
            if args.backward:
                out.backward(dout)
        if not args.backward:
            with torch.no_grad():
                return bench.time_ms(step, device, repeat=args.repeat)
        return bench.time_ms(step, device, repeat=args.repeat)

    print(f"{args.dtype} d{args.head_dim}, {args.heads} heads, {args.seqlen} tokens, BLOCK_SIZE {args.block}, "
          f"partial {args.partial}, {'forward + backward' if args.backward else 'forward'}, {bench.device_name(device)}")
    print(f"{'density':>8} {'ms':>9} {'vs ideal':>9}" + (f" {'torch ms':>9} {'speedup':>8}" if args.torch else ""))
    dense_ms = None
    for n, density in enumerate(sorted(args.densities, reverse=True)):
        block_mask, kept = random_block_mask(args.seqlen, args.heads, args.block, density,
                                             0.0 if density >= 1 else args.partial, device, seed=n)
        error, bound = check(q.detach(), k.detach(), v.detach(), block_mask)
        if not error <= bound:
            raise SystemExit(f"density {density}: error {error:.3e} over flash-attn's bound {bound:.3e}")
        ms = timed(lambda: tvmflash.flex_attention(q, k, v, block_mask=block_mask))
        if dense_ms is None and kept >= 1:
            dense_ms = ms
        ideal = f"{dense_ms * kept / ms:9.2f}" if dense_ms else f"{'-':>9}"
        line = f"{kept:8.3f} {ms:9.3f} {ideal}"
        if compiled is not None:
            theirs = timed(lambda: compiled(q, k, v, block_mask=block_mask))
            line += f" {theirs:9.3f} {theirs / ms:7.2f}x"
        print(line)
    if dense_ms is None:
        print("(no density 1 run: vs ideal needs the dense time)")
    print("each checked first against torch's flex_attention in float64 (flash-attn's rule)")


if __name__ == "__main__":
    main()
