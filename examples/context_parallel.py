"""One long sequence split over the ranks: context-parallel attention, forward + backward, with
``torchrun`` (NCCL, one GPU a rank), or on the CPU with gloo for small sizes.

    torchrun --nproc-per-node 8 examples/context_parallel.py --seqlen 262144        # ring, causal, zigzag
    torchrun --nproc-per-node 8 examples/context_parallel.py --seqlen 65536 --method ulysses
    torchrun --nproc-per-node 2 examples/context_parallel.py --seqlen 256 --heads 4 --head-dim 32 --cpu

Each rank makes its own shard of q, k, v (batch 1, flash-attn's layout) and runs
``tvmflash.distributed.ring_attention`` (or ``ulysses_attention``) forward and backward ``--iters`` times
after a warmup; it reports its median time and its peak memory (GPU: ``max_memory_allocated``; CPU: the
process's peak resident set). With ``--compare`` (the default where the whole sequence fits: at most
``--compare-max`` tokens) rank 0 gathers the shards, runs ``tvmflash.attention`` on the whole sequence on
its own device, times it the same way, and prints the largest differences of out and the gradients from
the distributed run's.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

import tvmflash
import tvmflash.distributed as cp


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # kB on Linux


def timed(step, device, iters: int) -> float:
    """Median ms of ``step()`` over ``iters`` calls, after one warmup (which builds the kernels)."""
    step()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def gather(x, world: int, layout: str, dim: int = 1):
    """The whole sequence from every rank's shard (on every rank)."""
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return cp.unshard(parts, dim, layout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=65536, help="tokens of the whole sequence")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--heads-kv", type=int, default=None, help="default: --heads (GQA: fewer)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--method", choices=["ring", "ulysses"], default="ring")
    parser.add_argument("--layout", choices=list(cp.LAYOUTS), default="zigzag")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU, whatever GPUs there are")
    parser.add_argument("--compare", choices=["auto", "yes", "no"], default="auto")
    parser.add_argument("--compare-max", type=int, default=32768,
                        help="with --compare auto: compare where the sequence has at most this many tokens")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available() and not args.cpu
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if use_cuda else "float32"))
    heads_kv = args.heads_kv or args.heads
    parts = 2 * world if args.layout == "zigzag" else world
    if args.seqlen % parts:
        parser.error(f"--seqlen: expected a multiple of {parts} ({args.layout} over {world} ranks)")
    shard_len = args.seqlen // world

    gen = torch.Generator(device=device).manual_seed(1000 + rank)  # each rank its own shard
    q, k, v = (torch.randn(1, shard_len, h, args.head_dim, device=device, dtype=dtype, generator=gen)
               .requires_grad_() for h in (args.heads, heads_kv, heads_kv))
    dout = torch.randn(1, shard_len, args.heads, args.head_dim, device=device, dtype=dtype, generator=gen)
    function = cp.ring_attention if args.method == "ring" else cp.ulysses_attention

    def step():
        for t in (q, k, v):
            t.grad = None
        function(q, k, v, causal=args.causal, layout=args.layout).backward(dout)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = timed(step, device, args.iters)
    memory = peak_memory_mb(device)
    stats = torch.tensor([ms, memory], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(stats) for _ in range(world)]
    dist.all_gather(everyone, stats)
    if rank == 0:
        where = torch.cuda.get_device_name(device) if use_cuda else "CPU (gloo)"
        print(f"{args.method} attention, {args.seqlen} tokens over {world} ranks ({shard_len} a rank, "
              f"{args.layout}), {'causal' if args.causal else 'full'}, heads {args.heads}/{heads_kv}, "
              f"d{args.head_dim}, {str(dtype).replace('torch.', '')}, {where}")
        for r, s in enumerate(everyone):
            print(f"  rank {r}: forward + backward {s[0].item():9.2f} ms, peak memory {s[1].item():9.1f} MiB")

    compare = args.compare == "yes" or (args.compare == "auto" and args.seqlen <= args.compare_max)
    if not compare:
        dist.destroy_process_group()
        return
    for t in (q, k, v):
        t.grad = None
    out = function(q, k, v, causal=args.causal, layout=args.layout)
    out.backward(dout)
    whole = [gather(t, world, args.layout) for t in (q.detach(), k.detach(), v.detach(), dout, out.detach(),
                                                     q.grad, k.grad, v.grad)]
    if rank == 0:
        q1, k1, v1 = (t.clone().requires_grad_() for t in whole[:3])

        def single():
            for t in (q1, k1, v1):
                t.grad = None
            tvmflash.attention(q1, k1, v1, causal=args.causal).backward(whole[3])

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        single_ms = timed(single, device, args.iters)
        single_memory = peak_memory_mb(device)
        ref = tvmflash.attention(q1, k1, v1, causal=args.causal)
        for t in (q1, k1, v1):
            t.grad = None
        ref.backward(whole[3])
        diffs = {name: (a.float() - b.float()).abs().max().item()
                 for name, a, b in zip(("out", "dq", "dk", "dv"), whole[4:], (ref.detach(), q1.grad, k1.grad, v1.grad))}
        print(f"  one device, the whole sequence: forward + backward {single_ms:9.2f} ms, peak memory "
              f"{single_memory:9.1f} MiB" + (" (the process's, ranks' shards included)" if not use_cuda else ""))
        print("  largest difference from it: " + ", ".join(f"{n} {d:.2e}" for n, d in diffs.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
