"""Build the sm80 and sm90 kernels on a machine with no GPU and look at what they contain.

    python examples/cross_compile.py
"""

import re

import tvmflash

for target in ("sm80", "sm90"):
    kernel = tvmflash.compile(head_dim=128, dtype="bfloat16", causal=True, target=target)
    src = kernel.source(heads_q=32, heads_kv=8)
    counts = {op: len(re.findall(op, src)) for op in ("mma.sync", "ldmatrix", "cp.async", "wgmma", "__shared__")}
    print(f"{kernel!r}: {len(src)} bytes of CUDA, schedule {kernel.info()['schedule']}, {counts}")
    with open(f"attention_{target}.cu", "w") as f:
        f.write(src)
