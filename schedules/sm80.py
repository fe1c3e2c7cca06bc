"""sm80 tensor-core schedule (mma.sync m16n8k16 + ldmatrix) for the attention program.

Mapping (FA2 style):
  * tile (b, h, qb) -> blockIdx.(z, y, x); num_warps warps (threadIdx.y), 32 lanes (threadIdx.x).
  * warp w owns rows [32 w, 32 w + 32) of the Q block (block_m == 32 * num_warps).
  * qk: S = Q K^T with mma.sync (ldmatrix Q as A, ldmatrix K as B^T); S stays in register
    fragments ("warp" scope).
  * pv: acc += P V with mma.sync (P straight from registers as A, ldmatrix.trans V as B); the
    output accumulator stays in register fragments across all K/V tiles, and is rescaled and
    stored from them.
  * The online softmax runs on the fragments: the masked score, P and its fp16/bf16 cast keep the
    mma accumulator layout, which is also the A-operand layout, so P never leaves registers. Row
    max and row sum are our own intrinsics: per-lane partials, then two xor shuffles across the
    quad of lanes that shares a row. The per-row running values (max, sum, rescale factor) stay
    in "local" buffers replicated on each quad (row_state "registers", the default; FA2's way): the per-row blocks run through intrinsics derived from the blocks themselves
    (quad_rows_intrin), and the K/V loop keeps only the 2 barriers of the K/V tiles. Each lane's
    per-row buffers compact to 4 statically indexed values (registers, no local memory: ptxas
    -v shows no stack frame at d64) thanks to a second buffer compaction after the match buffers
    are lowered (tvm_fixes.CompactAgainAfterMatchBuffers); store_lse reads the final m
    and l through a shared-memory copy (one barrier after the loop, see common.staged_row_block).
    row_state "shared" keeps them in shared memory instead, one lane per row, which costs ~7
    __syncthreads per tile.
  * Shared tiles have padded rows, so ldmatrix is free of bank conflicts.
  * num_stages: 1 loads each K/V tile with plain vector loads at the top of its step. 2 or 3 make
    the K/V-tile loop a software pipeline (TVM's InjectSoftwarePipeline): load_k/load_v become
    cp.async copies issued num_stages - 1 tiles ahead into num_stages shared buffers, with
    cp.async.wait_group before the tile's compute. It needs tvmflash.lowering's
    no_warp_thread_sync (else "Cannot insert syncs inside condition" in the pipeline epilogue).
"""

from __future__ import annotations

import math

import tvm

from tvmflash.lowering.annotations import ATOMIC_ADD_PRAGMA

from .common import (QuadRowLayout, bind_grid, buffer_info, dkdv_grid, hide_init_reads, pipeline_loads,
                     quad_row_block, quad_row_init, read_index, register_intrin, row_quad_map, row_reduce_intrin,
                     staged_row_block, tensorize_row_reduce)
from .cuda import schedule_decode_merge

WARP = 32


KNOBS = {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 2, "vec": 8, "row_state": "registers"}
# The strides of q, k, v and out are whole 16-byte vectors (``program.attention_forward``'s
# stride_alignment; ``kernels.Kernel`` copies a tensor whose strides are not): the copies move 16 bytes.
STRIDE_ALIGNMENT = 16
NUM_STAGES = (1, 2, 3)  # 1: plain loads; 2, 3: cp.async software pipeline over the K/V tiles
# Where the per-row running values (m, m_new, alpha, l) live. "registers": replicated on the 4
# lanes of the quad that holds the row's fragment elements (FA2's way); the K/V step then has only
# the barriers that guard the K/V shared tiles. "shared": shared memory, one lane per row
# (ThreadSync then puts ~7 __syncthreads in each K/V step); kept as a knob for comparison.
ROW_STATES = ("registers", "shared")
# Measured on the H200 (benchmarks/row_state_check.py and BENCHMARKS.md, bf16, seqlen 4096,
# 2026-11-30): head_dim 128 non-causal 286 TFLOP/s with row_state "registers", 64-key tiles and
# num_stages 2, against 259 with num_stages 1, 246 with 32-key tiles and 192 with 128-key tiles;
# row_state "shared" 256 at num_stages 1 (its pipelined build spills). head_dim 64 alike.
KNOBS_FOR_HEAD_DIM = {256: {"block_n": 32}}
# Tuning space (``tvmflash tune``): one MetaSchedule task per (block_m, block_n), the program's tiles. A
# callable gives the candidates from the knobs before it: this version needs block_m == 32 *
# num_warps. num_stages is a structure knob: the pipeline's stage annotations need a plain int, so
# each value is a design space of its own inside the task (``tune.structures``).
STRUCTURE_KNOBS = ("num_stages",)
SPACE = {
    "block_m": [64, 128],
    "block_n": [32, 64, 128],
    "num_warps": lambda knobs: [knobs["block_m"] // WARP],
    "num_stages": [1, 2],
    "vec": [8],
    "row_state": ["registers"],
}
# The values a knob may take, where not any positive int (``schedules.knob_problem``).
CHOICES = {"num_stages": NUM_STAGES, "row_state": ROW_STATES}
def shared_memory_bytes(head_dim: int, dtype: str, knobs: dict) -> int:
    """Shared memory a build with these knobs needs: the Q tile and num_stages K/V tile pairs,
    rows padded by 8 elements, plus the per-row values staged for store_lse (a few per row)."""
    row_bytes = (head_dim + 8) * (2 if dtype in DTYPES else 4)
    tiles = knobs["block_m"] + 2 * knobs["block_n"] * max(1, knobs["num_stages"])
    return tiles * row_bytes + 8 * 4 * knobs["block_m"]


PASS_CONFIG = {
    "tirx.use_async_copy": True,
    # Fragments are per-lane register arrays: any loop over them left rolled indexes them
    # dynamically, which puts them in local memory.
    "tirx.UnrollLoop": {"unroll_local_access": True, "explicit_unroll": False},
    # LowerWarpMemory cannot see through CSE'd store indices into warp buffers.
    "tirx.disable_cse_tir": True,
}
DTYPES = ("float16", "bfloat16")  # float32 has no exact tensor-core path: the SIMT schedule serves it


# --------------------------------------------------------------------------------------------
# mma.sync m16n8k16 and ldmatrix intrinsics, fp16 and bf16
# --------------------------------------------------------------------------------------------
# Our own rather than tvm.s_tir.tensor_intrin.cuda's: importing that module parses ~500 TVMScript
# functions for every target (about a minute), and it has no bf16 ones. These are its
# get_ldmatrix_intrin, get_mma_intrin and get_mma_fill_intrin for 16 x 16 x 16 tiles, so the code
# generated is the same.
_PTX_TYPE = {"float16": "fp16", "bfloat16": "bf16"}


def _ldmatrix_intrin(dtype, operand, transposed):
    """ldmatrix.x4 of a 16 x 16 tile in shared.dyn into its mma fragment (``_ldmatrix_layout``),
    as operand "A" (rows x k) or "B" (k x cols); ``transposed``: the tile in shared memory is the
    operand transposed."""
    from tvm.script import tirx as T

    # ldmatrix's .trans: mma.sync takes A row-major and B column-major, so B's tile as stored needs
    # it and A's does not; a transposed tile the other way round.
    trans = transposed if operand == "A" else not transposed

    def row_offset(tx, stride):  # lane tx's address: one 8-element row of the four 8 x 8 matrices
        if transposed:
            return stride * 8 * (tx // 16) + stride * (tx % 8) + 8 * ((tx % 16) // 8)
        return stride * (tx % 16) + 8 * (tx // 16)

    @T.prim_func(s_tir=True)
    def desc(warp_handle: T.handle, shared_handle: T.handle) -> None:
        shared = T.match_buffer(shared_handle, (16, 16), dtype, align=64, offset_factor=16, scope="shared.dyn")
        warp = T.match_buffer(warp_handle, (WARP, 8), dtype, align=64, offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:16, 0:16])
            T.writes(warp[0:WARP, 0:8])
            for ax0, ax1 in T.grid(16, 16):
                with T.sblock("shared_warp"):
                    v0, v1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(shared[v0, v1])
                    lane, reg = T.meta_var(_ldmatrix_layout(v0, v1))
                    T.writes(warp[lane, reg])
                    warp[lane, reg] = shared[v0, v1]

    @T.prim_func(s_tir=True)
    def impl(warp_handle: T.handle, shared_handle: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        shared = T.match_buffer(shared_handle, (16, 16), dtype, align=64, offset_factor=16, scope="shared.dyn",
                                strides=[s0, s1])
        warp = T.match_buffer(warp_handle, (WARP, 8), dtype, align=64, offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:16, 0:16])
            T.writes(warp[0:WARP, 0:8])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(T.ptx_legacy.ldmatrix(trans, 4, ".b16", warp.data, warp.elem_offset + 8 * tx,
                                                 shared.access_ptr("r"), row_offset(tx, s0), dtype=dtype))

    return desc, impl


def _mma_intrin(dtype, a_transposed, b_transposed):
    """C += A B on fragments (float32 C): two mma.sync m16n8k16, one per 8-column half of C;
    ``a_transposed``/``b_transposed``: the fragment holds the operand transposed."""
    from tvm.script import tirx as T

    ptx = _PTX_TYPE[dtype]

    def fragment(buffer, row, col, transposed):
        return buffer[_ldmatrix_layout(col, row) if transposed else _ldmatrix_layout(row, col)]

    def mma_half(A, B, C, tx, half):  # C's columns 8 half .. 8 half + 7: B's and C's registers 4 half ..
        return T.ptx_legacy.mma("m16n8k16", "row", "col", ptx, ptx, "fp32", A.data, A.elem_offset + tx * 8,
                                B.data, B.elem_offset + tx * 8 + 4 * half, C.data, C.elem_offset + tx * 8 + 4 * half,
                                False, dtype="float32")

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, 8), dtype, align=64, offset_factor=16, scope="warp")
        B = T.match_buffer(b, (WARP, 8), dtype, align=64, offset_factor=16, scope="warp")
        C = T.match_buffer(c, (WARP, 8), "float32", align=64, offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:8], A[0:WARP, 0:8], B[0:WARP, 0:8])
            T.writes(C[0:WARP, 0:8])
            for i, j, k in T.grid(16, 16, 16):
                with T.sblock("C"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    lane, reg = T.meta_var(_ldmatrix_layout(vi, vj))
                    T.reads(C[lane, reg], fragment(A, vi, vk, a_transposed), fragment(B, vk, vj, b_transposed))
                    T.writes(C[lane, reg])
                    C[lane, reg] += T.Cast("float32", fragment(A, vi, vk, a_transposed)) * T.Cast(
                        "float32", fragment(B, vk, vj, b_transposed))

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, 8), dtype, align=64, offset_factor=16, scope="warp")
        B = T.match_buffer(b, (WARP, 8), dtype, align=64, offset_factor=16, scope="warp")
        C = T.match_buffer(c, (WARP, 8), "float32", align=64, offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:8], A[0:WARP, 0:8], B[0:WARP, 0:8])
            T.writes(C[0:WARP, 0:8])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(mma_half(A, B, C, tx, 0))
                T.evaluate(mma_half(A, B, C, tx, 1))

    return desc, impl


def _fill_intrin():
    """Zero a 16 x 16 float32 tile of fragments."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(a: T.handle) -> None:
        C = T.match_buffer(a, [WARP, 8], dtype="float32", scope="warp")
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:8])
            for i0, i1 in T.grid(16, 16):
                with T.sblock("C_warp"):
                    i, j = T.axis.remap("SS", [i0, i1])
                    lane, reg = T.meta_var(_ldmatrix_layout(i, j))
                    T.reads()
                    T.writes(C[lane, reg])
                    C[lane, reg] = T.float32(0)

    @T.prim_func(s_tir=True)
    def impl(a: T.handle) -> None:
        C = T.match_buffer(a, [WARP, 8], dtype="float32", scope="warp", offset_factor=1)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:8])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(T.cuda.mma_fill_legacy(8, C.data, C.elem_offset, dtype="float32"))

    return desc, impl


_ROLES = {  # role: the intrinsic's generator and its arguments after the dtype
    "ld_a": (_ldmatrix_intrin, "A", False),
    "ld_a_trans": (_ldmatrix_intrin, "A", True),
    "ld_b": (_ldmatrix_intrin, "B", False),
    "ld_b_trans": (_ldmatrix_intrin, "B", True),
    "mma_nn": (_mma_intrin, False, False),
    "mma_nt": (_mma_intrin, False, True),
    "mma_tn": (_mma_intrin, True, False),
}
_FILL = "tvmflash_mma_fill_f32"
_REGISTERED: set[str] = set()


def _intrin_names(dtype):
    """Tensor intrinsic names by role (``_ROLES`` and "fill"), for fp16 or bf16 operands; registers
    them on first use."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: the sm80 schedule takes {DTYPES}, got {dtype!r}")
    names = {role: f"tvmflash_{role}_{_PTX_TYPE[dtype]}" for role in _ROLES}
    for role, name in names.items():
        if name not in _REGISTERED:
            make, *args = _ROLES[role]
            register_intrin(name, *make(dtype, *args))
            _REGISTERED.add(name)
    if _FILL not in _REGISTERED:
        register_intrin(_FILL, *_fill_intrin())
        _REGISTERED.add(_FILL)
    return {**names, "fill": _FILL}


def frag_rows(n_rows: int, n_cols: int) -> QuadRowLayout:
    """An n_rows x n_cols tile of one warp held as mma fragments ("warp" scope, the layout of
    ``_frag_index_map``), for ``common.row_reduce_intrin``: lane l holds rows l // 4 and
    l // 4 + 8 of each 16-row tile rt; row 16 rt + 8 h + l // 4 is its k-th row for k = 2 rt + h
    (slot (k, l // 4) of ``row_quad_map``), in registers 4 half + 2 h + e of every 16-column
    tile."""
    return QuadRowLayout(
        key=f"mma_{n_rows}x{n_cols}", shape=(n_rows // 16, n_cols // 16, WARP, 8), scope="warp",
        n_rows=n_rows, n_cols=n_cols, threads=WARP, element=_frag_index_map,
        row_tiles=n_rows // 16, col_tiles=n_cols // 16,
        row=lambda lane, k: 8 * k + lane // 4,
        row_slot=lambda lane, k: (k, lane // 4),
        held=lambda lane, rt, h, ct, half, e: (rt, ct, lane, 4 * half + 2 * h + e),
    )




def _ldmatrix_layout(i, j):
    """(row, col) of a 16 x 16 tile -> (lane, register) of its mma fragment (ldmatrix's, mma.sync's):
    lane 4 r + q holds rows r and r + 8 of columns 2 q, 2 q + 1, 2 q + 8 and 2 q + 9."""
    return 4 * (i % 8) + (j % 8) // 2, 4 * (j // 8) + (i // 8) * 2 + (j % 2)


def _frag_index_map(i, j):
    """(row, col) of a matrix -> (row tile, col tile, lane, register) of its mma fragments."""
    lane, reg = _ldmatrix_layout(i % 16, j % 16)
    return (i // 16, j // 16, lane, reg)


# --------------------------------------------------------------------------------------------
def _copy_to_shared(sch, block, num_warps, vec):
    """Cooperative vectorised copy: all num_warps*32 threads, vec elements each."""
    fused = sch.fuse(*sch.get_loops(block)[-2:])
    _, ty, tx, v = sch.split(fused, [None, num_warps, WARP, vec])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(v)


def _tile_frag(sch, block, h=16, w=16):
    a, b = sch.get_loops(block)[-2:]
    a0, a1 = sch.split(a, [None, h])
    b0, b1 = sch.split(b, [None, w])
    sch.reorder(a0, b0, a1, b1)
    return a1


def _warp_gemm_operands(sch, block, num_warps, operands):
    """Cut a GEMM block (loops: rows, cols, reduction) into 16x16x16 mma tiles, give each warp its
    rows, and load the operands into register fragments with ldmatrix.

    operands: (read index of the blockized block, or the buffer's name; ldmatrix intrinsic) for A and
    B. Returns the blockized
    outer block; the caller tensorizes the mma itself (``sch.get_loops(block)[-3]``).
    """
    i, n, k = sch.get_loops(block)
    i0, i1 = sch.split(i, [None, 16])
    n0, n1 = sch.split(n, [None, 16])
    k0, k1 = sch.split(k, [None, 16])
    sch.reorder(i0, n0, k0, i1, n1, k1)
    outer = sch.blockize(i1)
    warp, i0 = sch.split(i0, [num_warps, None])
    sch.reorder(warp, k0, i0, n0)
    sch.bind(warp, "threadIdx.y")
    sch.decompose_reduction(outer, k0)
    # The K/V-tile scope (kv_step) is not a "stage pipeline" (pv and update_ml write acc, m and l
    # after other blocks read them), so compute_at cannot target loops directly under it.
    # Wrapping one warp's mma loop nest in its own block gives the fragment loads a scope that is.
    sch.blockize(k0)
    loads = []
    for index, intrin in operands:
        if intrin is None:  # already an mma fragment ("warp" scope)
            continue
        if isinstance(index, str):  # the program's buffer name
            index = read_index(sch, outer, index)
        fragment = sch.cache_read(outer, index, "warp")
        sch.compute_at(fragment, k0)
        loads.append((fragment, intrin))
    for fragment, intrin in loads:
        loop = _tile_frag(sch, fragment)
        sch.transform_layout(fragment, ("write", 0), _frag_index_map)
        sch.tensorize(loop, intrin)
    return outer


def _fragment_elementwise(sch, name, num_warps):
    """An elementwise (rows, cols) block over mma fragments: each lane visits the elements it
    holds, in the order (row tile, col tile, register)."""
    sch.transform_block_layout(name, lambda i, j: _frag_index_map(i, j))
    a0, a1, lane, reg = sch.get_loops(name)[-4:]
    w, a0 = sch.split(a0, [num_warps, None])
    sch.reorder(w, lane, a0, a1, reg)
    sch.bind(w, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")


def _fragment_lanes(sch, name):
    """A block over one 16x16 tile of mma fragments (a GEMM's init, after decompose_reduction),
    iterated as (lane, register), the lanes on threadIdx.x."""
    sch.transform_block_layout(name, lambda i, d: _ldmatrix_layout(i, d))
    lane, reg = sch.get_loops(name)[-2:]
    sch.bind(lane, "threadIdx.x")


def _fill_fragments(sch, name, num_warps, fill):
    """A (rows, cols) init block on mma fragments: 16x16 tiles filled by the ``fill`` intrinsic,
    each warp its rows."""
    i, d = sch.get_loops(name)
    i0, i1 = sch.split(i, [None, 16])
    d0, d1 = sch.split(d, [None, 16])
    sch.reorder(i0, d0, i1, d1)
    iw, im = sch.split(i0, [num_warps, None])
    sch.bind(iw, "threadIdx.y")
    sch.tensorize(i1, fill)


def _store_fragments(sch, name, num_warps, vector=True):  # name: a block's name, or the block
    """A (rows, cols) store block that reads mma fragments, each lane the elements it holds.
    (transform_block_layout would be shorter but it leaves the block's T.where referring to the
    removed loop var: "variables (i,) are used, but are not passed in as API arguments".) Fragment
    (lane, reg) of a 16x16 tile is i = 8h + r8, d = 8dh + 2q + e with lane = 4 r8 + q,
    reg = 4 dh + 2 h + e."""
    i, d = sch.get_loops(name)
    w, mi, h, r8 = sch.split(i, [num_warps, None, 2, 8])
    d0, dh, q, e = sch.split(d, [None, 2, 4, 2])
    sch.reorder(w, r8, q, mi, d0, h, dh, e)
    sch.bind(w, "threadIdx.y")
    sch.bind(sch.fuse(r8, q), "threadIdx.x")
    if vector:
        sch.vectorize(e)  # the two adjacent columns a lane holds: one 32-bit store


def _row_block(sch, name, num_warps):
    """Per-row block: row i = 32 w + lane (one lane per row)."""
    i = sch.fuse(*sch.get_loops(name))
    w, r = sch.split(i, [num_warps, None])
    sch.bind(w, "threadIdx.y")
    r0, r1 = sch.split(r, [None, WARP])
    sch.bind(r1, "threadIdx.x")
    return r0


def schedule(
    sch: tvm.s_tir.Schedule,
    *,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    vec: int,
    row_state: str = "registers",
) -> tvm.s_tir.Schedule:
    """Map the attention program onto sm80 tensor cores. See the module docstring."""
    dtype, BM, D, BN = buffer_info(sch)
    assert (BM, BN) == (block_m, block_n), "schedule knobs must match the program's tiles"
    if block_m != WARP * num_warps:
        raise ValueError(f"block_m: the sm80 schedule maps one row per lane, so block_m must be 32 * num_warps "
                         f"= {WARP * num_warps}, got {block_m}")
    if block_n % 16 or D % 16:
        raise ValueError(f"block_n and head_dim: expected multiples of 16, got {block_n} and {D}")
    if not isinstance(num_stages, int) or num_stages not in NUM_STAGES:
        raise ValueError(f"num_stages: the sm80 schedule takes one of {NUM_STAGES}, got {num_stages!r}")
    if row_state not in ROW_STATES:
        raise ValueError(f"row_state: the sm80 schedule takes one of {ROW_STATES}, got {row_state!r}")
    quads = row_state == "registers"
    names = _intrin_names(dtype)

    # ---- grid -----------------------------------------------------------------------------
    bind_grid(sch)

    # ---- Q, K, V tiles into (dynamic) shared memory ---------------------------------------
    for name in ("load_q", "load_k", "load_v"):
        sch.set_scope(name, 0, "shared.dyn")
        # Rows padded by 16 bytes: the 8 rows an ldmatrix reads then fall in different banks.
        sch.storage_align(name, 0, axis=0, factor=D, offset=8)
        # 16-byte vector copies.
        _copy_to_shared(sch, name, num_warps, vec)

    # ---- per-row state ---------------------------------------------------------------------
    sch.set_scope("init_scale", 0, "local")
    sch.set_scope("init_ml", 0, "local")  # m: only per-row blocks touch it
    # The per-row values but m: read by the fragment lanes (exp, pv_init, store_o) or
    # written by the quad reductions. "shared": in shared memory, one lane per row. "registers":
    # each lane keeps the values of the rows it holds fragments of (local scope is not relaxed over
    # threadIdx, so each compacts to a few registers per thread).
    per_row_scope = "local" if quads else "shared.dyn"
    # l, m_tile, m_new, alpha, l_tile, l_new, l_inv
    per_row = (("init_ml", 1), ("row_max", 0), ("alpha", 0), ("alpha", 1), ("row_sum", 0), ("merge_l", 0),
               ("inv_l", 0))
    for name, index in per_row:
        sch.set_scope(name, index, per_row_scope)
    if quads:
        for name, index in (("init_ml", 0), *per_row):
            sch.transform_layout(name, ("write", index), row_quad_map)

    # ---- softmax on the fragments ----------------------------------------------------------
    # S, the masked score, P and its cast Pc all keep the mma accumulator layout, and each lane
    # works on the elements it holds. The cast Pc is directly the A operand of the pv mma (the
    # accumulator layout of m16n8k16 is its A layout), so P never goes through shared memory.
    for name in ("qk", "score", "exp", "cast_p"):
        sch.set_scope(name, 0, "warp")
        sch.transform_layout(name, ("write", 0), _frag_index_map)

    # ---- qk: S = Q K^T on tensor cores, S kept as mma fragments ("warp" scope) -------------
    qk = sch.get_sblock("qk")
    _warp_gemm_operands(sch, qk, num_warps, [(1, names["ld_a"]), (2, names["ld_b_trans"])])  # Qt, Kt
    sch.tensorize(sch.get_loops(qk)[-3], names["mma_nt"])
    sch.tensorize(sch.get_loops("qk_init")[-2], names["fill"])

    for name in ("score", "exp", "cast_p"):
        _fragment_elementwise(sch, name, num_warps)
    # Row max and row sum: per-lane partial results combined across each quad by shuffles
    # (common.row_reduce_intrin, shared with sm90), into per-row values in shared memory or, with
    # row_state "registers", in each quad's registers.
    for name, op in (("row_max", "max"), ("row_sum", "sum")):
        intrin = row_reduce_intrin(op, frag_rows(BM // num_warps, BN), per_row_scope)
        tensorize_row_reduce(sch, name, intrin, num_warps, WARP, quad_row_init(sch) if quads else None)

    # ---- pv: acc += P V on tensor cores, acc kept as fragments across K/V tiles ------------
    sch.set_scope("pv", 0, "warp")
    sch.transform_layout("pv", ("write", 0), _frag_index_map)
    pv = sch.get_sblock("pv")
    # pv_init (from decompose_reduction) is the rescale acc *= alpha, on fragments.
    pv_o = _warp_gemm_operands(sch, pv, num_warps, [(2, None), (3, names["ld_b"])])  # Pc (already), Vt
    for blk in (pv_o, pv):
        hide_init_reads(sch, blk)
    sch.tensorize(sch.get_loops(pv)[-3], names["mma_nn"])
    _fragment_lanes(sch, "pv_init")  # the rescale

    _fill_fragments(sch, "init_acc", num_warps, names["fill"])
    _store_fragments(sch, "store_o", num_warps)  # the epilogue, straight from the fragments


    if quads:  # per-row values on the quads that hold the rows
        for name in ("init_ml", "alpha", "merge_l", "update_ml", "inv_l"):
            quad_row_block(sch, name, num_warps)
        staged_row_block(sch, "store_lse", num_warps, lambda sch, name: _row_block(sch, name, num_warps))
    else:  # one lane per row
        for name in ("init_ml", "alpha", "merge_l", "update_ml", "inv_l", "store_lse"):
            _row_block(sch, name, num_warps)
    # ---- K/V loads: cp.async software pipeline (last: it annotates kv_step's final children) -
    if num_stages > 1:
        pipeline_loads(sch, num_stages)
    return sch



# --------------------------------------------------------------------------------------------
# The backward (``tvmflash.program_backward``) on tensor cores: dkdv and dq each mapped as the forward
# is (``_schedule_dkdv``, ``_schedule_dq``), delta on the SIMT schedule. dkdv's tile (block_m query
# rows a step, block_n keys, dkdv_warps warps of block_n / dkdv_warps keys) and dq's (dq_block_m rows,
# dq_warps warps of 32 rows, dq_block_n keys a step) are knobs of their own.
BACKWARD_KNOBS = {"block_m": 64, "block_n": 64, "dkdv_warps": 4, "dkdv_stages": 2, "dq_block_m": 64, "dq_block_n": 64,
                  "dq_warps": 2, "dq_stages": 2, "vec": 8, "dq_atomic": False}
# dq in 32-key tiles from head_dim 96: with 64, s, p and dp (64 floats a lane each) and dq (head_dim) spill.
BACKWARD_KNOBS_FOR_HEAD_DIM = {96: {"dq_block_n": 32}, 128: {"dq_block_n": 32}}
BACKWARD_HEAD_DIMS = (32, 64, 96, 128)  # at 256, dk and dv alone are 512 floats a lane of 16 keys: SIMT serves it
BACKWARD_SPACE = {
    "block_m": [32, 64, 128],
    "block_n": [32, 64, 128],
    "dkdv_warps": [2, 4, 8],
    "dkdv_stages": list(NUM_STAGES),
    "dq_block_m": [32, 64, 128],
    "dq_block_n": [32, 64],
    "dq_warps": lambda knobs: [knobs["dq_block_m"] // WARP],
    "dq_stages": list(NUM_STAGES),
    "vec": [8],
}
# dq_atomic (dq's share added by fp32 atomics from dkdv, FA2's way, instead of the dq pass) is no
# tuning choice: it makes dq's rounding change from run to run, and on the H200 (bf16, 16k tokens) it
# measured 2% slower at d64 and 29% slower at d128 (dkdv then spills).


def backward_shared_memory_bytes(head_dim: int, dtype: str, knobs: dict) -> int:
    """Dynamic shared memory of the larger of dkdv and dq: each program's Q, dout, K and V tiles
    (rows padded by 8 elements) and its rows' lse and delta."""
    dkdv = (2 * knobs["block_m"] + 2 * knobs["block_n"]) * (head_dim + 8) * 2 + 8 * knobs["block_m"]
    if knobs.get("dq_atomic"):  # and dsᵀ, for dq's share
        return dkdv + knobs["block_n"] * (knobs["block_m"] + 8) * 2
    return max(dkdv, (2 * knobs["dq_block_m"] + 2 * knobs["dq_block_n"]) * (head_dim + 8) * 2 + 8 * knobs["dq_block_m"])


def schedule_backward(sch: tvm.s_tir.Schedule, *, block_m: int, block_n: int, dkdv_warps: int, dkdv_stages: int,
                      dq_block_m: int, dq_block_n: int, dq_warps: int, dq_stages: int, vec: int,
                      dq_atomic: bool = False) -> tvm.s_tir.Schedule:
    """delta on the SIMT schedule, dkdv and dq on tensor cores (``vec`` elements a copy); see above.
    The tiles are the program's (``program_backward.attention_backward``). ``dq_atomic``: the program
    has no dq; dkdv adds dq's share atomically (``_schedule_dq_share``) and convert_dq runs on SIMT."""
    from . import cuda

    cuda.schedule_delta(sch)
    _schedule_dkdv(sch, dkdv_warps, dkdv_stages, vec, dq_atomic)
    if dq_atomic:
        cuda.schedule_convert_dq(sch)
    else:
        _schedule_dq(sch, dq_warps, dq_stages, vec)
    return sch


def _schedule_dq(sch: tvm.s_tir.Schedule, num_warps: int, num_stages: int, vec: int) -> None:
    """dq on tensor cores, mapped as the forward is (dq's tile is the forward's: a Q block, the K/V
    blocks streamed past it). q kᵀ and dout vᵀ are the forward's qk (ldmatrix Q or dout as A, K or
    V as Bᵀ); p and ds stay in the mma accumulator layout, which is the A layout, so ds feeds
    dq += ds k (ldmatrix.trans K as B) from registers, as P feeds P V; dq accumulates in fragments
    across the K/V blocks and is stored from them; p, which feeds no mma, stays in each lane's
    registers. The rows' lse and delta sit in shared memory, one lane a row. ``num_stages``: the
    forward's K/V pipeline."""
    sch.work_on("dq")
    dtype, BM, D, BN = buffer_info(sch)
    if BM != WARP * num_warps or BN % 16 or D % 16:
        raise ValueError(f"knobs: the sm80 dq needs dq_block_m = 32 * dq_warps and dq_block_n, head_dim multiples "
                         f"of 16, got dq_block_m {BM}, dq_warps {num_warps}, dq_block_n {BN}, head_dim {D}")
    names = _intrin_names(dtype)
    bind_grid(sch)
    _backward_step(sch, ("load_q", "load_do", "load_k", "load_v"), (), num_warps, vec, names)
    _accumulate(sch, "dq", num_warps, names)
    if num_stages > 1:
        pipeline_loads(sch, num_stages)


def _schedule_dkdv(sch: tvm.s_tir.Schedule, num_warps: int, num_stages: int, vec: int, dq_atomic: bool = False) -> None:
    """dkdv on tensor cores. Its tiles are key-first (sᵀ = k qᵀ, ...), so each warp owns 16 or
    more keys (rows) of the K/V block: it computes sᵀ and dpᵀ for its keys against the whole Q block
    (ldmatrix K or V as A, q or dout as Bᵀ), keeps pᵀ and dsᵀ in the mma accumulator layout, which
    is the A layout of pᵀ dout and dsᵀ q, and accumulates dv and dk for its keys in fragments across
    the Q blocks. The Q, dout, K and V tiles and the rows' lse and delta sit in shared memory; with
    ``num_stages`` 2 or 3, the Q and dout blocks and their rows' lse and delta of the next steps are
    loaded by cp.async while this one computes (the steps of all the group's query heads are one
    pipelined loop)."""
    sch.work_on("dkdv")
    dtype, BM, D, BN = buffer_info(sch)
    if BN % (16 * num_warps) or BM % 16 or D % 16:
        raise ValueError(f"knobs: the sm80 dkdv needs block_n a multiple of 16 * dkdv_warps and block_m, head_dim "
                         f"multiples of 16, got block_n {BN}, dkdv_warps {num_warps}, block_m {BM}, head_dim {D}")
    names = _intrin_names(dtype)
    staged = dkdv_grid(sch, dq_atomic)  # dsᵀ's copy to shared memory with dq_atomic
    _backward_step(sch, ("load_k", "load_v", "load_q", "load_do"), ("cast_p",), num_warps, vec, names)
    for name in ("dv", "dk"):  # dv += pᵀ dout, dk += dsᵀ q
        _accumulate(sch, name, num_warps, names)
    if dq_atomic:
        _schedule_dq_share(sch, staged, num_warps, names)
    if num_stages > 1:
        pipeline_loads(sch, num_stages, step="q_step", loads=("load_q", "load_do", "load_lse", "load_delta"))


def _schedule_dq_share(sch: tvm.s_tir.Schedule, staged, num_warps: int, names: dict) -> None:
    """dq's share of a dkdv step, ds k, added atomically into the fp32 dq (FA2's way). Each warp holds
    dsᵀ for its keys, but ds k sums over all the block's keys: the warps write dsᵀ to shared memory,
    and each then takes 16 or more query rows of ds k (ldmatrix.trans dsᵀ as A, ldmatrix K as B) and
    adds its fragments into global memory one element at a time (``ATOMIC_ADD_PRAGMA``). ``staged``:
    the copy of dsᵀ to shared memory (``cache_read`` of dq's A)."""
    D = buffer_info(sch)[2]
    block = sch.get_sblock("dq")
    sch.storage_align(staged, 0, axis=0, factor=D, offset=8)
    _store_fragments(sch, staged, num_warps)
    sch.set_scope(block, 0, "warp")
    sch.transform_layout(block, ("write", 0), _frag_index_map)
    _warp_gemm_operands(sch, block, num_warps, [(1, names["ld_a_trans"]), (2, names["ld_b"])])
    sch.tensorize(sch.get_loops(block)[-3], names["mma_tn"])
    sch.tensorize(sch.get_loops("dq_init")[-2], names["fill"])
    _store_fragments(sch, "accumulate_dq", num_warps, vector=False)
    # the loops in each lane; 2: a lane's two adjacent columns may go as one vector reduction (sm_90)
    sch.annotate(sch.get_loops("accumulate_dq")[-5], ATOMIC_ADD_PRAGMA, 2)


def _backward_step(sch: tvm.s_tir.Schedule, loads, casts, num_warps: int, vec: int, names: dict) -> None:
    """What dkdv and dq share: their tiles (``loads``, in this order) in shared memory, rows padded for
    ldmatrix without bank conflicts; the rows' lse and delta there too, one lane a row (each lane
    reads those of the rows or columns it holds); s and dp on mma.sync (ldmatrix A, Bᵀ), and p, ds
    and ``casts`` (dkdv: pᵀ in the input dtype) in the accumulator layout, each lane its elements.
    p feeds no mma: each lane keeps it in registers ("local"), which also keeps StorageRewrite from
    putting p in place of s (LowerWarpMemory cannot see through that)."""
    D = buffer_info(sch)[2]
    for name in loads:
        sch.set_scope(name, 0, "shared.dyn")
        sch.storage_align(name, 0, axis=0, factor=D, offset=8)
        _copy_to_shared(sch, name, num_warps, vec)
    sch.set_scope("init_scale", 0, "local")
    for name in ("load_lse", "load_delta"):
        sch.set_scope(name, 0, "shared.dyn")
        _row_block(sch, name, num_warps)
    for name in ("qk", "exp", "dp", "ds", *casts):
        sch.set_scope(name, 0, "local" if name == "exp" else "warp")
        sch.transform_layout(name, ("write", 0), _frag_index_map)
    for name in ("qk", "dp"):  # the blockized GEMM reads: its output, then A, then B
        block = sch.get_sblock(name)
        _warp_gemm_operands(sch, block, num_warps, [(1, names["ld_a"]), (2, names["ld_b_trans"])])
        sch.tensorize(sch.get_loops(block)[-3], names["mma_nt"])
        sch.tensorize(sch.get_loops(f"{name}_init")[-2], names["fill"])
    for name in ("exp", "ds", *casts):
        _fragment_elementwise(sch, name, num_warps)


def _accumulate(sch: tvm.s_tir.Schedule, name: str, num_warps: int, names: dict) -> None:
    """A gradient's product (dq += ds k, dv += pᵀ dout, dk += dsᵀ q) on mma.sync: A from the registers
    that hold it (the accumulator layout is the A layout), B by ldmatrix, the gradient in fragments
    across the steps (its carried-over init is nothing to do on each lane's registers), zero-filled
    first and stored from the fragments. (Vectorised, the store fails LowerWarpMemory: "failed to
    rewrite load to shuffle".)"""
    sch.set_scope(name, 0, "warp")
    sch.transform_layout(name, ("write", 0), _frag_index_map)
    block = sch.get_sblock(name)
    outer = _warp_gemm_operands(sch, block, num_warps, [(1, None), (2, names["ld_b"])])
    for blk in (outer, block):
        hide_init_reads(sch, blk)
    sch.tensorize(sch.get_loops(block)[-3], names["mma_nn"])
    _fragment_lanes(sch, f"{name}_init")
    _fill_fragments(sch, f"init_{name}", num_warps, names["fill"])
    _store_fragments(sch, f"store_{name}", num_warps, vector=False)


# --------------------------------------------------------------------------------------------
# Decode (``tvmflash.program_decode``, built with tensor_cores=True) on tensor cores: a task's rows
# (its GQA group's query heads times its query tokens) in 16-row mma tiles, one warp each, so that
# the products cost a few mma.sync a K/V tile and the kernel is left to stream the cache.
# --------------------------------------------------------------------------------------------
# block_n: keys per K/V tile; num_stages: K/V tiles in flight (cp.async, 1: plain loads); vec: elements
# a copy moves. On the H200 (GQA 32/8, d128) 32-key tiles in three stages (four tasks an SM) read as fast
# as 64-key tiles in two (three an SM) at batch 32, and 1-7% faster at batch 8 (BENCHMARKS.md).
DECODE_KNOBS = {"block_n": 32, "num_stages": 3, "vec": 8}
DECODE_SPACE = {"block_n": [32, 64, 128], "num_stages": [1, 2, 3, 4], "vec": [8]}
DECODE_PASS_CONFIG = PASS_CONFIG
DECODE_TENSOR_CORES = True  # the program variant this schedule maps (program_decode.decode_split)
WARP_ROWS = 16  # a warp's rows of a task: one mma tile


def decode_query_tokens(group: int, knobs: dict) -> int:
    """Query tokens of a task: the fewest whose rows (group x tokens) fill whole 16-row mma tiles."""
    return WARP_ROWS // math.gcd(WARP_ROWS, group)


def decode_shared_memory_bytes(head_dim: int, dtype: str, knobs: dict, group: int = 8) -> int:
    """Shared memory of a task: its query rows and num_stages K/V tile pairs (rows padded by 8
    elements), and the final row values staged for store_lse."""
    rows = group * decode_query_tokens(group, knobs)
    tiles = rows + 2 * knobs["block_n"] * max(1, knobs["num_stages"])
    return tiles * (head_dim + 8) * 2 + 8 * rows


def decode_tasks_per_sm(head_dim: int, dtype: str, knobs: dict, group: int = 8) -> int:
    """Thread blocks of the split kernel one SM holds at once, by shared memory (228 KiB an SM, sm80
    to sm90, 1 KiB reserved a block; at most 32 blocks), for choosing the split count."""
    return max(1, min(32, (228 * 1024) // (decode_shared_memory_bytes(head_dim, dtype, knobs, group) + 1024)))


def decode_knob_problem(head_dim: int, dtype: str, knobs: dict) -> str | None:
    """Why these decode knobs cannot build, or None."""
    if dtype not in DTYPES:
        return f"the sm80 decode schedule takes {DTYPES}, got {dtype}"
    if head_dim % 16 or knobs["block_n"] % 32:
        # block_n 16 builds, but on the H200 it read too few keys: 5.8 TB/s (above HBM's 4.8) and
        # errors of 6e-2 at GQA 32/8, 16k keys (2026-12-02); not understood yet
        return f"head_dim ({head_dim}) must be a multiple of 16 and block_n ({knobs['block_n']}) of 32"
    if knobs["num_stages"] not in (1, 2, 3, 4):
        return f"num_stages must be 1 to 4, got {knobs['num_stages']!r}"
    if knobs["vec"] not in (2, 4, 8):
        return f"vec must be 2, 4 or 8, got {knobs['vec']!r}"
    return None


def schedule_decode(sch: tvm.s_tir.Schedule, *, block_n: int, num_stages: int, vec: int) -> tvm.s_tir.Schedule:
    """Map the decode programs (functions ``split``, ``single`` and ``merge``) onto tensor cores.

    split (and single, the same with one split): one thread block per task, blockIdx.x = (sequence,
    K/V head), y = query block, z = split; one warp per 16 rows. As the forward (``schedule``):
    the query rows and num_stages K/V tiles in padded shared rows (cp.async pipeline), S = Q Kᵀ
    and acc += P V with ldmatrix and mma.sync, the softmax on the fragments, the per-row values on
    the quads. The per-key running sums of P (``l_keys``) are fragments too, summed across the
    quads once, after the last tile. merge: SIMT, as ``cuda.schedule_decode_merge``.
    """
    for func in [gv.name_hint for gv in sch.mod.functions if gv.name_hint in ("split", "single")]:
        sch.work_on(func)
        names = _intrin_names(str(sch.get(sch.get_sblock("load_k")).writes[0].source.dtype))
        rows, head_dim = (int(x) for x in sch.get(sch.get_sblock("load_q")).writes[0].source.shape)
        warps = rows // WARP_ROWS
        b, hk, qb, s = sch.get_loops("tile")
        sch.bind(sch.fuse(b, hk), "blockIdx.x")
        sch.bind(qb, "blockIdx.y")
        sch.bind(s, "blockIdx.z")
        sch.set_scope("init_scale", 0, "local")
        sch.set_scope("split_range", 0, "local")

        for name in ("load_q", "load_k", "load_v"):
            sch.set_scope(name, 0, "shared.dyn")
            sch.storage_align(name, 0, axis=0, factor=head_dim, offset=8)  # ldmatrix's 8 rows in 8 bank groups
            _copy_to_shared(sch, name, warps, vec)

        # Per-row values in each quad's registers (row_quad_map), as the forward's row_state "registers".
        for name, index in (("init_m", 0), ("row_max", 0), ("alpha", 0), ("alpha", 1), ("row_sum", 0),
                            ("inv_l", 0)):
            sch.set_scope(name, index, "local")
            sch.transform_layout(name, ("write", index), row_quad_map)
        # Tiles of (rows, keys) and the accumulator as mma fragments.
        for name in ("qk", "score", "exp", "cast_p", "init_l", "sum_p", "pv"):
            sch.set_scope(name, 0, "warp")
            sch.transform_layout(name, ("write", 0), _frag_index_map)

        qk = sch.get_sblock("qk")
        _warp_gemm_operands(sch, qk, warps, [("Qt", names["ld_a"]), ("Kt", names["ld_b_trans"])])
        sch.tensorize(sch.get_loops(qk)[-3], names["mma_nt"])
        sch.tensorize(sch.get_loops("qk_init")[-2], names["fill"])
        for name in ("score", "exp", "cast_p", "init_l", "sum_p", "update_l"):
            _fragment_elementwise(sch, name, warps)
        tensorize_row_reduce(sch, "row_max", row_reduce_intrin("max", frag_rows(WARP_ROWS, block_n), "local"),
                             warps, WARP, quad_row_init(sch))
        tensorize_row_reduce(sch, "row_sum", row_reduce_intrin("sum", frag_rows(WARP_ROWS, block_n), "local"),
                             warps, WARP, quad_row_init(sch))

        pv = sch.get_sblock("pv")
        pv_o = _warp_gemm_operands(sch, pv, warps, [("Pc", None), ("Vt", names["ld_b"])])
        for block in (pv_o, pv):
            hide_init_reads(sch, block)
        sch.tensorize(sch.get_loops(pv)[-3], names["mma_nn"])
        _fragment_lanes(sch, "pv_init")  # the rescale
        _fill_fragments(sch, "init_acc", warps, names["fill"])
        _store_fragments(sch, "store_o", warps)

        for name in ("init_m", "alpha", "update_m", "inv_l"):
            quad_row_block(sch, name, warps)
        staged_row_block(sch, "store_lse", warps, lambda sch, name: _row_block(sch, name, warps))
        if num_stages > 1:
            pipeline_loads(sch, num_stages)
    schedule_decode_merge(sch)
    return sch
