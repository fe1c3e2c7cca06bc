"""The CPU backward with dkdv's dq share (the knob ``dq_atomic``) against the dq pass, and both against torch
SDPA, in CPU time (``time.process_time``, best of ``--calls``) so that other work on the cores counts less:

    OMP_NUM_THREADS=1 TVM_NUM_THREADS=1 python benchmarks/cpu_backward_dq.py [--calls 5] [--schedule cpu]

The CPU grid: batch x seqlen = 2048 tokens, heads x head_dim = 512; float32 and bf16, d64 and d128, full and
causal. Prints per row the backward alone (dq pass, dq share, SDPA's) and forward + backward (tvmflash's
forward plus each backward; SDPA's forward and backward through autograd), with SDPA's time over ours (above
1.00x, tvmflash is faster). With threads beside the process's one, the CPU time is summed over them
(``--wall``: wall-clock time instead)."""

import argparse
import time

import torch
import torch.nn.functional as F

import tvmflash


CLOCK = time.process_time  # --wall: time.perf_counter


def best(fn, calls):
    fn()
    times = []
    for _ in range(calls):
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
    return min(times) * 1e3


def pass_knobs(head_dim, dtype, schedule):
    """The knobs of the dq pass, as ``BackwardKernel`` takes it where the tasks are few (the tiles the
    schedule gives a dq pass)."""
    chosen = tvmflash.compile_backward(head_dim=head_dim, dtype=dtype, schedule=schedule).schedule.backward.knobs
    return {**chosen.dq_pass_by_head_dim.get(head_dim, {}), "dq_atomic": False}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--schedule", default=None, help="the backward's and forward's schedule (default: the target's)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--seqlens", default="512,2048")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--wall", action="store_true", help="wall-clock time (with several threads) instead")
    args = parser.parse_args()
    if args.wall:
        global CLOCK
        CLOCK = time.perf_counter
    torch.manual_seed(0)
    print(f"{'case':34} {'bwd pass':>9} {'bwd share':>9} {'sdpa bwd':>9} {'x':>5} | {'f+b pass':>9} {'f+b share':>9} "
          f"{'sdpa f+b':>9} {'x pass':>6} {'x share':>7}")
    for dtype in map(lambda name: getattr(torch, name), args.dtypes.split(",")):
        for head_dim in map(int, args.head_dims.split(",")):
            for seqlen in map(int, args.seqlens.split(",")):
                batch, heads = 2048 // seqlen, 512 // head_dim
                for causal in (False, True):
                    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, dtype=dtype) for _ in range(3))
                    dout = torch.randn_like(q)
                    forward = tvmflash.compile(head_dim=head_dim, dtype=dtype, causal=causal, schedule=args.schedule)
                    out, lse = forward(q, k, v, return_lse=True)
                    fwd = best(lambda: forward(q, k, v, return_lse=True), args.calls)
                    bwd = {}
                    for atomic in (False, True):
                        kernel = tvmflash.compile_backward(head_dim=head_dim, dtype=dtype, causal=causal,
                                                           knobs=None if atomic else pass_knobs(head_dim, dtype, args.schedule),
                                                           schedule=args.schedule)
                        assert kernel.dq_atomic == atomic
                        bwd[atomic] = best(lambda: kernel(q, k, v, out, dout, lse), args.calls)
                    leaves = [t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
                    dout_t = dout.transpose(1, 2)
                    sdpa_out = F.scaled_dot_product_attention(*leaves, is_causal=causal)

                    def sdpa_backward():
                        for t in leaves:
                            t.grad = None
                        sdpa_out.backward(dout_t, retain_graph=True)

                    def sdpa_step():
                        for t in leaves:
                            t.grad = None
                        F.scaled_dot_product_attention(*leaves, is_causal=causal).backward(dout_t)

                    sdpa_bwd, sdpa_both = best(sdpa_backward, args.calls), best(sdpa_step, args.calls)
                    name = f"{str(dtype).removeprefix('torch.')} d{head_dim} s{seqlen} b{batch} h{heads} " \
                           f"{'causal' if causal else 'full'}"
                    both = {atomic: fwd + bwd[atomic] for atomic in bwd}
                    print(f"{name:34} {bwd[False]:9.1f} {bwd[True]:9.1f} {sdpa_bwd:9.1f} {sdpa_bwd / bwd[True]:5.2f} | "
                          f"{both[False]:9.1f} {both[True]:9.1f} {sdpa_both:9.1f} {sdpa_both / both[False]:6.2f} "
                          f"{sdpa_both / both[True]:7.2f}", flush=True)


if __name__ == "__main__":
    main()
