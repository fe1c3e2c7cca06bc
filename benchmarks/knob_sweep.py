"""Time the sm80 schedule over a grid of knobs on this GPU (how its defaults were picked).

    python benchmarks/knob_sweep.py [--seqlen 4096] [--head-dim 64 128]

Each configuration is checked against a float32 reference (flash-attn's error rule) before it
is timed; the table ends with the fastest configuration per head_dim.
"""

import argparse
import itertools

import torch

from tvmflash import bench, compile

parser = argparse.ArgumentParser()
parser.add_argument("--seqlen", type=int, default=4096)
parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
parser.add_argument("--causal", action="store_true")
args = parser.parse_args()

device = torch.device("cuda")
for head_dim in args.head_dim:
    heads, batch = 2048 // head_dim, max(1, 16384 // args.seqlen)
    results = []
    for block_m, block_n in itertools.product([64, 128], [32, 64, 128]):
        knobs = {"block_m": block_m, "num_warps": block_m // 32, "block_n": block_n}
        try:
            kernel = compile(head_dim=head_dim, dtype="bfloat16", causal=args.causal, knobs=knobs)
            r = bench.run_one(kernel, batch, args.seqlen, heads, head_dim, "bfloat16", args.causal, device, 10)
        except Exception as err:  # noqa: BLE001 - a knob setting that does not build or run is reported
            print(f"d{head_dim} {knobs}: failed: {str(err).splitlines()[0][:120]}")
            continue
        ms = r.times_ms["tvmflash"]
        ok = r.error <= r.tolerance
        results.append((ms, knobs, ok))
        print(f"d{head_dim} {knobs}: {ms:.3f} ms {r.flops / ms / 1e9:.1f} TFLOP/s "
              f"(sdpa-flash {r.flops / r.times_ms['sdpa-flash'] / 1e9:.1f}) err {r.error:.2e} {'ok' if ok else 'WRONG'}")
    good = [x for x in results if x[2]]
    if good:
        ms, knobs, _ = min(good, key=lambda x: x[0])
        print(f"best for d{head_dim}: {knobs} at {ms:.3f} ms")
