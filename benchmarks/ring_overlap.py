"""Does a ring step's kernel hide its transfer? A ring simulated on ONE GPU (issue 46).

    python benchmarks/ring_overlap.py                  # d128 bf16, 16 heads, shards of 4k..64k tokens,
                                                       # world 8, causal zigzag and non-causal, 450 GB/s
    python benchmarks/ring_overlap.py --dry-run        # the plan alone, no GPU: each step's calls, bytes,
                                                       # transfer time, and the TFLOP/s that still hides it
    python benchmarks/ring_overlap.py --shard-lens 8192 --world 4 --bandwidth 450

For each shard length and mask, rank 0's ring steps (``tvmflash.distributed.plan.step_pieces``; under
zigzag every rank's steps have the same sizes) are grouped into kinds of equal work, and each kind is
timed as ring_attention runs it (``ring.step_forward``: the kernels and the float32 LSE merge;
``ring.step_backward``: the backward kernels and the float32 accumulation), by CUDA events
(``bench.time_ms``). A step's transfer, posted before its kernels, moves in the forward the K and V shard
(2 · shard_len · heads_kv · head_dim elements of the dtype), in the backward the K and V shard and the
float32 dK/dV that travel beside it (2 · ... · 4 bytes). At ``--bandwidth`` GB/s a direction (NVLink on
the H100 SXM: 450) the transfer takes bytes / bandwidth; the step hides it when its kernels take at least
that long. Each row prints both, and the ring's predicted time per rank, sum over steps of max(kernels,
transfer), against the kernels alone (the ring's overhead where the transfer is not hidden).

The numbers go to docs/context-parallel.md's table, with the date, commit and GPU (BENCHMARKS.md's rule).
"""

from __future__ import annotations

import argparse
import collections

from tvmflash.distributed import plan
from tvmflash.distributed.layout import segments

BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MODES = {"causal-zigzag": (True, "zigzag"), "full": (False, "contiguous"), "causal-contiguous": (True, "contiguous")}


def step_kinds(shard_len: int, world: int, causal: bool, layout: str, rank: int = 0) -> list:
    """[(pieces, how many of rank's steps have them)]: the ring's steps of one rank grouped by their
    calls' shapes (local offsets aside)."""
    mine = segments(rank, world, shard_len, layout)
    kinds = collections.Counter()
    for s in range(world):
        pieces = plan.step_pieces(mine, segments((rank - s) % world, world, shard_len, layout), causal, -1, -1)
        kinds[pieces] += 1
    return list(kinds.items())


def flops(pieces, heads: int, head_dim: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of a step's calls: 4 · rows · keys · heads · head_dim forward (halved
    where causal: half the pairs), 2.5 times that backward (five products instead of two)."""
    fwd = sum(4.0 * (p.q1 - p.q0) * (p.k1 - p.k0) * heads * head_dim * (0.5 if p.causal else 1.0) for p in pieces)
    return fwd, 2.5 * fwd


def transfer_bytes(shard_len: int, heads_kv: int, head_dim: int, dtype: str) -> tuple[int, int]:
    """(forward, backward) bytes one ring step sends each way: K and V; K and V with float32 dK and dV."""
    elements = 2 * shard_len * heads_kv * head_dim
    return elements * BYTES[dtype], elements * (BYTES[dtype] + 4)


def describe(pieces) -> str:
    if not pieces:
        return "skip"
    return " + ".join(f"{p.q1 - p.q0}x{p.k1 - p.k0}{' causal' if p.causal else ''}" for p in pieces)


def time_step(pieces, shard_len, args, device):
    """(forward ms, backward ms) of one step's calls, as ring_attention runs them."""
    import torch

    from tvmflash import bench
    from tvmflash.distributed.ring import RingCall, step_backward, step_forward

    if not pieces:
        return 0.0, 0.0
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, shard_len, args.heads, args.head_dim, device=device, dtype=dtype, generator=gen)
    kv = torch.randn(2, 1, shard_len, args.heads_kv, args.head_dim, device=device, dtype=dtype, generator=gen)
    dout = torch.randn_like(q)
    call = RingCall(None, (pieces,), args.head_dim ** -0.5, 0.0, False)
    out = torch.zeros(q.shape, dtype=torch.float32, device=device)
    lse = torch.full((1, args.heads, shard_len), -torch.inf, dtype=torch.float32, device=device)
    step_forward(q, kv, 0, call, out, lse)  # builds the kernels; a real lse for the backward
    out16 = out.to(dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=device)

    def fwd():
        out.zero_()
        lse.fill_(-torch.inf)
        step_forward(q, kv, 0, call, out, lse)

    forward_ms = bench.time_ms(fwd, device, repeat=args.repeat)
    backward_ms = bench.time_ms(lambda: step_backward(dout, None, q, kv, out16, lse, 0, call, dq, dkv), device,
                                repeat=args.repeat)
    return forward_ms, backward_ms


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shard-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["causal-zigzag", "full"])
    parser.add_argument("--world", type=int, default=8, help="ranks of the simulated ring")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--heads-kv", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(BYTES), default="bfloat16")
    parser.add_argument("--bandwidth", type=float, default=450.0, help="GB/s a direction (NVLink, H100 SXM: 450)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the transfers; time nothing")
    args = parser.parse_args(argv)
    args.heads_kv = args.heads_kv or args.heads
    if args.world < 2:
        parser.error("--world: expected at least 2")
    device = None
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (or --dry-run)")
        device = torch.device("cuda")
        print(f"# {torch.cuda.get_device_name(device)}, {args.dtype}, d{args.head_dim}, heads {args.heads}/"
              f"{args.heads_kv}, world {args.world}, {args.bandwidth:g} GB/s")
    bw = args.bandwidth * 1e9
    header = (f"{'mode':17} {'shard':>6} {'steps':>5} {'calls (rows x keys)':28} {'fwd MB':>7} {'xfer ms':>8} "
              f"{'hide <':>8} {'bwd MB':>7} {'xfer ms':>8} {'hide <':>8}")
    if not args.dry_run:
        header += f" {'fwd ms':>8} {'bwd ms':>8} {'hidden':>9}"
    print(header)
    rows = []
    for mode in args.modes:
        causal, layout = MODES[mode]
        for shard_len in args.shard_lens:
            if layout == "zigzag" and shard_len % 2:
                parser.error(f"--shard-lens: zigzag needs even lengths, got {shard_len}")
            fwd_bytes, bwd_bytes = transfer_bytes(shard_len, args.heads_kv, args.head_dim, args.dtype)
            fwd_xfer, bwd_xfer = fwd_bytes / bw * 1e3, bwd_bytes / bw * 1e3
            predicted = {"fwd": [0.0, 0.0], "bwd": [0.0, 0.0]}  # [kernels alone, max(kernels, transfer)]
            for pieces, count in step_kinds(shard_len, args.world, causal, layout):
                f_flops, b_flops = flops(pieces, args.heads, args.head_dim)
                # the kernel's TFLOP/s below which its step lasts at least as long as the transfer
                hide_f = f_flops / (fwd_xfer * 1e-3) / 1e12
                hide_b = b_flops / (bwd_xfer * 1e-3) / 1e12
                line = (f"{mode:17} {shard_len:6d} {count:5d} {describe(pieces):28} {fwd_bytes / 1e6:7.1f} "
                        f"{fwd_xfer:8.3f} {hide_f:8.0f} {bwd_bytes / 1e6:7.1f} {bwd_xfer:8.3f} {hide_b:8.0f}")
                if not args.dry_run:
                    f_ms, b_ms = time_step(pieces, shard_len, args, device)
                    hidden = "both" if f_ms >= fwd_xfer and b_ms >= bwd_xfer else (
                        "fwd" if f_ms >= fwd_xfer else "bwd" if b_ms >= bwd_xfer else "neither")
                    line += f" {f_ms:8.3f} {b_ms:8.3f} {hidden if pieces else '-':>9}"
                    for key, ms, xfer in (("fwd", f_ms, fwd_xfer), ("bwd", b_ms, bwd_xfer)):
                        predicted[key][0] += count * ms
                        predicted[key][1] += count * max(ms, xfer)
                print(line)
            if not args.dry_run:
                rows.append((mode, shard_len, predicted))
    if args.dry_run:
        print("# hide <: the TFLOP/s under which the step's kernels take at least the transfer's time "
              "(a step with no calls hides nothing; its transfer still moves)")
        return
    print("\n# predicted per rank: kernels alone, and sum of max(kernels, transfer) over the steps")
    for mode, shard_len, p in rows:
        print(f"{mode:17} {shard_len:6d}  fwd {p['fwd'][0]:9.2f} -> {p['fwd'][1]:9.2f} ms   "
              f"bwd {p['bwd'][0]:9.2f} -> {p['bwd'][1]:9.2f} ms   "
              f"overhead {(p['fwd'][1] + p['bwd'][1]) / max(p['fwd'][0] + p['bwd'][0], 1e-9) - 1:+.1%}")


if __name__ == "__main__":
    main()
