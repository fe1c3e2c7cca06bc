"""What the sm80 forward, backward and decode share: tiles of one warp held as mma fragments
(``frag_index_map``, ``frag_rows``), GEMMs cut into mma tiles with ldmatrix operands
(``warp_gemm_operands``), the blocks that work on fragments lane by lane, and the copies into
shared memory."""

from __future__ import annotations

from ..common import QuadRowLayout, read_index
from .intrinsics import ldmatrix_layout
from .knobs import WARP


def frag_index_map(i, j):
    """(row, col) of a matrix -> (row tile, col tile, lane, register) of its mma fragments."""
    lane, reg = ldmatrix_layout(i % 16, j % 16)
    return (i // 16, j // 16, lane, reg)


def frag_rows(n_rows: int, n_cols: int) -> QuadRowLayout:
    """An n_rows x n_cols tile of one warp held as mma fragments ("warp" scope, the layout of
    ``frag_index_map``), for ``common.row_reduce_intrin``: lane l holds rows l // 4 and
    l // 4 + 8 of each 16-row tile rt; row 16 rt + 8 h + l // 4 is its k-th row for k = 2 rt + h
    (slot (k, l // 4) of ``row_quad_map``), in registers 4 half + 2 h + e of every 16-column
    tile."""
    return QuadRowLayout(
        key=f"mma_{n_rows}x{n_cols}", shape=(n_rows // 16, n_cols // 16, WARP, 8), scope="warp",
        n_rows=n_rows, n_cols=n_cols, threads=WARP, element=frag_index_map,
        row_tiles=n_rows // 16, col_tiles=n_cols // 16,
        row=lambda lane, k: 8 * k + lane // 4,
        row_slot=lambda lane, k: (k, lane // 4),
        held=lambda lane, rt, h, ct, half, e: (rt, ct, lane, 4 * half + 2 * h + e),
    )


def copy_to_shared(sch, block, num_warps, vec):
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


def warp_gemm_operands(sch, block, num_warps, operands):
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
        sch.transform_layout(fragment, ("write", 0), frag_index_map)
        sch.tensorize(loop, intrin)
    return outer


def fragment_elementwise(sch, name, num_warps):
    """An elementwise (rows, cols) block over mma fragments: each lane visits the elements it
    holds, in the order (row tile, col tile, register)."""
    sch.transform_block_layout(name, lambda i, j: frag_index_map(i, j))
    a0, a1, lane, reg = sch.get_loops(name)[-4:]
    w, a0 = sch.split(a0, [num_warps, None])
    sch.reorder(w, lane, a0, a1, reg)
    sch.bind(w, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")


def fragment_lanes(sch, name):
    """A block over one 16x16 tile of mma fragments (a GEMM's init, after decompose_reduction),
    iterated as (lane, register), the lanes on threadIdx.x."""
    sch.transform_block_layout(name, lambda i, d: ldmatrix_layout(i, d))
    lane, reg = sch.get_loops(name)[-2:]
    sch.bind(lane, "threadIdx.x")


def fill_fragments(sch, name, num_warps, fill):
    """A (rows, cols) init block on mma fragments: 16x16 tiles filled by the ``fill`` intrinsic,
    each warp its rows."""
    i, d = sch.get_loops(name)
    i0, i1 = sch.split(i, [None, 16])
    d0, d1 = sch.split(d, [None, 16])
    sch.reorder(i0, d0, i1, d1)
    iw, im = sch.split(i0, [num_warps, None])
    sch.bind(iw, "threadIdx.y")
    sch.tensorize(i1, fill)


def store_fragments(sch, name, num_warps, vector=True):  # name: a block's name, or the block
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


def row_block(sch, name, num_warps):
    """Per-row block: row i = 32 w + lane (one lane per row)."""
    i = sch.fuse(*sch.get_loops(name))
    w, r = sch.split(i, [num_warps, None])
    sch.bind(w, "threadIdx.y")
    r0, r1 = sch.split(r, [None, WARP])
    sch.bind(r1, "threadIdx.x")
    return r0

