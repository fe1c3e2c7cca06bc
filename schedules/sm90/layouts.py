"""Where the sm90 schedule's elements live: the wgmma accumulator's registers, the core-matrix and
swizzled layouts of the tiles in shared memory, and the schedule steps that put a block's tile or
accumulator there, shared by the forward and the backward.

Accumulator registers in TensorIR: a ``local`` buffer is per thread, and CompactBufferAllocation
only drops a thread dimension from it when each access names that thread; a tensorized block's
match_buffer covers all 128 threads, so the thread dimension would stay (a 128x larger array in
local memory). The accumulators are therefore laid out *per thread*: (row, col) -> (warpgroup,
register), dropping the thread index (``acc_index_map``). That map is not injective, which is
sound only because every block that touches an accumulator is bound so that thread t touches
exactly its own elements (``bind_acc_threads``), and the wgmma is warpgroup-collective.
"""

from __future__ import annotations

from tvmflash.lowering.annotations import SWIZZLE_COLUMNS

from ..common import QuadRowLayout

WARPGROUP = 128
CORE_MATRIX_ELEMENTS = 64  # 8 rows x 16 bytes of 16-bit elements
PAD_ELEMENTS = 8  # 16 bytes after each core matrix along a row (``pad_core_matrix_stride``)
WG_ROWS = 64  # rows of one wgmma (the M of m64nNk16)
WARPS_PER_WARPGROUP = 4
SWIZZLE_ALIGNMENT = 1024  # bytes: where a 128-byte-swizzled tile must start (``lowering.tile_alignment.check_tile_alignment``)


def acc_layout(i, j):
    """(row, col) of a 64 x N wgmma accumulator -> (thread of the warpgroup, register).

    PTX ISA 9.7.15.5.1.1.1 (Figure "WGMMA .m64nNk16 register fragment layout for accumulator
    matrix D"; the same as CUTLASS's SM90 CLayout_64xN): warp w = t // 32 holds rows
    [16 w, 16 w + 16); within the warp the layout is mma.sync's m16n8 C fragment repeated
    along N every 8 columns:
        lane = t % 32, row = 16 w + lane // 4 + 8 * ((reg // 2) % 2),
        col = 8 * (reg // 4) + 2 * (lane % 4) + reg % 2.
    Registers d0..d{N/2-1}; d0, d1 are (row, 2q), (row, 2q+1); d2, d3 the same 8 rows lower.
    """
    thread = (i // 16) * 32 + (i % 8) * 4 + (j % 8) // 2
    reg = (j // 8) * 4 + ((i % 16) // 8) * 2 + j % 2
    return thread, reg


def acc_matrix(thread, reg):
    """The inverse of acc_layout: (thread, register) -> (row, col)."""
    row = (thread // 32) * 16 + ((reg // 2) % 2) * 8 + (thread % 32) // 4
    col = (reg // 4) * 8 + (thread % 4) * 2 + reg % 2
    return row, col


def acc_index_map(i, j):
    """Accumulator buffer (rows, cols) -> per-thread registers (warpgroup, register).

    Not injective on purpose: see the module docstring."""
    return (i // WG_ROWS, acc_layout(i % WG_ROWS, j)[1])


def acc_rows(n: int) -> QuadRowLayout:
    """One warpgroup's 64 x n accumulator, per thread (``acc_index_map``: register r of the
    thread), for ``common.row_reduce_intrin``: mma.sync's m16n8 C fragment, warp w = t // 32 on
    rows [16 w, 16 w + 16), repeated along N. Thread t holds rows 16 (t // 32) + (t % 32) // 4
    (h = 0) and that + 8 (h = 1): one 16-row tile; of each 16 columns ct, its registers
    8 ct + 4 half + 2 h + e (columns 16 ct + 8 half + 2 (t % 4) + e)."""
    return QuadRowLayout(
        key=f"wgmma_acc_64x{n}", shape=(n // 2,), scope="local", n_rows=WG_ROWS, n_cols=n,
        threads=WARPGROUP, element=lambda i, j: (acc_layout(i, j)[1],),
        row_tiles=1, col_tiles=n // 16,
        row=lambda t, k: 16 * (t // 32) + 8 * k + (t % 32) // 4,
        row_slot=lambda t, k: (2 * (t // 32) + k, (t % 32) // 4),
        held=lambda t, rt, h, ct, half, e: (8 * ct + 4 * half + 2 * h + e,),
        spread_stores=True,
    )


def core_matrix_map(r, c):
    """Row-major (rows, cols) tile -> "interleaved" wgmma core matrices (r//8, c//8, r%8, c%8).

    A core matrix is 8 rows x 16 bytes, stored as 128 contiguous bytes. In PTX's canonical
    layouts (ISA 9.7.15.5.1.2.1.3, T = 8 elements of 16 bits):
      * K-major, no swizzle ((8,m),(T,2k)):((1T,SBO),(1,LBO)): rows are M/N, cols are K;
        SBO = stride of r//8, LBO = stride of c//8.
      * MN-major, no swizzle ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)): rows are K, cols are N;
        SBO = stride of c//8, LBO = stride of r//8.
    """
    return (r // 8, c // 8, r % 8, c % 8)


# The 128-byte swizzled layout (PTX's canonical K-major / MN-major "128B swizzle" layouts, and what
# TMA writes with CU_TENSOR_MAP_SWIZZLE_128B): a tile is cut into halves of 64 columns (128 bytes of
# 16-bit elements); each half is row-major, a row 128 bytes, and the 16-byte chunk c of row r sits at
# chunk c ^ (r % 8). The descriptor says so with layout type 1; the tile must start on a 1024-byte
# boundary (8 rows, where the pattern repeats).
# The 64-byte swizzle (a head_dim that is no multiple of 64: ``annotations.swizzle_columns``) is the
# same with groups of 32 columns, a row 64 bytes, chunk c of row r at c ^ (r // 2 % 4), layout type 2,
# the pattern repeating every 512 bytes.
def _xor(a, b, bits):
    """a ^ b for a, b in [0, 2 ** bits), in floordiv/floormod arithmetic that TVM's analyzer can bound
    (transform_layout computes the new buffer's shape from it)."""
    return sum(((a // m % 2 + b // m % 2) % 2) * m for m in (1, 2, 4)[:bits])


def swizzled_map(r, c, columns=SWIZZLE_COLUMNS, chunk=8):
    """Row-major (rows, cols) tile -> the swizzled layout of rows of ``columns`` elements (group, r,
    chunk, element), ``chunk`` elements a 16-byte chunk (8 of 16 bits, 4 of float32): 128-byte rows
    (64 16-bit columns, 32 float32) or 64-byte (32 16-bit)."""
    chunks = columns // chunk
    phase = r % 8 if chunks == 8 else r % 8 // (8 // chunks)  # the 128-byte line within 8 rows of 128 bytes
    return (c // columns, r, _xor(c // chunk % chunks, phase, chunks.bit_length() - 1), c % chunk)


def bind_acc_threads(sch, block):
    """Bind the last two loops of ``block`` (64 rows, N cols of one warpgroup's accumulator)
    so that thread t runs exactly the (row, col) it holds (``acc_layout``):
    rows = (warp 4, half 2, r8 8), cols = (c8 N/8, quad 4, pair 2), t = 32 warp + 4 r8 + quad."""
    i, j = sch.get_loops(block)[-2:]
    warp, half, r8 = sch.split(i, [4, 2, 8])
    c8, quad, pair = sch.split(j, [None, 4, 2])
    sch.reorder(warp, r8, quad, c8, half, pair)
    sch.bind(sch.fuse(warp, r8, quad), "threadIdx.x")
    sch.unroll(c8)
    sch.unroll(half)
    sch.unroll(pair)


def split_warpgroups(sch, loop, num_warpgroups):
    """Split a loop over block_m rows into (warpgroup -> threadIdx.y, 64 rows)."""
    wg, rows = sch.split(loop, [num_warpgroups, WG_ROWS])
    sch.bind(wg, "threadIdx.y")
    return rows


def acc_block(sch, name, num_warpgroups):
    """A block over (block_m rows, N cols) of an accumulator, run by the threads that hold them."""
    i = sch.get_loops(name)[-2]
    split_warpgroups(sch, i, num_warpgroups)
    bind_acc_threads(sch, name)


def row_block(sch, name, num_warpgroups):
    """Per-row block: row 64 g + r is run by thread r of warpgroup g (threads 64..127 idle)."""
    i = sch.get_loops(name)[0]
    rows = split_warpgroups(sch, i, num_warpgroups)
    _, tx = sch.split(rows, [None, WARPGROUP])  # 64 rows on 128 threads: a predicate
    sch.bind(tx, "threadIdx.x")


def _copy_along_rows(sch, block, num_warpgroups, vec):
    """Global -> shared copy of a tile, 16 bytes a thread, threads along the rows: each 8 threads
    (one phase of a 16-byte access) copy 128 contiguous bytes of a row, so every 32-byte sector
    they read is whole. In shared memory those 8 pieces land on 8 different groups of 4 banks:
    one per core matrix, spread by ``pad_core_matrix_stride``, or 8 chunks of one swizzled row
    (``swizzled_map``)."""
    r, c = sch.get_loops(block)[-2:]
    c_hi, v = sch.split(c, [None, vec])
    fused = sch.fuse(r, c_hi)
    _, ty, tx = sch.split(fused, [None, num_warpgroups, WARPGROUP])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(v)


def pad_core_matrix_stride(sch, block):
    """Core matrices along a row 144 bytes apart instead of 128 (16 bytes of padding each): the
    8 pieces of 16 bytes that 8 threads copy from one row (``_copy_along_rows``) then land
    in 8 different groups of 4 banks. Unpadded they all hit the same 4 banks, and in the
    copy-friendly order before (8 rows of one core matrix) each phase read 8 half-used sectors:
    on the H200 the cp.async tile copies moved twice the L2 sectors and 8x the shared-memory
    wavefronts they need (as ncu counts them). The stride is the descriptor's LBO (K-major: Q, K) or
    SBO (N-major: V), read from the buffer, so wgmma follows; a core matrix stays 128 contiguous
    bytes. Costs 1/8 more shared memory (``knobs.shared_memory_bytes``)."""
    sch.storage_align(block, 0, axis=1, factor=CORE_MATRIX_ELEMENTS, offset=PAD_ELEMENTS)


def tile_in_shared_memory(sch, name, num_warpgroups, vec, swizzled, columns=SWIZZLE_COLUMNS):
    """The tile that block ``name`` writes, in dynamic shared memory as wgmma reads it: swizzled in rows
    of ``columns`` (``swizzled_map``, as TMA writes it) or in padded core matrices; copied along its rows."""
    sch.set_scope(name, 0, "shared.dyn")
    if swizzled:
        sch.transform_layout(name, ("write", 0), lambda r, c: swizzled_map(r, c, columns),
                             assume_injective_transform=True)
    else:
        sch.transform_layout(name, ("write", 0), core_matrix_map)
        pad_core_matrix_stride(sch, name)
    _copy_along_rows(sch, name, num_warpgroups, vec)


# ---- FP8 (e4m3) ------------------------------------------------------------------------------------
# e4m3 wgmma (m64nNk32) reads A from registers in its own layout: thread 4 r8 + q of warp w holds, of
# each k32 slice, rows 16 w + r8 (+ 8) and columns 4 q .. 4 q + 3 and 16 + 4 q .. 16 + 4 q + 3
# (``fp8_a_index``), where the accumulator of S = Q K^T gives it columns 2 q, 2 q + 1 of each 8. So
# the K tile's rows are permuted in shared memory (``fp8_key_row``): S's accumulator column r then
# holds a key that the same thread holds in P's A fragment, P is cast in place (no shuffle), and V,
# K-major in keys, stays in the keys' order. The softmax blocks see S in that permuted layout
# (``fp8_acc_index_map``, ``bind_fp8_acc_threads``, ``fp8_acc_rows``).
FP8_CHUNK = 16  # e4m3 elements in 16 bytes: a core matrix's row, a copy's vector
FP8_CORE_MATRIX_ELEMENTS = 128  # 8 rows of 16 bytes


def fp8_key_row(j):
    """Key j of a K tile -> its row in shared memory, the column of S's accumulator that holds it: of
    each 32 keys, j = 16 a + 4 q + 2 c + e goes to row 8 (2 a + c) + 2 q + e, which thread quad q holds
    (``acc_layout``) and P's A fragment wants at thread quad q."""
    a, q, c, e = j % 32 // 16, j % 16 // 4, j % 4 // 2, j % 2
    return j // 32 * 32 + 8 * (2 * a + c) + 2 * q + e


def fp8_acc_index_map(i, j):
    """S's accumulator (block_m rows, keys) -> per-thread registers (warpgroup, register), key j at
    accumulator column ``fp8_key_row(j)``. Not injective on purpose, as ``acc_index_map``."""
    return (i // WG_ROWS, acc_layout(i % WG_ROWS, fp8_key_row(j))[1])


def fp8_a_index(i, j):
    """P (64 rows, keys) -> register of e4m3 wgmma's A fragment (PTX ISA "WGMMA .m64nNk32 register
    fragment layout for matrix A"): of the k32 slice j // 32, element 4 r + b of the thread's four
    32-bit registers r holds row 8 (r % 2) + its row, column 16 (r // 2) + 4 q + b."""
    return j // 32 * 16 + 8 * (j % 32 // 16) + 4 * (i % 16 // 8) + j % 4


def fp8_p_index_map(i, j):
    """P in e4m3 (block_m rows, keys) -> per-thread registers (warpgroup, ``fp8_a_index``)."""
    return (i // WG_ROWS, fp8_a_index(i % WG_ROWS, j))


def bind_fp8_acc_threads(sch, block):
    """``bind_acc_threads`` for S's permuted layout (``fp8_key_row``): thread 32 warp + 4 r8 + q runs
    the keys 16 a + 4 q + 2 c + e of its rows."""
    i, j = sch.get_loops(block)[-2:]
    warp, half, r8 = sch.split(i, [4, 2, 8])
    a, quad, c, e = sch.split(j, [None, 4, 2, 2])
    sch.reorder(warp, r8, quad, a, c, half, e)
    sch.bind(sch.fuse(warp, r8, quad), "threadIdx.x")
    for loop in (a, c, half, e):
        sch.unroll(loop)


def fp8_acc_block(sch, name, num_warpgroups):
    """``acc_block`` for a block over S's permuted layout."""
    i = sch.get_loops(name)[-2]
    split_warpgroups(sch, i, num_warpgroups)
    bind_fp8_acc_threads(sch, name)


def fp8_acc_rows(n: int) -> QuadRowLayout:
    """``acc_rows`` of S's permuted layout: the same registers a thread, key j at column ``fp8_key_row(j)``."""
    rows = acc_rows(n)
    return QuadRowLayout(
        key=f"wgmma_fp8_acc_64x{n}", shape=rows.shape, scope=rows.scope, n_rows=rows.n_rows, n_cols=n,
        threads=rows.threads, element=lambda i, j: (acc_layout(i, fp8_key_row(j))[1],), row_tiles=rows.row_tiles,
        col_tiles=rows.col_tiles, row=rows.row, row_slot=rows.row_slot, held=rows.held,
        spread_stores=rows.spread_stores)


def fp8_core_matrix_map(r, c):
    """Row-major (rows, cols) e4m3 tile -> core matrices of 8 rows x 16 bytes (r//8, c//16, r%8, c%16),
    K-major: the columns are the reduction's (``core_matrix_map``'s with 1-byte elements)."""
    return (r // 8, c // FP8_CHUNK, r % 8, c % FP8_CHUNK)


def fp8_tile_in_shared_memory(sch, name, num_warpgroups, layout, transposed=False, vec=FP8_CHUNK):
    """The e4m3 tile that block ``name`` (loops: rows, cols) writes, in padded core matrices
    (``layout(r, c)``, K-major), copied along its rows 16 bytes a thread; ``transposed``: the block's
    loops are (keys, head_dim) of a tile read from a transposed tensor (V), so its copy runs along the
    keys and the tile is K-major in the keys. ``vec``: elements a thread's copy moves (16 bytes, or 4
    where the copy is no cp.async: CUDA code generation broadcasts e4m3 zeros to 4 lanes at most)."""
    sch.set_scope(name, 0, "shared.dyn")
    if transposed:
        sch.transform_layout(name, ("write", 0), lambda j, d: fp8_core_matrix_map(d, j))
        j, d = sch.get_loops(name)[-2:]
        sch.reorder(d, j)
    else:
        sch.transform_layout(name, ("write", 0), layout)
    # core matrices 16 bytes apart along a row, as ``pad_core_matrix_stride``
    sch.storage_align(name, 0, axis=1, factor=FP8_CORE_MATRIX_ELEMENTS, offset=FP8_CHUNK)
    _copy_along_rows(sch, name, num_warpgroups, vec)
