"""FA3's structures in a hand-written kernel (CPU part): a hand-written FlashAttention forward (d128, bf16, non-causal, seqlen a multiple of 64)
with the sm90 TMA build's structure, to try FA3's overlaps where ptxas can be watched:
  base    : per K/V tile: QK^T, wait, softmax, PV, wait (what tvmflash's sm90 schedule emits);
  qkahead : QK^T of tile j+1 is issued before the softmax of tile j (S double-buffered), one wait a tile;
  pvlag   : FA3's intra-warpgroup overlap: PV of tile j-1 runs under the softmax of tile j.
  pp      : pvlag plus FA3's ping-pong of the two warpgroups on named barriers;
  prod_*  : a producer warpgroup issues every TMA copy (setmaxnreg 24/240, 384 threads).
helpers.cuh is the helper code of tvmflash's sm90 build (wgmma, mbarrier, TMA, descriptors), as TVM
emits it. Writes fa_<name>.cu/.cubin and lab.json into OUT (default /tmp/fa3_structures); prints
ptxas's register/spill lines and C75xx warnings. BENCHMARKS.md, session 10, has the results.

    python benchmarks/fa3_structures/gen.py [OUT [NAME ...]]        # needs nvcc
    python benchmarks/fa3_structures/run.py [OUT [NAME ...]]        # on an sm_90a GPU, with CuPy
    python benchmarks/fa3_structures/sass.py OUT/fa_NAME.cubin      # HGMMA / wait / MUFU order"""
import json, os, subprocess, sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/fa3_structures"
ACC = ", ".join(f"acc[{i}]" for i in range(64))


def wgmma_helpers(bn):
    """ss m64n{bn}k16 (QK^T) and rs m64n128k16 (PV), bf16 -> f32, as TVM's table emits them."""
    n = bn // 2
    outs = ", ".join(f"%{i}" for i in range(n))
    cons_s = ", ".join('"+f"(d[%d])' % i for i in range(n))
    cons_r = ", ".join('"+f"(d[%d])' % i for i in range(64))
    ss = (f"__device__ __forceinline__ void wgmma_qk(float* d, unsigned long long a, unsigned long long b) {{\n"
          f'  asm volatile("{{ wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.bf16.bf16 {{{outs}}}, %{n}, %{n + 1}, 1, 1, 1, 0, 0; }}"\n'
          f'    : {cons_s} : "l"(a), "l"(b));\n}}\n')
    outs = ", ".join(f"%{i}" for i in range(64))
    rs = ("__device__ __forceinline__ void wgmma_pv(float* d, const unsigned* p, unsigned long long b) {\n"
          f'  asm volatile("{{ wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {{{outs}}}, {{%64, %65, %66, %67}}, %68, 1, 1, 1, 1; }}"\n'
          f'    : {cons_r} : "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]), "l"(b));\n}}\n')
    return ss + rs

KERNEL = r'''
#define D 128
#define BM 128
#define TILE_BYTES (2 * BN * D * 2)
typedef nv_bfloat16 bf16;

__device__ __forceinline__ void qk(float* S, const bf16* Qs, const bf16* Kt, int wg) {
  tvm_builtin_ptx_wgmma_fence_fence_sync_aligned();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    unsigned long long a = tvmflash_wgmma_descriptor(Qs + (kk / 4) * BM * 64 + wg * 64 * 64 + (kk % 4) * 16, 1, 64, 1);
    unsigned long long b = tvmflash_wgmma_descriptor(Kt + (kk / 4) * BN * 64 + (kk % 4) * 16, 1, 64, 1);
    wgmma_qk(S, a, b);
  }
  tvm_builtin_ptx_wgmma_commit_group_commit_group_sync_aligned();
}

__device__ __forceinline__ void pv(float* acc, unsigned* Pc, const bf16* Vt) {
  tvm_builtin_ptx_wgmma_fence_fence_sync_aligned();
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    unsigned long long b = tvmflash_wgmma_descriptor(Vt + kk * 16 * 64, BN * 8, 64, 1);
    wgmma_pv(acc, Pc + 4 * kk, b);
  }
  tvm_builtin_ptx_wgmma_commit_group_commit_group_sync_aligned();
}

// FA3's ping-pong: a warpgroup issues its GEMMs in its turn (named barrier 1 + wg), then hands the turn over
__device__ __forceinline__ void pp_sync(int wg) { asm volatile("bar.sync %0, 256;" :: "r"(1 + wg) : "memory"); }
__device__ __forceinline__ void pp_arrive(int wg) { asm volatile("bar.arrive %0, 256;" :: "r"(1 + wg) : "memory"); }
__device__ __forceinline__ void wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
__device__ __forceinline__ void fence32(float* x) {
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) tvmflash_wgmma_reg_fence(x[i]);
}
__device__ __forceinline__ void fence64(float* x) {
#pragma unroll
  for (int i = 0; i < 64; ++i) tvmflash_wgmma_reg_fence(x[i]);
}
__device__ __forceinline__ void fence16u(unsigned* x) {
#pragma unroll
  for (int i = 0; i < BN / 4; ++i) tvmflash_wgmma_reg_fence_u32(x[i]);
}
__device__ __forceinline__ void zero32(float* x) {
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) x[i] = 0.f;
}

// the online softmax of one tile's scores S (wgmma accumulator layout: S[4i], S[4i+1] row r, S[4i+2], S[4i+3] row r+8)
__device__ __forceinline__ void softmax(const float* S, float* P, float* m, float* l, float* alpha, float scale2) {
  float mt[2] = {-1e30f, -1e30f};
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) {
    mt[0] = max(mt[0], S[4 * i]); mt[0] = max(mt[0], S[4 * i + 1]);
    mt[1] = max(mt[1], S[4 * i + 2]); mt[1] = max(mt[1], S[4 * i + 3]);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mt[r] = max(mt[r], __shfl_xor_sync(0xffffffff, mt[r], 1));
    mt[r] = max(mt[r], __shfl_xor_sync(0xffffffff, mt[r], 2));
  }
  float mn[2], lt[2] = {0.f, 0.f};
#pragma unroll
  for (int r = 0; r < 2; ++r) { mn[r] = max(m[r], mt[r]); alpha[r] = exp2f((m[r] - mn[r]) * scale2); m[r] = mn[r]; }
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) P[i] = exp2f(S[i] * scale2 - mn[(i >> 1) & 1] * scale2);
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) { lt[0] += P[4 * i] + P[4 * i + 1]; lt[1] += P[4 * i + 2] + P[4 * i + 3]; }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lt[r] += __shfl_xor_sync(0xffffffff, lt[r], 1);
    lt[r] += __shfl_xor_sync(0xffffffff, lt[r], 2);
    l[r] = l[r] * alpha[r] + lt[r];
  }
}
__device__ __forceinline__ void cast(const float* P, unsigned* Pc) {
#pragma unroll
  for (int i = 0; i < BN / 4; ++i) {
    __nv_bfloat162 h = __floats2bfloat162_rn(P[2 * i], P[2 * i + 1]);
    Pc[i] = *(unsigned*)&h;
  }
}
__device__ __forceinline__ void rescale(float* acc, const float* alpha) {
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] *= alpha[(i >> 1) & 1];
}

extern "C" __global__ void __launch_bounds__(PRODUCER_WG ? 384 : 256, MINB) fa(const void* qmap, const void* kmap, const void* vmap,
                                                            bf16* __restrict__ O, float* __restrict__ LSE, int H, int seqlen, float scale) {
  extern __shared__ __align__(1024) unsigned char smem[];
  uint64_t* full = (uint64_t*)smem;
  uint64_t* empty = full + NS;
  uint64_t* qbar = empty + NS;
  bf16* Ks = (bf16*)(smem + 1024);
  bf16* Vs = Ks + NS * BN * D;
  bf16* Qs = Vs + NS * BN * D;
  const int tid = threadIdx.x, wg = threadIdx.y, qb = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int nkb = seqlen / BN;
  // PRODUCER_WG: a third warpgroup (threadIdx.y 2) only issues the TMA copies (FA3); else thread 0 of warpgroup 0
  const bool producer = PRODUCER_WG ? (wg == 2 && tid == 0) : (wg == 0 && tid == 0);
  int issued = 0, consumed = 0;
  if (producer) {
    for (int s = 0; s < NS; ++s) { tvmflash_mbarrier_init(full + s, 1); tvmflash_mbarrier_init(empty + s, 256); }
    tvmflash_mbarrier_init(qbar, 1);
    tvmflash_mbarrier_init_fence();
  }
  __syncthreads();
#define ISSUE(t) do { int st_ = issued % NS; \
    if (issued >= NS) tvmflash_mbarrier_wait(empty + st_, ((issued / NS) + 1) & 1); \
    tvmflash_mbarrier_expect_tx(full + st_, TILE_BYTES); \
    tvmflash_tma_load_5d(Ks + st_ * BN * D, (unsigned long long)kmap, full + st_, 0, (t) * BN, 0, h, b); \
    tvmflash_tma_load_5d(Vs + st_ * BN * D, (unsigned long long)vmap, full + st_, 0, (t) * BN, 0, h, b); \
    ++issued; } while (0)
#define WAIT_FULL() do { tvmflash_mbarrier_wait(full + consumed % NS, (consumed / NS) & 1); ++consumed; } while (0)
// the scores of the next tile in flight, in stage st, into S: issued and waited for
#define SCORES(S, st) do { zero32(S); fence32(S); WAIT_FULL(); qk(S, Qs, Ks + (st) * BN * D, wg); \
    tvm_builtin_ptx_wgmma_wait_group_wait_group_sync_aligned_0(); fence32(S); } while (0)
// the softmax of S, then P V of stage st (waited for, the stage released)
#define SOFTMAX_PV(st) do { softmax(S, P, m, l, alpha, scale2); cast(P, Pc); rescale(acc, alpha); \
    fence64(acc); fence16u(Pc); pv(acc, Pc, Vs + (st) * BN * D); tvmflash_release_after_wgmma(empty + (st)); \
    fence64(acc); } while (0)
#if PRODUCER_WG
  if (wg == 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (producer) {
      tvmflash_mbarrier_expect_tx(qbar, BM * D * 2);
      tvmflash_tma_load_5d(Qs, (unsigned long long)qmap, qbar, 0, qb * BM, 0, h, b);
      for (int t = 0; t < nkb; ++t) ISSUE(t);
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
#else
  if (producer) {
    tvmflash_mbarrier_expect_tx(qbar, BM * D * 2);
    tvmflash_tma_load_5d(Qs, (unsigned long long)qmap, qbar, 0, qb * BM, 0, h, b);
    for (int t = 0; t < LOOKAHEAD && t < nkb; ++t) ISSUE(t);
  }
#endif
  tvmflash_mbarrier_wait(qbar, 0);
  const float scale2 = scale * 1.4426950408889634f;
  float m[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f}, alpha[2];
  float acc[64], S[BN / 2], P[BN / 2];
  unsigned Pc[BN / 4];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
#if VARIANT == 0
  for (int kb = 0; kb < nkb; ++kb) {
    if (!PRODUCER_WG && producer && kb + LOOKAHEAD < nkb) ISSUE(kb + LOOKAHEAD);
    const int st = kb % NS;
    SCORES(S, st);
    SOFTMAX_PV(st);
  }
#elif VARIANT == 1
  float Sn[BN / 2];
  SCORES(S, 0);
  for (int kb = 0; kb < nkb; ++kb) {
    if (!PRODUCER_WG && producer && kb + LOOKAHEAD < nkb) ISSUE(kb + LOOKAHEAD);
    const int st = kb % NS;
    const bool next = kb + 1 < nkb;
    if (next) {
      zero32(Sn); fence32(Sn);
      WAIT_FULL();
      qk(Sn, Qs, Ks + ((kb + 1) % NS) * BN * D, wg);
    }
    SOFTMAX_PV(st);
    fence32(Sn);
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) S[i] = Sn[i];
  }
#elif VARIANT == 2 || VARIANT == 3  // 3: with ping-pong turns around each warpgroup's GEMM issue
#define PP (VARIANT == 3)
  SCORES(S, 0);
  softmax(S, P, m, l, alpha, scale2);
  cast(P, Pc);
  if (PP && wg == 1) pp_arrive(0);
  for (int kb = 1; kb < nkb; ++kb) {
    if (!PRODUCER_WG && producer && kb + LOOKAHEAD - 1 < nkb) ISSUE(kb + LOOKAHEAD - 1);
    const int st = kb % NS, prev = (kb - 1) % NS;
    zero32(S); fence32(S);
    WAIT_FULL();
    if (PP) pp_sync(wg);
    qk(S, Qs, Ks + st * BN * D, wg);
    fence64(acc); fence16u(Pc);
    pv(acc, Pc, Vs + prev * BN * D);
    if (PP) pp_arrive(1 - wg);
    wait1();
    fence32(S);
    softmax(S, P, m, l, alpha, scale2);
    // the softmax's results pass through volatile asm before the wait: otherwise the compiler is free
    // to compute them after it (nothing but the cast reads them); ptxas hoists the wait anyway
    fence32(P); tvmflash_wgmma_reg_fence(alpha[0]); tvmflash_wgmma_reg_fence(alpha[1]);
    tvmflash_release_after_wgmma(empty + prev);
    fence64(acc); fence16u(Pc);
    rescale(acc, alpha);
    cast(P, Pc);
  }
  fence64(acc); fence16u(Pc);
  if (PP) pp_sync(wg);
  pv(acc, Pc, Vs + ((nkb - 1) % NS) * BN * D);
  if (PP && wg == 0) pp_arrive(1);  // the last turn: warpgroup 1 hands none back
  tvmflash_release_after_wgmma(empty + (nkb - 1) % NS);
  fence64(acc);
#endif
  // epilogue: O = acc / l, LSE = m + log l (log2 domain -> natural)
  const int lane = tid & 31, warp = tid >> 5;
  const int row0 = qb * BM + wg * 64 + warp * 16 + (lane >> 2);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    bf16* o = O + (((size_t)b * seqlen + row) * H + h) * D;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * i + 2 * r] * inv, acc[4 * i + 2 * r + 1] * inv);
      *(__nv_bfloat162*)(o + 8 * i + 2 * (lane & 3)) = v;
    }
    if ((lane & 3) == 0) LSE[((size_t)b * H + h) * seqlen + row] = m[r] * scale + logf(l[r]);
  }
}
'''

VARIANTS = {  # name: (VARIANT, BN, NS, MINB, LOOKAHEAD)
    "base_bn64_ns2_mb2": (0, 64, 2, 2, 1),
    "pvlag_bn64_ns3_mb1": (2, 64, 3, 1, 2),
    "base_bn128_ns2_mb1": (0, 128, 2, 1, 1),
    "base_bn128_ns3_mb1": (0, 128, 3, 1, 2),
    "qkahead_bn128_ns3_mb1": (1, 128, 3, 1, 2),
    "pvlag_bn128_ns3_mb1": (2, 128, 3, 1, 2),
    "pvlag_bn128_ns2_mb1": (2, 128, 2, 1, 1),
    "pp_bn128_ns2_mb1": (3, 128, 2, 1, 1),
    "pp_bn128_ns3_mb1": (3, 128, 3, 1, 2),
    "pp_bn64_ns3_mb1": (3, 64, 3, 1, 2),
    "prod_base_bn128_ns2": (0, 128, 2, 1, 1, 1),
    "prod_base_bn128_ns3": (0, 128, 3, 1, 2, 1),
    "prod_pvlag_bn128_ns2": (2, 128, 2, 1, 1, 1),
    "prod_pvlag_bn128_ns3": (2, 128, 3, 1, 2, 1),
    "prod_pp_bn128_ns3": (3, 128, 3, 1, 2, 1),
    "prod_qkahead_bn128_ns3": (1, 128, 3, 1, 2, 1),
    "prod_base_bn64_ns3": (0, 64, 3, 1, 2, 1),
}


def main(only=None):
    os.makedirs(OUT, exist_ok=True)
    helpers = open(os.path.join(HERE, "helpers.cuh")).read()
    meta = {}
    for name, (variant, bn, ns, minb, look, *prod) in VARIANTS.items():
        prod = prod[0] if prod else 0
        src = helpers + wgmma_helpers(bn) + KERNEL
        if only and name not in only:
            continue
        path = os.path.join(OUT, f"fa_{name}.cu")
        open(path, "w").write(f"#define VARIANT {variant}\n#define BN {bn}\n#define NS {ns}\n#define MINB {minb}\n#define LOOKAHEAD {look}\n#define PRODUCER_WG {prod}\n" + src)
        r = subprocess.run(["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-Xptxas", "-v", "-o",
                            os.path.join(OUT, f"fa_{name}.cubin"), path], capture_output=True, text=True)
        lines = [l.strip() for l in r.stderr.splitlines() if "registers" in l or "spill" in l or "C75" in l or "error" in l]
        print(name, "rc", r.returncode, *lines[:6], sep="\n  ")
        meta[name] = {"smem": 1024 + 2 * ns * bn * 128 * 2 + 128 * 128 * 2, "bn": bn, "wgs": 3 if prod else 2}
    json.dump(meta, open(os.path.join(OUT, "lab.json"), "w"))


BN_D_BYTES = 64 * 128 * 2
if __name__ == "__main__":
    main(sys.argv[2:])
