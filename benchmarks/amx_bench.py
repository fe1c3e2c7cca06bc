"""The CPU forward (and optionally backward) on AMX against the plain CPU schedule and SDPA: BENCHMARKS.md's
"CPU with AMX" table. Each configuration is checked against float32 first (``bench.error_vs_float32``'s
rule), then every backend is timed back to back in one process, best of ``--rounds`` rounds of ``--calls``
calls: the median wall clock of each round, and the process's CPU time a call (the cores may be shared,
and the CPU time leaves out the other processes' turns).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/amx_bench.py [--dtype bfloat16] [--backward] [--head-dims 64 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import tvmflash
from tvmflash import bench

TOKENS, WIDTH = 2048, 512  # batch * seqlen, heads * head_dim


def median_ms(fn, calls):
    """(wall, cpu): the median wall-clock milliseconds of ``calls`` calls, and the process's CPU time a
    call over them (all its threads): on shared cores, the wall clock also counts the other processes'
    turns, and the CPU time does not."""
    fn()
    samples = []
    cpu = time.process_time()
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), (time.process_time() - cpu) / calls * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--schedules", nargs="+", default=["default", "cpu"], help="forward: schedules beside the default")
    parser.add_argument("--backward", action="store_true", help="forward + backward through tvmflash.attention")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.dtype}, "
          f"{'forward + backward' if args.backward else 'forward'}")
    for head_dim in args.head_dims:
        for causal in map(bool, args.causal):
            for seqlen in args.seqlens:
                batch, heads = TOKENS // seqlen, WIDTH // head_dim
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, dtype=dtype) for _ in range(3))
                calls = {}
                for name in (["default"] if args.backward else args.schedules):
                    schedule = None if name == "default" else name
                    if args.backward:
                        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                        dout = torch.randn_like(q)

                        def run(qg=qg, kg=kg, vg=vg, dout=dout):  # the default schedules
                            out = tvmflash.attention(qg, kg, vg, causal=causal)
                            torch.autograd.grad(out, (qg, kg, vg), dout)
                    else:
                        kernel = tvmflash.compile(head_dim=head_dim, dtype=dtype, causal=causal, target="cpu",
                                                  schedule=schedule)
                        out = torch.empty_like(q)
                        err, bound = bench.error_vs_float32(kernel(q, k, v), q, k, v, causal)
                        ok = err <= bound
                        name = f"{name}={kernel.info()['schedule']}" + ("" if ok else f"(FAIL {err:.2e})")

                        def run(kernel=kernel, out=out):
                            kernel(q, k, v, out=out)
                    calls[name] = run
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                if args.backward:
                    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (qt, kt, vt))
                    douts = torch.randn_like(qs)

                    def sdpa():
                        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
                        torch.autograd.grad(out, (qs, ks, vs), douts)
                else:
                    def sdpa():
                        F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                calls["sdpa"] = sdpa
                best = {name: float("inf") for name in calls}
                cpu = dict(best)
                for _ in range(args.rounds):
                    for name, fn in calls.items():
                        wall, cpu_ms = median_ms(fn, args.calls)
                        best[name], cpu[name] = min(best[name], wall), min(cpu[name], cpu_ms)
                first = next(iter(calls))
                cells = " / ".join(f"{best[name]:.2f}" for name in calls)
                cpu_cells = " / ".join(f"{cpu[name]:.2f}" for name in calls)
                print(f"d{head_dim} {'causal' if causal else 'full  '} s{seqlen:<5} {' / '.join(calls)}: wall {cells} "
                      f"({best['sdpa'] / best[first]:.2f}x SDPA); cpu {cpu_cells} ({cpu['sdpa'] / cpu[first]:.2f}x)",
                      flush=True)


if __name__ == "__main__":
    main()
