"""Check and time the sm80 schedule's row_state knob ("shared" vs "registers") on a GPU.

Self-contained: `PYTHONPATH=. python benchmarks/row_state_check.py` on a machine with a CUDA GPU.

1. Numerics: both knob values against torch SDPA in float32 (math backend), for head_dim 64/128,
   bf16/fp16, causal or not, seqlen_q 1000, seqlen_k 1037, GQA 4 query heads / 2 KV heads, with
   flash-attn's rule: max error <= 2 x (torch same-dtype SDPA's max error) + 1e-5. Outputs are
   poisoned with NaN first. LSE is checked against float32 logsumexp.
2. Timing: batch 4, heads 16, seqlen 4096, head_dim 128, bf16, non-causal (and causal), both knob
   values against SDPA's flash backend (median of CUDA-event timings).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

import tvmflash

ROW_STATES = ("shared", "registers")


def sdpa(q, k, v, causal, backend=None):
    """SDPA on flash-attn layout (b, s, h, d); GQA by repeating K/V heads. Bottom-right causal mask."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt = kt.repeat_interleave(hq // hkv, dim=1)
    vt = vt.repeat_interleave(hq // hkv, dim=1)
    mask = None
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        mask = j <= i + sk - sq
    if backend is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    else:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return out.transpose(1, 2)


def lse_ref(q, k, causal):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    kk = k.float().repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) / math.sqrt(d)
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(~(j <= i + sk - sq), float("-inf"))
    return torch.logsumexp(s, dim=-1)


def check(seed=0):
    failures = 0
    for head_dim in (64, 128):
        for dtype in (torch.bfloat16, torch.float16):
            for causal in (False, True):
                g = torch.Generator(device="cuda").manual_seed(seed)
                q = torch.randn(2, 1000, 4, head_dim, device="cuda", dtype=dtype, generator=g)
                k = torch.randn(2, 1037, 2, head_dim, device="cuda", dtype=dtype, generator=g)
                v = torch.randn(2, 1037, 2, head_dim, device="cuda", dtype=dtype, generator=g)
                ref = sdpa(q.float(), k.float(), v.float(), causal)
                ref_lse = lse_ref(q, k, causal)
                torch_err = (sdpa(q, k, v, causal).float() - ref).abs().max().item()
                for row_state in ROW_STATES:
                    kernel = tvmflash.compile(head_dim=head_dim, dtype=dtype, causal=causal,
                                              knobs={"row_state": row_state})
                    out = torch.full_like(q, float("nan"))
                    out, lse = kernel(q, k, v, out=out, return_lse=True)
                    torch.cuda.synchronize()
                    err = (out.float() - ref).abs().max().item()
                    lse_err = (lse - ref_lse).abs().max().item()
                    ok = math.isfinite(err) and err <= 2 * torch_err + 1e-5 and lse_err <= 1e-3
                    failures += not ok
                    print(f"d{head_dim} {str(dtype)[6:]:8} causal={causal!s:5} {row_state:9}: err {err:.3e} "
                          f"(torch {torch_err:.3e}) lse err {lse_err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return failures


def bench(fn, repeat=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def timing(batch=4, heads=16, seqlen=4096, head_dim=128):
    from torch.nn.attention import SDPBackend

    for causal in (False, True):
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
        ms = bench(lambda: sdpa(q, k, v, causal, backend=SDPBackend.FLASH_ATTENTION))
        print(f"causal={causal!s:5} SDPA flash     : {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
        for row_state in ROW_STATES:
            kernel = tvmflash.compile(head_dim=head_dim, dtype=torch.bfloat16, causal=causal,
                                      knobs={"row_state": row_state})
            out = torch.empty_like(q)
            kernel(q, k, v, out=out)
            ms = bench(lambda: kernel(q, k, v, out=out))
            print(f"causal={causal!s:5} tvmflash {row_state:9}: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s",
                  flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    failures = check()
    timing()
    print(f"{failures} numerics failure(s)")
    sys.exit(1 if failures else 0)
