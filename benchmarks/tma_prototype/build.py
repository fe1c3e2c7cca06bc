"""TMA prototype, part 1 (no GPU needed): what the sm90 kernel gains from loading its K/V tiles
with TMA. Not a tvmflash kernel: the sm90 schedule's generated CUDA (d128 bf16, 128-row blocks,
64-key tiles) is edited as text, then compiled with nvcc. It starts from the K/V tiles in padded
core matrices and one stage (``BASE_KNOBS``, the defaults before commit 08ca9d9, whose swizzled
two-stage cp.async pipeline now gets most of this gain in TVM).
The edits, each K/V step:
  * one thread issues two ``cp.async.bulk.tensor`` (TMA) copies, of K and of V, for the *next*
    tile into the other of two stages, completing on that stage's mbarrier (expect_tx 32 KiB);
  * every thread waits on the mbarrier of this tile's stage (parity: the stage's use count), in
    place of the loads through registers, the proxy fence and the second barrier;
  * K/V stages use the 128-byte swizzled layout (TMA box (64 elements, 64 rows, head_dim/64) over
    the (element, row, 64-column half, head, batch) view of K or V; 1024-byte aligned stages), and
    the QK^T / PV descriptors take swizzle mode 1: K K-major (LBO unused, SBO 1024 bytes, a k16
    slice 32 bytes further within a 128-byte row), V MN-major (LBO 8192 bytes from one 64-column
    half to the next, SBO 1024 bytes, a k16 slice 16 rows further).
Stage 0 reuses the K/V tiles' old shared memory, stage 1 lies after the Q tile, the mbarriers
after that: 107,536 bytes a block, two blocks an SM. The tensor maps are passed by address
(``run.py`` makes them with cuTensorMapEncodeTiled). Heads: K/V head = Q head (no GQA).

    python benchmarks/tma_prototype/build.py OUT_DIR     # then, on an H200: run.py OUT_DIR
"""
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ["TVMFLASH_SM90"] = "1"
os.environ.setdefault("TVMFLASH_CACHE_DIR", tempfile.mkdtemp())
import tvmflash  # noqa: E402
from tvmflash.schedules import sm90  # noqa: E402

HEAD_DIM, HEADS = 128, 16
BASE_KNOBS = {"kv_layout": "core_matrices", "num_stages": 1, "kv_copy": "cp.async"}  # the shared-memory offsets below are this build's
HELPERS = r'''
__device__ __forceinline__ unsigned tma_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void tma_mbar_init(void* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(tma_smem(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void tma_expect(void* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(tma_smem(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tma_load(void* dst, const void* map, void* bar, int c0, int c1, int c2, int c3, int c4) {
  asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
               :: "r"(tma_smem(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(tma_smem(bar)) : "memory");
}
__device__ __forceinline__ void tma_wait(void* bar, unsigned parity) {
  asm volatile("{\n .reg .pred P1;\n LAB_WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n @P1 bra DONE;\n bra LAB_WAIT;\n DONE:\n }"
               :: "r"(tma_smem(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ unsigned long long tma_desc_sw128(const void* smem, int lbo, int sbo) {
  unsigned long long address = __cvta_generic_to_shared(smem);
  return ((address & 0x3FFFF) >> 4) | ((unsigned long long)(lbo & 0x3FFF) << 16) | ((unsigned long long)(sbo & 0x3FFF) << 32) | (1ull << 62);
}
'''
# bf16 element offsets in dynamic shared memory of the base kernel's K and V tiles, and of the
# prototype's stages; the mbarriers' byte offset
OLD_K, OLD_V, CORE_ROW = 512, 9728, 144  # padded core matrices: a k16 slice of K is 144 elements on
OLD_V_SLICE = 2304
K0, V0, K1, V1, BARRIERS = 512, 8704, 37376, 45568, 107520
SHARED_BYTES = BARRIERS + 16
FENCE_SYNC = "    tvm_builtin_ptx_fence_proxy_proxy_async_shared__cta();\n    __syncthreads();\n"


def with_tma(src: str, causal: bool) -> str:
    head = "(int)blockIdx.x" if causal else "(int)blockIdx.y"  # causal grids: heads along x
    signature = "float softmax_scale)"
    assert src.count(signature) == 2
    src = src.replace(signature, "float softmax_scale, const void* __restrict__ tmK, const void* __restrict__ tmV)")
    src = src.replace('extern "C" __global__', HELPERS + 'extern "C" __global__', 1)
    src = src.replace("extern __shared__ __align__(64)", "extern __shared__ __align__(1024)")
    loop = re.search(r"  for \(int kb = 0; kb < (.*?); \+\+kb\) \{\n", src)
    header, tiles = loop.group(0), loop.group(1)

    def issue(stage, tile, k, v):
        return ("if (threadIdx.x == 0 && threadIdx.y == 0) { "
                f"unsigned long long* bars = (unsigned long long*)(buf_dyn_shmem_ptr + {BARRIERS}); "
                f"tma_expect(&bars[{stage}], 32768); "
                f"tma_load(((nv_bfloat16*)buf_dyn_shmem_ptr) + ({k}), tmK, &bars[{stage}], 0, ({tile}) * 64, 0, {head}, (int)blockIdx.z); "
                f"tma_load(((nv_bfloat16*)buf_dyn_shmem_ptr) + ({v}), tmV, &bars[{stage}], 0, ({tile}) * 64, 0, {head}, (int)blockIdx.z); }}")

    before = (f"  int tma_tiles = {tiles};\n"
              "  if (threadIdx.x == 0 && threadIdx.y == 0) { "
              f"unsigned long long* bars = (unsigned long long*)(buf_dyn_shmem_ptr + {BARRIERS}); "
              "tma_mbar_init(&bars[0], 1); tma_mbar_init(&bars[1], 1); "
              'asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }\n'
              "  tvm_builtin_ptx_fence_proxy_proxy_async_shared__cta();\n  __syncthreads();\n"  # Q's stores
              "  " + issue(0, 0, K0, V0) + "\n")
    src = src.replace(header, before + header)
    body = src.index(header) + len(header)
    first = src.index("    __syncthreads();\n", body)
    fence = src.index(FENCE_SYNC, first)
    loads = src[first:fence]
    assert "K_ptr" in loads and "V_ptr" in loads
    zero_s = "".join(line + "\n" for line in loads.splitlines() if line.strip().startswith("S_local_ptr["))
    step = ("    __syncthreads();\n"  # every warpgroup is done with the other stage (tile kb - 1)
            "    if (kb + 1 < tma_tiles) { int s1 = (kb + 1) & 1; "
            + issue("s1", "kb + 1", f"s1 ? {K1} : {K0}", f"s1 ? {V1} : {V0}") + " }\n"
            + zero_s + f"    tma_wait(buf_dyn_shmem_ptr + {BARRIERS} + 8 * (kb & 1), (kb >> 1) & 1);\n")
    src = src[:first] + step + src[fence + len(FENCE_SYNC):]

    def k_descriptor(m):
        ks = (int(m.group(1)) - OLD_K) // CORE_ROW
        return (f"tma_desc_sw128((&(((nv_bfloat16*)buf_dyn_shmem_ptr)[((kb & 1) ? {K1} : {K0}) + "
                f"{(ks // 4) * 4096 + (ks % 4) * 16}])), 1, 64)")

    def v_descriptor(m):
        ks = (int(m.group(1)) - OLD_V) // OLD_V_SLICE
        return f"tma_desc_sw128((&(((nv_bfloat16*)buf_dyn_shmem_ptr)[((kb & 1) ? {V1} : {V0}) + {ks * 1024}])), 512, 64)"

    pattern = r"tvmflash_wgmma_descriptor\(\(&\(\(\(nv_bfloat16\*\)buf_dyn_shmem_ptr\)\[(\d+)\]\)\), {}, 0\)"
    src, nk = re.subn(pattern.format("9, 144"), k_descriptor, src)
    src, nv = re.subn(pattern.format("144, 9"), v_descriptor, src)
    assert (nk, nv) == (HEAD_DIM // 16, 64 // 16), (nk, nv)
    return src


def nvcc(src: str, cubin: str) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".cu") as f:
        f.write(src)
        f.flush()
        r = subprocess.run(["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "--use_fast_math",
                            "-Xptxas", "-v", "-o", cubin, f.name], capture_output=True, text=True, check=True)
    return "; ".join(line.split(":", 1)[-1].strip() for line in r.stderr.splitlines() if "registers" in line or "spill" in line)


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    configs = {}
    for causal in (False, True):
        kernel = tvmflash.compile(head_dim=HEAD_DIM, dtype="bfloat16", causal=causal, target="sm90", knobs=BASE_KNOBS)
        src = kernel.source(HEADS, HEADS)
        for name, text, shared in ((f"base_c{int(causal)}", src, sm90.shared_memory_bytes(HEAD_DIM, "bfloat16", kernel.knobs)),
                                   (f"tma_c{int(causal)}", with_tma(src, causal), SHARED_BYTES)):
            print(name, nvcc(text, os.path.join(out, name + ".cubin")), flush=True)
            configs[name] = {"causal": causal, "shared_bytes": shared, "tma": name.startswith("tma")}
    json.dump({"head_dim": HEAD_DIM, "heads": HEADS, "kernels": configs}, open(os.path.join(out, "kernels.json"), "w"), indent=1)
