"""Device check (H100/H200, sm_90a): the experimental wgmma schedule (schedules/sm90.py) for the
whole attention program, against torch SDPA in float32, then timed against SDPA's flash backend.

The schedule under test keeps the online softmax on the wgmma accumulator registers and feeds P
to the PV wgmma from registers ("rs" form), with the A-register layout taken to be the
accumulator layout of S, 16 columns at a time (CUTLASS's ALayout_64x16 == CLayout_64x16) and
each 32-bit A register packing two consecutive columns, the lower one in the low half. A wrong
layout pairs P's values with the wrong keys of V (or rows of O): it shows here as an error far
above the tolerance in every case, not as NaN.

Correctness: head_dim 64 and 128, bf16 and fp16, causal (bottom-right aligned, as tvmflash and
flash-attn align it) and not, odd lengths (seqlen_q 1000, seqlen_k 1037), GQA (4 query heads on
2 K/V heads); the output is poisoned with NaN first, so an element never written fails. A case
passes by flash-attn's rule: its max error against the float32 reference is at most 2x that of
torch's own attention in the input dtype, + 1e-5; LSE within 1e-4 relative.

Speed: batch 4, heads 16, seqlen 4096, head_dim 128, bf16, non-causal and causal: tvmflash sm90,
tvmflash sm80 (the default schedule on this GPU today) and SDPA FLASH_ATTENTION, median of 20
runs (CUDA events); causal FLOPs are halved, as flash-attn counts them.

    PYTHONPATH=$PWD python benchmarks/sm90_attention.py            # exit 1 if a case fails
    PYTHONPATH=$PWD python benchmarks/sm90_attention.py --no-bench
"""

from __future__ import annotations

import os
import sys
import time

os.environ["TVMFLASH_SM90"] = "1"  # before tvmflash chooses a schedule

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import tvmflash  # noqa: E402
from tvmflash.bench import attention_flops, time_ms  # noqa: E402

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def sdpa_reference(q, k, v, causal, dtype=torch.float32):
    """SDPA in ``dtype`` on flash-attn layout; causal aligned bottom-right. Returns (out, lse)."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    mask = None
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        mask = j <= i + sk - sq
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    s = (qh.float() @ kh.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return out.transpose(1, 2), torch.logsumexp(s, dim=-1)


def check(head_dim, dtype, causal, batch=2, seqlen_q=1000, seqlen_k=1037, heads_q=4, heads_kv=2):
    gen = torch.Generator(device="cuda").manual_seed(head_dim + causal)
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, device="cuda", generator=gen).to(TORCH[dtype])
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", generator=gen).to(TORCH[dtype])
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", generator=gen).to(TORCH[dtype])
    start = time.perf_counter()
    kern = tvmflash.compile(head_dim=head_dim, dtype=dtype, causal=causal, target="cuda")
    schedule = kern.info()["schedule"]
    out = torch.full_like(q, float("nan"))
    out, lse = kern(q, k, v, out=out, return_lse=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ref, ref_lse = sdpa_reference(q, k, v, causal)
    same_dtype, _ = sdpa_reference(q, k, v, causal, dtype=TORCH[dtype])
    err = (out.float() - ref).abs().max().item()
    torch_err = (same_dtype.float() - ref).abs().max().item()
    lse_err = (lse - ref_lse).abs().max().item()
    ok = (schedule == "sm90" and torch.isfinite(out).all().item() and err <= 2 * torch_err + 1e-5
          and lse_err <= 1e-4 * (1 + ref_lse.abs().max().item()))
    print(f"{'PASS' if ok else 'FAIL'} d{head_dim} {dtype} causal={causal} sq={seqlen_q} sk={seqlen_k} "
          f"hq={heads_q} hkv={heads_kv} [{schedule}]: max |out - fp32 SDPA| {err:.3e} (torch {dtype}: "
          f"{torch_err:.3e}), max lse error {lse_err:.3e}, NaN {int(torch.isnan(out).sum())} "
          f"(build+run {seconds:.1f} s)", flush=True)
    return ok


def compile_with(sm90, **kwargs):
    """tvmflash.compile with the sm90 schedule opted in or out (TVMFLASH_SM90 is read at compile)."""
    os.environ["TVMFLASH_SM90"] = "1" if sm90 else "0"
    try:
        return tvmflash.compile(**kwargs)
    finally:
        os.environ["TVMFLASH_SM90"] = "1"


def bench(batch=4, heads=16, seqlen=4096, head_dim=128, dtype="bfloat16"):
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=TORCH[dtype]) for _ in range(3))
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    out = torch.empty_like(q)
    cuda = torch.device("cuda")
    for causal in (False, True):
        flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
        results = {}
        for sm90 in (True, False):
            kern = compile_with(sm90, head_dim=head_dim, dtype=dtype, causal=causal, target="cuda")
            schedule = kern.info()["schedule"]
            assert (schedule == "sm90") == sm90, kern.info()
            kern(q, k, v, out=out)  # build outside the timing
            results[f"tvmflash {schedule}"] = time_ms(lambda: kern(q, k, v, out=out), cuda)  # noqa: B023
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            results["SDPA flash"] = time_ms(
                lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal), cuda)  # noqa: B023
        print(f"speed: batch {batch}, heads {heads}, seqlen {seqlen}, d{head_dim}, {dtype}, "
              f"{'causal' if causal else 'non-causal'}", flush=True)
        for name, ms in results.items():
            print(f"  {name:16s} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)


def main():
    print(torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(), flush=True)
    results = []
    for head_dim in (64, 128):
        for dtype in ("bfloat16", "float16"):
            for causal in (False, True):
                try:
                    results.append(check(head_dim, dtype, causal))
                except Exception as err:  # noqa: BLE001 - report and go on
                    print(f"FAIL d{head_dim} {dtype} causal={causal}: {type(err).__name__}: {str(err)[-3000:]}",
                          flush=True)
                    results.append(False)
    print(f"{sum(results)}/{len(results)} correctness cases passed", flush=True)
    if "--no-bench" not in sys.argv:
        try:
            bench()
        except Exception as err:  # noqa: BLE001
            print(f"bench failed: {type(err).__name__}: {str(err)[-3000:]}")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
