"""The CUDA device functions that the TMA lowering calls (mbarriers, TMA copies, named barriers,
setmaxnreg, the async-proxy fence), each an inline-asm helper that TVM emits once per kernel, and how
a pass calls them.

The barriers and TMA's shared-memory pointers are ``tvm_access_ptr`` with an empty access mask
(``untracked_pointer``): ThreadSync then plans no barrier for them (the mbarriers order them), while
shared-memory merging still sees them live (after the last wait it may reuse their bytes, for the LSE
staging).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

# producer="warpgroup" (FA3): a warpgroup of its own issues the copies; setmaxnreg moves registers from it
# to the two consumer warpgroups (128 * 24 + 256 * 240 <= 65536).
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 24, 240

_SMEM = "(unsigned)__cvta_generic_to_shared"
# One CUDA helper per function (TVM emits a helper's source once per function name).
_HELPERS = {
    "tvmflash_mbarrier_init": (
        "__device__ __forceinline__ void tvmflash_mbarrier_init(void* bar, int count) {\n"
        f'  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"({_SMEM}(bar)), "r"(count) : "memory");\n}}'),
    "tvmflash_mbarrier_init_fence": (
        "__device__ __forceinline__ void tvmflash_mbarrier_init_fence() {\n"
        '  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");\n}'),
    "tvmflash_mbarrier_expect_tx": (
        "__device__ __forceinline__ void tvmflash_mbarrier_expect_tx(void* bar, int bytes) {\n"
        '  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"'
        f' :: "r"({_SMEM}(bar)), "r"(bytes) : "memory");\n}}'),
    # A tile is released once this warpgroup's wgmma have read it. The wait sits in the same asm:
    # after a separate wgmma.wait_group, ptxas hoisted the SYNCS.ARRIVE above the WARPGROUP.DEPBAR
    # (the wgmma's shared-memory reads are no register dependency), so the producer could refill a
    # stage that the last PV wgmma was still reading (seen in the SASS of the d128 build).
    "tvmflash_release_after_wgmma": (
        "__device__ __forceinline__ void tvmflash_release_after_wgmma(void* bar) {\n"
        '  asm volatile("wgmma.wait_group.sync.aligned 0;\\n\\tmbarrier.arrive.shared::cta.b64 _, [%0];"'
        f' :: "r"({_SMEM}(bar)) : "memory");\n}}'),
    "tvmflash_mbarrier_wait": (
        "__device__ __forceinline__ void tvmflash_mbarrier_wait(void* bar, int parity) {\n"
        '  asm volatile("{\\n .reg .pred done;\\n WAIT:\\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\\n"\n'
        f'               " @!done bra WAIT;\\n}}" :: "r"({_SMEM}(bar)), "r"(parity) : "memory");\n}}'),
    "tvmflash_tma_load_5d": (
        "__device__ __forceinline__ void tvmflash_tma_load_5d(void* dst, unsigned long long map, void* bar,\n"
        "                                                     int c0, int c1, int c2, int c3, int c4) {\n"
        '  asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"\n'
        '               " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"\n'
        f'               :: "r"({_SMEM}(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"({_SMEM}(bar))\n'
        '               : "memory");\n}'),
    "tvmflash_tma_load_3d": (
        "__device__ __forceinline__ void tvmflash_tma_load_3d(void* dst, unsigned long long map, void* bar,\n"
        "                                                     int c0, int c1, int c2) {\n"
        '  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"\n'
        '               " [%0], [%1, {%2, %3, %4}], [%5];"\n'
        f'               :: "r"({_SMEM}(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"({_SMEM}(bar))\n'
        '               : "memory");\n}'),
    # a tile of float32 in shared memory (in the tensor map's swizzle) added into global memory by TMA;
    # completes in this thread's bulk group (``tvmflash_bulk_commit``, ``tvmflash_bulk_wait_read``)
    "tvmflash_tma_reduce_add_5d": (
        "__device__ __forceinline__ void tvmflash_tma_reduce_add_5d(void* src, unsigned long long map,\n"
        "                                                           int c0, int c1, int c2, int c3, int c4) {\n"
        '  asm volatile("cp.reduce.async.bulk.tensor.5d.global.shared::cta.add.tile.bulk_group"\n'
        '               " [%0, {%1, %2, %3, %4, %5}], [%6];"\n'
        f'               :: "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"({_SMEM}(src)) : "memory");\n}}'),
    "tvmflash_named_barrier": (
        "__device__ __forceinline__ void tvmflash_named_barrier(int id, int threads) {\n"
        '  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");\n}'),
    "tvmflash_setmaxnreg_dec": (
        "__device__ __forceinline__ void tvmflash_setmaxnreg_dec() {\n"
        f'  asm volatile("setmaxnreg.dec.sync.aligned.u32 {PRODUCER_REGISTERS};");\n}}'),
    "tvmflash_setmaxnreg_inc": (
        "__device__ __forceinline__ void tvmflash_setmaxnreg_inc() {\n"
        f'  asm volatile("setmaxnreg.inc.sync.aligned.u32 {CONSUMER_REGISTERS};");\n}}'),
    # a row of float32 added into global memory by the bulk copy engine (sm_90), read from shared memory
    "tvmflash_bulk_reduce_add_f32": (
        "__device__ __forceinline__ void tvmflash_bulk_reduce_add_f32(void* dst, void* src, int bytes) {\n"
        '  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"'
        f' :: "l"(dst), "r"({_SMEM}(src)), "r"(bytes) : "memory");\n}}'),
    # two adjacent float32 into shared memory (8-byte aligned), by a pointer that ThreadSync does not count
    "tvmflash_store_shared_v2": (
        "__device__ __forceinline__ void tvmflash_store_shared_v2(void* dst, float a, float b) {\n"
        f'  asm volatile("st.shared.v2.f32 [%0], {{%1, %2}};" :: "r"({_SMEM}(dst)), "f"(a), "f"(b) : "memory");\n}}'),
    # four adjacent float32 read from shared memory (16-byte aligned) and added into global memory (sm_90)
    "tvmflash_red_add_v4_shared": (
        "__device__ __forceinline__ void tvmflash_red_add_v4_shared(void* dst, void* src) {\n"
        "  float4 v = *(const float4*)src;\n"
        '  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};"'
        ' :: "l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");\n}'),
    "tvmflash_bulk_commit": (
        "__device__ __forceinline__ void tvmflash_bulk_commit() {\n"
        '  asm volatile("cp.async.bulk.commit_group;" ::: "memory");\n}'),
    # this thread's bulk operations have read their shared memory (may be overwritten)
    "tvmflash_bulk_wait_read": (
        "__device__ __forceinline__ void tvmflash_bulk_wait_read() {\n"
        '  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");\n}'),
    # this thread's bulk operations are complete
    "tvmflash_bulk_wait": (
        "__device__ __forceinline__ void tvmflash_bulk_wait() {\n"
        '  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");\n}'),
    "tvmflash_fence_proxy_async": (
        "__device__ __forceinline__ void tvmflash_fence_proxy_async() {\n"
        '  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");\n}'),
}


def device_call(name, *args):
    """A call of the device function ``name``, its source carried with the call."""
    return T.cuda.func_call(name, *args, source_code=_HELPERS[name])


def device_statement(name, *args):
    """``device_call`` as a statement."""
    return tirx.Evaluate(device_call(name, *args))


def untracked_pointer(buffer, offset):
    """A pointer into ``buffer`` that ThreadSync does not count as an access (mask 0)."""
    return T.tvm_access_ptr(T.type_annotation(buffer.dtype), buffer.data, offset, 1, 0)


TMA_LOADS = {"tvmflash_tma_load_5d": 1024, "tvmflash_tma_load_3d": 128}  # each copy's shared-memory alignment
TMA_REDUCTIONS = {"tvmflash_tma_reduce_add_5d": 1024}  # the same, for the reductions from shared memory
