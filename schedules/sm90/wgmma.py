"""The wgmma tensor intrinsics of the sm90 schedule (``wgmma.mma_async``, m64nNk16) and their matrix
descriptors: the "ss" form reads both operands from shared memory, the "rs" form takes A from the
accumulator registers (``layouts.acc_layout``); B is K-major or N-major, in core matrices or swizzled."""

from __future__ import annotations

from tvm.s_tir import TensorIntrin

from tvmflash import tvmscript
from tvmflash.lowering.annotations import REG_FENCE, REG_FENCE_U32, SWIZZLE_COLUMNS, WGMMA_SWIZZLE_LAYOUTS

from .layouts import WARPGROUP, acc_layout, bind_acc_threads, split_warpgroups, swizzled_map

_PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}
# A wgmma matrix descriptor, as a value (PTX ISA "Matrix Descriptor Format"): start address, leading
# and stride byte offsets, each in 16-byte units, and the layout type in bits 62-63 (``NO_SWIZZLE``
# or a swizzle's, ``WGMMA_SWIZZLE_LAYOUTS``). TVM's encoder writes through a pointer into a local buffer, and
# InjectSoftwarePipeline (static shapes) splits such a buffer's allocation from its uses ("Buffer
# access occurs outside a statement scope"). The start comes as the buffer's own start (the same for
# every wgmma of a loop) plus the operand's offset in 16-byte units, which TIR folds to a constant and
# the stage's term: one uniform add a wgmma in the SASS. (A whole address shifted by 4 cost four:
# add, mask, shift, or, and a large share of the K/V loop's instructions went to the uniform pipe.)
# Shared-window addresses are below 2^18, so the 14-bit start field needs no mask, and adding the
# fields is or-ing.
_DESCRIPTOR = (
    "__device__ __forceinline__ unsigned long long tvmflash_wgmma_descriptor(const void* buffer, int offset, int lbo,"
    " int sbo, int layout) {\n"
    "  unsigned start = ((unsigned)__cvta_generic_to_shared(buffer) >> 4) + (unsigned)offset;\n"
    "  return (unsigned long long)(start + ((unsigned)lbo << 16))"
    " | ((unsigned long long)((unsigned)sbo + ((unsigned)layout << 30)) << 32);\n"
    "}"
)
NO_SWIZZLE = 0  # the layout type of padded core matrices; the swizzles' are WGMMA_SWIZZLE_LAYOUTS


def wgmma_intrin_name(n: int, k: int, dtype: str, b_major: str, a_regs: bool = False,
                      fence_operands: bool = True, b_swizzled: bool = False, a_swizzled: bool = False,
                      wait: bool = True, a_major: str = "k", swizzle: int = SWIZZLE_COLUMNS) -> str:
    """Register (once) and name the intrinsic for a 64 x n x k GEMM on wgmma.

    A (64 x k) is a K-major shared-memory tile in ``layouts.core_matrix_map`` layout, or with
    ``a_regs`` per-thread registers in the accumulator layout (``layouts.acc_index_map`` with N = k:
    the "rs" form of wgmma, whose A fragment for each k16 slice is the 64 x 16 accumulator layout,
    CUTLASS's SM90 ALayout_64x16). B is a shared-memory tile, K-major (an n x k tile,
    ``b_major="k"``: S = Q K^T) or N-major (a k x n tile, ``b_major="mn"``: O += P V). C is the
    float32 accumulator, per thread (``layouts.acc_index_map``). b_swizzled, a_swizzled: the
    shared-memory tile is in the swizzled layout (``layouts.swizzled_map``; rows of ``swizzle``
    columns, 64: 128-byte, 32: 64-byte) instead of core matrices. a_major "mn": A is a k x 64
    shared-memory tile in core matrices, read transposed (``imm-trans-a``; the backward's dsᵀ as the
    A of ds k).

    wait: end with ``wgmma.wait_group 0`` (the result is ready when the intrinsic ends), or only
    commit the group (overlap: a later wait, of the next GEMM or before the result is read, ends it).

    fence_operands ("ss" form only): begin with ``fence.proxy.async`` and a barrier, so that the
    threads' shared-memory writes are visible to wgmma. Off where the caller's code already does
    both before it (the cp.async pipeline's wait, ``lowering.tvm_fixes.ConstantAsyncWaitCounts``,
    at the top of the K/V step: ``lowering.cp_async_barriers.OneBarrierPerPipelinedStep``).
    """
    name = f"tvmflash_wgmma_m64n{n}k{k}_{_PTX_TYPE[dtype]}_{'r' if a_regs else 's'}_b{b_major}"
    if b_swizzled:
        name += f"_sw{2 * swizzle}"
    if a_swizzled:
        name += f"_asw{2 * swizzle}"
    if a_major == "mn":
        name += "_amn"
    if not wait:
        name += "_nowait"
    if not a_regs and not fence_operands:
        name += "_unfenced"
    try:
        TensorIntrin.get(name)
    except Exception:  # noqa: BLE001 - not registered yet
        TensorIntrin.register(name, *_wgmma_desc_impl(n, k, dtype, b_major, a_regs, fence_operands, b_swizzled,
                                                        a_swizzled, wait, a_major, swizzle))
    return name


def _wgmma_macros(fence_operands: bool, nr: int, wait: bool):
    """The macros around an intrinsic's wgmma (``nr`` accumulator registers a thread): its shared operands
    made visible to the async proxy (``fence_operands``), the registers fenced before, and the commit
    after (``wait``: waited for at once, the registers fenced again)."""
    from tvm.script import tirx as T

    if fence_operands:
        @T.macro
        def shared_operands_visible():
            # Shared memory written by threads (generic proxy) -> read by wgmma (async proxy). Only
            # the "ss" form (S = Q K^T) does this: the "rs" form's B tile (V) is written with K's,
            # before it.
            T.ptx.fence.proxy.async_.shared__cta()
            T.tvm_storage_sync("shared")
    else:
        @T.macro
        def shared_operands_visible():
            T.evaluate(0)

    @T.macro
    def wgmma_begin(C):
        for r in T.unroll(nr):
            T.cuda.func_call("tvmflash_wgmma_reg_fence", C[r], source_code=REG_FENCE)

    if wait:
        @T.macro
        def wgmma_end(C):  # one commit group, waited for at once
            T.ptx.wgmma.commit_group.sync.aligned()
            T.ptx.wgmma.wait_group.sync.aligned(0)
            for r in T.unroll(nr):
                T.cuda.func_call("tvmflash_wgmma_reg_fence", C[r], source_code=REG_FENCE)
    else:
        @T.macro
        def wgmma_end(C):  # C is still being written: no fence on it until a wait
            T.ptx.wgmma.commit_group.sync.aligned()
    return shared_operands_visible, wgmma_begin, wgmma_end


def _wgmma_desc_impl(n, k, dtype, b_major, a_regs, fence_operands=True, b_swizzled=False, a_swizzled=False,
                     wait=True, a_major="k", swizzle=SWIZZLE_COLUMNS):
    from tvm.script import tirx as T

    if n % 8 or not 8 <= n <= 256 or k % 16:
        raise ValueError(f"wgmma: n must be a multiple of 8 in [8, 256] and k of 16, got n={n}, k={k}")
    nr = n // 2  # accumulator registers per thread
    w, chunks, layout = swizzle, swizzle // 8, WGMMA_SWIZZLE_LAYOUTS[swizzle]
    a_shape = (k // 2,) if a_regs else (k // w, 64, chunks, 8) if a_swizzled else (8, k // 8, 8, 8)
    if a_major == "mn":  # a k x 64 tile, core matrices (core_matrix_map)
        assert not (a_regs or a_swizzled), "an M-major A is a shared-memory tile in core matrices"
        a_shape = (k // 8, 8, 8, 8)
    a_scope = "local" if a_regs else "shared.dyn"
    a_whole = tuple(slice(0, e) for e in a_shape)
    b_shape = (n // 8, k // 8, 8, 8) if b_major == "k" else (k // 8, n // 8, 8, 8)
    if b_swizzled:  # swizzled_map's (column group, row, chunk, element) of the k x n (K) or n x k (V) tile
        b_shape = (k // w, n, chunks, 8) if b_major == "k" else (n // w, k, chunks, 8)
    trans_a, trans_b = (0 if major == "k" else 1 for major in (a_major, b_major))
    ptx = _PTX_TYPE[dtype]
    shape = f"m64n{n}k16"
    mma = getattr(getattr(T.ptx.wgmma.mma_async.sync.aligned, shape).f32, ptx)
    mma = getattr(mma, ptx)

    def a_at(A, vi, vk):
        if a_regs:
            return A[acc_layout(vi, vk)[1]]
        if a_swizzled:  # K-major, as K in b_at
            return A[swizzled_map(vi, vk, w)]
        if a_major == "mn":
            return A[vk // 8, vi // 8, vk % 8, vi % 8]
        return A[vi // 8, vk // 8, vi % 8, vk % 8]

    def b_at(B, vj, vk):
        if b_swizzled:
            return B[swizzled_map(vj, vk, w)] if b_major == "k" else B[swizzled_map(vk, vj, w)]
        if b_major == "k":
            return B[vj // 8, vk // 8, vj % 8, vk % 8]
        return B[vk // 8, vj // 8, vk % 8, vj % 8]

    def acc_reg(vi, vj):
        return acc_layout(vi, vj)[1]

    @tvmscript.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle):
        A = T.match_buffer(a, a_shape, dtype, offset_factor=1, scope=a_scope)
        B = T.match_buffer(b, b_shape, dtype, offset_factor=1, scope="shared.dyn")
        C = T.match_buffer(c, (nr,), "float32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:nr], A[a_whole], B[0 : b_shape[0], 0 : b_shape[1], 0 : b_shape[2], 0:8])
            T.writes(C[0:nr])
            for i, j, kk in T.grid(64, n, k):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                    C[acc_reg(vi, vj)] = C[acc_reg(vi, vj)] + T.cast(a_at(A, vi, vk), "float32") * T.cast(
                        b_at(B, vj, vk), "float32")

    def _descriptor(X, offset, lbo, sbo, layout=NO_SWIZZLE):
        # X's start and the operand's offset in 16-byte units (8 two-byte elements; always whole)
        start = X.access_ptr("r", offset=-X.elem_offset)
        return T.cuda.func_call("tvmflash_wgmma_descriptor", start, T.floordiv(X.elem_offset + offset, 8), lbo, sbo,
                                layout, source_code=_DESCRIPTOR, return_type="uint64")

    def k_major_swizzled(X, s0, s1, ks):
        # s0: a column group's stride, s1: a row's (w elements, 2 w bytes); a k16 slice starts 32
        # bytes into the rows of its group; LBO unused; SBO: 8 rows, 16 w bytes (8 s1 * 2 / 16 = s1 units)
        return _descriptor(X, (ks * 16) // w * s0 + ks * 16 % w, 1, s1, layout)

    def a_descriptor(A, sa0, sa1, ks):
        if a_swizzled:
            return k_major_swizzled(A, sa0, sa1, ks)
        if a_major == "mn":  # as an N-major B: LBO = K-direction (r//8) stride, SBO = M-direction
            return _descriptor(A, ks * 2 * sa0, sa0 // 8, sa1 // 8)
        # K-major: LBO = K-direction core-matrix stride, SBO = M-direction.
        return _descriptor(A, ks * 2 * sa1, sa1 // 8, sa0 // 8)

    def b_descriptor(B, sb0, sb1, ks):
        # Descriptor fields are in 16-byte units; 2-byte elements.
        if b_swizzled:  # sb0: a column group's stride, sb1: a row's (w elements)
            if b_major == "k":
                return k_major_swizzled(B, sb0, sb1, ks)
            # N-major: a k16 slice is 16 rows; LBO: from one column group to the next
            return _descriptor(B, ks * 16 * sb1, sb0 // 8, sb1, layout)
        if b_major == "k":  # K-major: LBO = K-direction core-matrix stride, SBO = N-direction
            return _descriptor(B, ks * 2 * sb1, sb1 // 8, sb0 // 8)
        # N-major: LBO = K-direction (r//8) stride, SBO = N-direction (c//8).
        return _descriptor(B, ks * 2 * sb0, sb0 // 8, sb1 // 8)

    shared_operands_visible, wgmma_begin, wgmma_end = _wgmma_macros(fence_operands, nr, wait)

    @tvmscript.prim_func(s_tir=True)
    def impl_ss(a: T.handle, b: T.handle, c: T.handle):
        sa0 = T.int32()
        sa1 = T.int32()
        sb0 = T.int32()
        sb1 = T.int32()
        A = T.match_buffer(a, a_shape, dtype, offset_factor=1, scope="shared.dyn", strides=[sa0, sa1, 8, 1])
        B = T.match_buffer(b, b_shape, dtype, offset_factor=1, scope="shared.dyn", strides=[sb0, sb1, 8, 1])
        C = T.match_buffer(c, (nr,), "float32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:nr], A[a_whole], B[0 : b_shape[0], 0 : b_shape[1], 0 : b_shape[2], 0:8])
            T.writes(C[0:nr])
            for tx in T.thread_binding(WARPGROUP, thread="threadIdx.x"):
                shared_operands_visible()
                wgmma_begin(C)
                T.ptx.wgmma.fence.sync.aligned()
                for ks in T.unroll(k // 16):
                    mma(*[C[r] for r in range(nr)], a_descriptor(A, sa0, sa1, ks), b_descriptor(B, sb0, sb1, ks),
                        T.bool(True), 1, 1, trans_a, trans_b)
                wgmma_end(C)

    @tvmscript.prim_func(s_tir=True)
    def impl_rs(a: T.handle, b: T.handle, c: T.handle):
        sb0 = T.int32()
        sb1 = T.int32()
        A = T.match_buffer(a, a_shape, dtype, offset_factor=2, scope="local")
        B = T.match_buffer(b, b_shape, dtype, offset_factor=1, scope="shared.dyn", strides=[sb0, sb1, 8, 1])
        C = T.match_buffer(c, (nr,), "float32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:nr], A[a_whole], B[0 : b_shape[0], 0 : b_shape[1], 0 : b_shape[2], 0:8])
            T.writes(C[0:nr])
            for tx in T.thread_binding(WARPGROUP, thread="threadIdx.x"):
                # A's registers as 32-bit pairs: register 4 ks + r of the k16 slice ks is the pair
                # (8 ks + 2 r, 8 ks + 2 r + 1) of the accumulator layout, low half first. (A's
                # offset in its buffer is even: offset_factor=2.)
                A32 = T.decl_buffer((k // 4,), "uint32", data=A.data, elem_offset=A.elem_offset // 2, scope="local")
                wgmma_begin(C)
                for r in T.unroll(k // 4):
                    T.cuda.func_call("tvmflash_wgmma_reg_fence_u32", A32[r], source_code=REG_FENCE_U32)
                T.ptx.wgmma.fence.sync.aligned()
                for ks in T.unroll(k // 16):
                    mma(*[C[r] for r in range(nr)], A32[4 * ks], A32[4 * ks + 1], A32[4 * ks + 2],
                        A32[4 * ks + 3], b_descriptor(B, sb0, sb1, ks), T.bool(True), 1, 1, trans_b)
                wgmma_end(C)

    return desc, (impl_rs if a_regs else impl_ss)


def warpgroup_gemm(sch, name, num_warpgroups):
    """Prepare a GEMM block (loops: block_m rows, cols, reduction) for one wgmma intrinsic per
    warpgroup: rows split over warpgroups, the init (decompose_reduction) run by the threads that
    hold the accumulator. Returns the loop to tensorize."""
    i = sch.get_loops(name)[-3]
    rows = split_warpgroups(sch, i, num_warpgroups)
    init = sch.decompose_reduction(name, rows)
    bind_acc_threads(sch, init)
    return rows


# ---- FP8 (e4m3) ------------------------------------------------------------------------------------
def fp8_wgmma_intrin_name(n: int, k: int, a_regs: bool, fence_operands: bool = True,
                          b_rows=None) -> str:
    """Register (once) and name the intrinsic for a 64 x n x k GEMM on e4m3 wgmma (m64nNk32, float32
    accumulator). Both shared-memory operands are K-major in 8 x 16-byte core matrices
    (``layouts.fp8_core_matrix_map``; e4m3 wgmma has no transpose). A: the Q tile (the "ss" form,
    its C S's permuted accumulator ``layouts.fp8_acc_index_map``, B the K tile with its rows at
    ``layouts.fp8_key_row``), or with ``a_regs`` P in registers in the A fragment's layout
    (``layouts.fp8_a_index``, "rs" form, C the output's accumulator, B the transposed V tile).
    fence_operands: as ``wgmma_intrin_name``'s."""
    name = f"tvmflash_wgmma_m64n{n}k{k}_e4m3_{'r' if a_regs else 's'}"
    if not a_regs and not fence_operands:
        name += "_unfenced"
    try:
        TensorIntrin.get(name)
    except Exception:  # noqa: BLE001 - not registered yet
        TensorIntrin.register(name, *_fp8_desc_impl(n, k, a_regs, fence_operands))
    return name


def _fp8_desc_impl(n, k, a_regs, fence_operands):
    from tvm.script import tirx as T

    from .layouts import FP8_CHUNK, fp8_a_index, fp8_key_row

    if n % 8 or not 8 <= n <= 256 or k % 32:
        raise ValueError(f"e4m3 wgmma: n must be a multiple of 8 in [8, 256] and k of 32, got n={n}, k={k}")
    dtype = "float8_e4m3fn"
    nr = n // 2
    a_shape = (k // 2,) if a_regs else (8, k // FP8_CHUNK, 8, FP8_CHUNK)
    a_scope = "local" if a_regs else "shared.dyn"
    a_whole = tuple(slice(0, e) for e in a_shape)
    b_shape = (n // 8, k // FP8_CHUNK, 8, FP8_CHUNK)
    mma = getattr(getattr(T.ptx.wgmma.mma_async.sync.aligned, f"m64n{n}k32").f32.e4m3, "e4m3")

    def a_at(A, vi, vk):
        if a_regs:
            return A[fp8_a_index(vi, vk)]
        return A[vi // 8, vk // FP8_CHUNK, vi % 8, vk % FP8_CHUNK]

    def b_at(B, vj, vk):  # the K tile's rows permuted ("ss"), V's in order ("rs")
        row = vj if a_regs else fp8_key_row(vj)
        return B[row // 8, vk // FP8_CHUNK, row % 8, vk % FP8_CHUNK]

    def acc_reg(vi, vj):
        return acc_layout(vi, vj if a_regs else fp8_key_row(vj))[1]

    @tvmscript.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle):
        A = T.match_buffer(a, a_shape, dtype, offset_factor=1, scope=a_scope)
        B = T.match_buffer(b, b_shape, dtype, offset_factor=1, scope="shared.dyn")
        C = T.match_buffer(c, (nr,), "float32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:nr], A[a_whole], B[0 : b_shape[0], 0 : b_shape[1], 0:8, 0:FP8_CHUNK])
            T.writes(C[0:nr])
            for i, j, kk in T.grid(64, n, k):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                    C[acc_reg(vi, vj)] = C[acc_reg(vi, vj)] + T.cast(a_at(A, vi, vk), "float32") * T.cast(
                        b_at(B, vj, vk), "float32")

    def descriptor(X, offset, lbo, sbo):
        # X's start and the operand's offset in 16-byte units (16 one-byte elements; always whole)
        start = X.access_ptr("r", offset=-X.elem_offset)
        return T.cuda.func_call("tvmflash_wgmma_descriptor", start, T.floordiv(X.elem_offset + offset, FP8_CHUNK),
                                lbo, sbo, NO_SWIZZLE, source_code=_DESCRIPTOR, return_type="uint64")

    def k_major(X, s0, s1, ks):
        # a k32 slice is two core matrices along K; LBO: the K-direction core-matrix stride, SBO: 8 rows'
        return descriptor(X, ks * 2 * s1, s1 // FP8_CHUNK, s0 // FP8_CHUNK)

    shared_operands_visible, wgmma_begin, wgmma_end = _wgmma_macros(fence_operands, nr, wait=True)

    @tvmscript.prim_func(s_tir=True)
    def impl_ss(a: T.handle, b: T.handle, c: T.handle):
        sa0 = T.int32()
        sa1 = T.int32()
        sb0 = T.int32()
        sb1 = T.int32()
        A = T.match_buffer(a, a_shape, dtype, offset_factor=1, scope="shared.dyn", strides=[sa0, sa1, FP8_CHUNK, 1])
        B = T.match_buffer(b, b_shape, dtype, offset_factor=1, scope="shared.dyn", strides=[sb0, sb1, FP8_CHUNK, 1])
        C = T.match_buffer(c, (nr,), "float32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:nr], A[a_whole], B[0 : b_shape[0], 0 : b_shape[1], 0:8, 0:FP8_CHUNK])
            T.writes(C[0:nr])
            for tx in T.thread_binding(WARPGROUP, thread="threadIdx.x"):
                shared_operands_visible()
                wgmma_begin(C)
                T.ptx.wgmma.fence.sync.aligned()
                for ks in T.unroll(k // 32):
                    mma(*[C[r] for r in range(nr)], k_major(A, sa0, sa1, ks), k_major(B, sb0, sb1, ks),
                        T.bool(True), 1, 1)
                wgmma_end(C)

    @tvmscript.prim_func(s_tir=True)
    def impl_rs(a: T.handle, b: T.handle, c: T.handle):
        sb0 = T.int32()
        sb1 = T.int32()
        A = T.match_buffer(a, a_shape, dtype, offset_factor=4, scope="local")
        B = T.match_buffer(b, b_shape, dtype, offset_factor=1, scope="shared.dyn", strides=[sb0, sb1, FP8_CHUNK, 1])
        C = T.match_buffer(c, (nr,), "float32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:nr], A[a_whole], B[0 : b_shape[0], 0 : b_shape[1], 0:8, 0:FP8_CHUNK])
            T.writes(C[0:nr])
            for tx in T.thread_binding(WARPGROUP, thread="threadIdx.x"):
                # A's registers as 32-bit words: word 4 ks + r of the k32 slice ks is elements
                # 16 ks + 4 r .. 16 ks + 4 r + 3 of ``fp8_a_index`` (A's offset is a multiple of 4)
                A32 = T.decl_buffer((k // 8,), "uint32", data=A.data, elem_offset=A.elem_offset // 4, scope="local")
                wgmma_begin(C)
                for r in T.unroll(k // 8):
                    T.cuda.func_call("tvmflash_wgmma_reg_fence_u32", A32[r], source_code=REG_FENCE_U32)
                T.ptx.wgmma.fence.sync.aligned()
                for ks in T.unroll(k // 32):
                    mma(*[C[r] for r in range(nr)], A32[4 * ks], A32[4 * ks + 1], A32[4 * ks + 2],
                        A32[4 * ks + 3], k_major(B, sb0, sb1, ks), T.bool(True), 1, 1)
                wgmma_end(C)

    return desc, (impl_rs if a_regs else impl_ss)
