"""A/B through tvmflash.compile on an sm_90a GPU, in one process, one kernel after another (b4 s4096 bf16,
heads 2048/d): what compile picks from the records, the sm90 schedule with 256-row blocks and 2 stages
(its defaults at commit f0476f3, where this ran for BENCHMARKS.md, session 7), and the sm80 schedule
(its records); each against SDPA's flash backend timed in the same process.

    PYTHONPATH=$PWD python benchmarks/sm90_ab.py
"""
import os, torch, tvmflash
from tvmflash.bench import time_ms, attention_flops
from torch.nn.attention import SDPBackend, sdpa_kernel
P = {"block_m": 256, "num_warpgroups": 4, "min_blocks_per_sm": 1, "num_stages": 2}
dev = torch.device("cuda")
for d in (128, 64):
    h = 2048 // d
    q, k, v = (torch.randn(4, 4096, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        fl = attention_flops(4, h, 4096, 4096, d, causal)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            t = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), dev, repeat=30)
        flash = fl / t / 1e9
        line = f"d{d} causal={int(causal)} SDPA flash {flash:.1f} |"
        for label, env, knobs in (("picked", None, None), ("sm90 block_m 256", "1", P), ("sm80", "0", None)):
            if env is None:
                os.environ.pop("TVMFLASH_SM90", None)
            else:
                os.environ["TVMFLASH_SM90"] = env
            kern = tvmflash.compile(head_dim=d, dtype="bfloat16", causal=causal, knobs=knobs)
            t = time_ms(lambda: kern(q, k, v), dev, repeat=30)
            info = kern.info()
            kn = {x: kern.knobs[x] for x in ("block_m", "block_n", "num_stages") if x in kern.knobs}
            line += f" {label} ({info['schedule']} {kn}) {fl / t / 1e9:.1f} = {fl / t / 1e9 / flash:.2f}x |"
        print(line, flush=True)
os.environ.pop("TVMFLASH_SM90", None)
