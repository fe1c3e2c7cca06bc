"""What indexing in int64 costs: the same problem through its int32 module and through the int64 one
(``kernels.checks.needs_int64`` forced true where the kernels call it), decode and forward, on the GPU. Problems of 2**31 elements or
more always take the int64 module; smaller ones the int32 module, so this measures what a problem
just past 2**31 pays.

    python benchmarks/int64_bench.py          # bf16, d128: decode GQA 32/8 batch 32 at 16k keys; forward 8k causal
"""

import torch

import tvmflash
from tvmflash import bench
from tvmflash.kernels import build, decode


def timed(fn, wide: bool) -> float:
    saved_decode, saved_build = decode.needs_int64, build.needs_int64
    if wide:
        decode.needs_int64 = build.needs_int64 = lambda *tensors: True
    try:
        return bench.time_ms(fn, torch.device("cuda"), warmup=3, repeat=30)
    finally:
        decode.needs_int64, build.needs_int64 = saved_decode, saved_build


def main():
    device, dtype, d = "cuda", torch.bfloat16, 128
    batch, keys, heads_q, heads_kv = 32, 16384, 32, 8
    k_cache = torch.randn(batch, keys, heads_kv, d, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, 1, heads_q, d, device=device, dtype=dtype)
    lengths = torch.full((batch,), keys, dtype=torch.int32, device=device)
    gigabytes = 2 * k_cache.numel() * 2 / 1e9

    def decode_call():
        return tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)

    narrow = timed(decode_call, False)
    wide = timed(decode_call, True)
    print(f"decode b{batch} {keys} keys GQA {heads_q}/{heads_kv} d{d}: int32 {narrow:.3f} ms ({gigabytes / narrow:.2f} TB/s), "
          f"int64 {wide:.3f} ms ({gigabytes / wide:.2f} TB/s), int64/int32 {wide / narrow:.3f}")
    for causal in (True,):  # the build the GPU test of the forward makes
        qf, kf, vf = (torch.randn(8, 8192, 8, d, device=device, dtype=dtype) for _ in range(3))

        def forward_call(qf=qf, kf=kf, vf=vf, causal=causal):
            return tvmflash.attention(qf, kf, vf, causal=causal)

        narrow, wide = timed(forward_call, False), timed(forward_call, True)
        flops = bench.attention_flops(8, 8, 8192, 8192, d, causal)
        print(f"forward b8 8k h8 d{d} causal={causal}: int32 {narrow:.3f} ms ({flops / narrow / 1e9:.0f} TFLOP/s), "
              f"int64 {wide:.3f} ms ({flops / wide / 1e9:.0f} TFLOP/s), int64/int32 {wide / narrow:.3f}")


if __name__ == "__main__":
    main()
