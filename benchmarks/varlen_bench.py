"""Varlen prefill against the dense kernel on the same total tokens (issue 24's goal: within 5%).

    python benchmarks/varlen_bench.py                            # bf16, d64 and d128, causal and not,
                                                                 # 16k tokens as 8 x 2k (equal) or ragged
    python benchmarks/varlen_bench.py --tokens 4096 --length 512 --head-dims 128 --causal yes

Each row packs ``--tokens`` tokens into sequences: "equal" is tokens / length sequences of ``--length``,
which the dense kernel runs as a batch of them; "ragged" is random lengths of 1 to 2 x length with the
same total (the dense kernel has no such batch; its row is the equal one's). Times are
``tvmflash.bench.time_backends``' (interleaved rounds, short bursts) of ``flash_attn_varlen_func`` and
the dense kernel, both of the target's default schedule (sm90 on sm_90a), and the dense sm80 schedule
(TVMFLASH_SM90=0); TFLOP/s count each sequence's own attention (``bench.attention_flops``). Each
varlen result is checked first against the dense kernel (equal: at most 2e-2 apart) or its first
sequence against float32 attention (ragged). The kernels are built first, ``--build-jobs`` at a time.
"""

from __future__ import annotations

import argparse
import os

import torch

import tvmflash
from tvmflash import bench

HEADS_Q, HEADS_KV = 16, 16


def packings(tokens: int, length: int, seed: int) -> dict:
    """{name: sequence lengths summing to ``tokens``}: equal ones, and ragged ones of 1 .. 2 x length."""
    gen = torch.Generator().manual_seed(seed)
    ragged, left = [], tokens
    while left:
        ragged.append(min(left, int(torch.randint(1, 2 * length + 1, (1,), generator=gen))))
        left -= ragged[-1]
    return {"equal": [length] * (tokens // length), "ragged": ragged}


def dense_kernel(head_dim, dtype, causal, sm90: str):
    """The dense kernel with TVMFLASH_SM90 set to ``sm90`` while it is made ("": the default)."""
    saved = os.environ.pop("TVMFLASH_SM90", None)
    if sm90:
        os.environ["TVMFLASH_SM90"] = sm90
    try:
        return tvmflash.compile(head_dim=head_dim, dtype=dtype, causal=causal)
    finally:
        os.environ.pop("TVMFLASH_SM90", None)
        if saved is not None:
            os.environ["TVMFLASH_SM90"] = saved


def run(tokens, length, head_dim, causal, dtype, device, repeat):
    """Print one line per packing: ms and TFLOP/s of varlen and both dense kernels."""
    for name, lengths in packings(tokens, length, seed=head_dim).items():
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        q, k, v = (torch.randn(tokens, HEADS_Q, head_dim, device=device, dtype=dtype) for _ in range(3))
        longest = max(lengths)

        def varlen(q=q, k=k, v=v, cu=cu, longest=longest):
            return tvmflash.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)

        batch = tokens // length
        dense_q, dense_k, dense_v = (t[:batch * length].view(batch, length, HEADS_Q, head_dim) for t in (q, k, v))
        calls = {"varlen": varlen}
        for label, setting in (("dense", ""), ("dense sm80", "0")):
            kernel = dense_kernel(head_dim, dtype, causal, setting)
            calls[label] = lambda kernel=kernel, dense=(dense_q, dense_k, dense_v): kernel(*dense)
        out = varlen()
        if name == "equal":
            gap = (out.float() - calls["dense"]().reshape(out.shape).float()).abs().max().item()
            assert gap < 2e-2, f"varlen and dense are {gap:.3e} apart"
        else:
            first = [t[:lengths[0]].transpose(0, 1)[None].float() for t in (q, k, v)]
            expected = torch.nn.functional.scaled_dot_product_attention(*first, is_causal=causal)[0].transpose(0, 1)
            gap = (out[:lengths[0]].float() - expected).abs().max().item()
            assert gap < 2e-2, f"varlen's first sequence is {gap:.3e} from float32"
        times = bench.time_backends(calls, device, repeat)
        flops = {"varlen": sum(bench.attention_flops(1, HEADS_Q, n, n, head_dim, causal) for n in lengths),
                 "dense": bench.attention_flops(batch, HEADS_Q, length, length, head_dim, causal)}
        cells = [f"{label} {ms:.3f} ms {flops['varlen' if label == 'varlen' else 'dense'] / ms / 1e9:.0f} TFLOP/s"
                 for label, ms in times.items()]
        print(f"d{head_dim} {'causal' if causal else 'full':6} {name:6} ({len(lengths)} seqs, max {longest}): "
              + " | ".join(cells) + f" | varlen/dense time {times['varlen'] / times['dense']:.2f}x, "
              f"/ dense sm80 {times['varlen'] / times['dense sm80']:.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="total tokens of a packing")
    parser.add_argument("--length", type=int, default=2048, help="the equal packing's sequence length")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--build-jobs", type=int, default=8, help="kernels built at once, before timing")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    causals = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    if device.type == "cuda" and args.build_jobs > 1:
        shapes = [{"head_dim": d, "dtype": str(dtype).split(".")[-1], "causal": c, "heads_q": HEADS_Q, "heads_kv": HEADS_KV}
                  for d in args.head_dims for c in causals]
        bench.build_in_parallel([("compile", {**shape, **flag}) for shape in shapes for flag in ({"varlen": True}, {})],
                                args.build_jobs)
        saved = os.environ.get("TVMFLASH_SM90")
        os.environ["TVMFLASH_SM90"] = "0"  # the dense sm80 kernels (spawned builds inherit it)
        try:
            bench.build_in_parallel([("compile", shape) for shape in shapes], args.build_jobs)
        finally:
            os.environ.pop("TVMFLASH_SM90")
            if saved is not None:
                os.environ["TVMFLASH_SM90"] = saved
    for head_dim in args.head_dims:
        for causal in causals:
            run(args.tokens, args.length, head_dim, causal, dtype, device, args.repeat)


if __name__ == "__main__":
    main()
