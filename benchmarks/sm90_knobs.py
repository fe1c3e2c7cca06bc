"""sm90 knob variants (the producer warpgroup of tvmflash.lowering.tma_producer_warpgroup, block_n, stages) built in
parallel, checked against an fp32 reference (flash-attn's rule: error <= 2x cuDNN's bf16 error + 1e-5),
timed interleaved with cuDNN in one process, on an sm_90a GPU. VARIANTS: name -> knobs, per head_dim.

    python benchmarks/sm90_knobs.py [HEAD_DIM ...] [VARIANT ...]   # e.g. 128 (all three take ~6 minutes)

VARIANT names some of VARIANTS (the default is always timed: the ratios are against it).
"""
import json, multiprocessing as mp, os, sys, tempfile, time
os.environ["TVMFLASH_SM90"] = "1"
os.environ.setdefault("TVMFLASH_CACHE_DIR", tempfile.mkdtemp())
WG = {"producer": "warpgroup", "min_blocks_per_sm": 1}
QSW = {"q_layout": "swizzled"}
VARIANTS = {
    128: {"default": None, "q_swizzled": dict(QSW), "wg_bn128_qsw": {**WG, **QSW, "block_n": 128},
          "wg_bn128_ns3_qsw": {**WG, **QSW, "block_n": 128, "num_stages": 3},
          "thread_bn128_ns3_mb1_qsw": {**QSW, "block_n": 128, "num_stages": 3, "min_blocks_per_sm": 1},
          # Q by TMA, the output stored from the registers
          "wg_bn128_ns3_qtma_direct": {**WG, **QSW, "block_n": 128, "num_stages": 3, "q_copy": "tma",
                                       "o_store": "direct"},
          "wg_bn128_ns3_qtma": {**WG, **QSW, "block_n": 128, "num_stages": 3, "q_copy": "tma"},
          # and FA3's intra-warpgroup overlap (PV(j-1) issued with QK^T(j)), as the lab's prod_pvlag_bn128_ns3
          "wg_bn128_ns3_overlap": {**WG, **QSW, "block_n": 128, "num_stages": 3, "overlap": 1},
          "wg_bn128_ns3_overlap_qtma_direct": {**WG, **QSW, "block_n": 128, "num_stages": 3, "overlap": 1,
                                               "q_copy": "tma", "o_store": "direct"},
          "wg_bn128_ns3_overlap_qtma": {**WG, **QSW, "block_n": 128, "num_stages": 3, "overlap": 1, "q_copy": "tma"},
          "wg_bn128_ns3_overlap_direct": {**WG, **QSW, "block_n": 128, "num_stages": 3, "overlap": 1, "o_store": "direct"},
          "thread_bn128_ns3_mb1_overlap": {**QSW, "block_n": 128, "num_stages": 3, "min_blocks_per_sm": 1, "overlap": 1},
          "thread_bn128_ns3_mb1_overlap_qtma_direct": {**QSW, "block_n": 128, "num_stages": 3, "min_blocks_per_sm": 1,
                                                       "overlap": 1, "q_copy": "tma", "o_store": "direct"}},
    64: {"default": None, "q_swizzled": dict(QSW), "wg_bn128_ns3_qsw": {**WG, **QSW, "block_n": 128, "num_stages": 3}},
    256: {"default": None, "q_swizzled": dict(QSW)},
    # the 64-byte swizzle (K/V by TMA in 32-column groups) against d96's padded core matrices
    96: {"default": None, "kv_tma": {"kv_layout": "swizzled", "kv_copy": "tma", "num_stages": 2},
         "kv_tma_ns3": {"kv_layout": "swizzled", "kv_copy": "tma", "num_stages": 3},
         "kv_tma_qsw": {"kv_layout": "swizzled", "kv_copy": "tma", "num_stages": 2, **QSW},
         "kv_tma_qtma": {"kv_layout": "swizzled", "kv_copy": "tma", "num_stages": 2, **QSW, "q_copy": "tma"},
         "kv_tma_bn128_mb1": {"kv_layout": "swizzled", "kv_copy": "tma", "num_stages": 2, "block_n": 128,
                              "min_blocks_per_sm": 1},
         "wg_bn128_ns3": {**WG, "kv_layout": "swizzled", "kv_copy": "tma", "num_stages": 3, "block_n": 128}},
}
HEADS = {64: 16, 96: 16, 128: 16, 256: 8}
CAUSAL = (False, True)
SHAPES = ((16, 1024), (4, 4096), (2, 8192))


def build(job):
    d, causal, name = job
    import tvmflash
    t = time.time()
    try:
        tvmflash.compile(head_dim=d, dtype="bfloat16", causal=causal, knobs=VARIANTS[d][name], heads_q=HEADS[d], heads_kv=HEADS[d])
        return f"built d{d} c{int(causal)} {name} {time.time() - t:.0f} s"
    except Exception as e:  # noqa
        return f"FAILED d{d} c{int(causal)} {name}: {type(e).__name__}: {str(e)[-300:]}"


if __name__ == "__main__":
    only = {a for a in sys.argv[1:] if a.isdigit()}
    names = {a for a in sys.argv[1:] if not a.isdigit()}
    dims = [d for d in VARIANTS if not only or str(d) in only]
    for d in dims:
        VARIANTS[d] = {n: k for n, k in VARIANTS[d].items() if not names or n in names or n == "default"}
    jobs = [(d, c, n) for d in dims for c in CAUSAL for n in VARIANTS[d]]
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(16, len(jobs))) as pool:
        for line in pool.imap_unordered(build, jobs):
            print(line, flush=True)
    print(f"builds {time.time() - t0:.0f} s", flush=True)
    import torch, tvmflash
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from tvmflash.bench import time_ms
    dev = torch.device("cuda")
    for d in dims:
        H = HEADS[d]
        for causal in CAUSAL:
            kernels = {n: tvmflash.compile(head_dim=d, dtype="bfloat16", causal=causal, knobs=k) for n, k in VARIANTS[d].items()}
            for B, S in SHAPES:
                g = torch.Generator(device="cuda").manual_seed(S + d)
                q, k, v = (torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                ref = torch.nn.functional.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), is_causal=causal).transpose(1, 2)
                flops = 4 * B * H * S * S * d // (2 if causal else 1)
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    base = (f().transpose(1, 2).float() - ref).abs().max().item()
                    calls, errs = {"cudnn": f}, {}
                    for n, kern in kernels.items():
                        out = torch.full_like(q, float("nan"))
                        kern(q, k, v, out=out)
                        errs[n] = (out.float() - ref).abs().max().item()
                        calls[n] = (lambda kern=kern, out=out: kern(q, k, v, out=out))
                    res = {}
                    for rep in range(3):
                        for n, c in calls.items():
                            res.setdefault(n, []).append(flops / time_ms(c, dev, repeat=15) / 1e9)
                best = {n: max(x) for n, x in res.items()}
                ok = all(e <= 2 * base + 1e-5 for e in errs.values())
                print(f"d{d} c{int(causal)} b{B} s{S}: " + ", ".join(
                    f"{n} {t:.0f}" + ("" if n == "cudnn" else f" ({t / best['cudnn']:.2f}x, {t / best['default']:.3f} def)") for n, t in best.items())
                    + f" | numerics {'OK' if ok else 'FAIL'} max err {max(errs.values()):.1e} (cuDNN {base:.1e})"
                    + ("" if ok else " " + json.dumps({n: f"{e:.1e}" for n, e in errs.items()})), flush=True)
