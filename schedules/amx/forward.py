"""The AMX forward: the CPU schedule's tasks and vectorised loops, with QKᵀ and PV as blocks of 32 rows
of tile products (``intrinsics.dot_intrin``)."""

from __future__ import annotations

import tvm

from .. import common, cpu
from .intrinsics import BLOCK, dot_intrin
from .rows import tensorize_row

# The right operands (Kᵀ for QKᵀ, V for PV) in AMX's pair-interleaved layout: (k // 2, n, k % 2).
VNNI = {"load_k": lambda j, d: (d // 2, j, d % 2), "load_v": lambda j, d: (j // 2, d, j % 2)}


def schedule(sch: tvm.s_tir.Schedule, *, block_m: int, block_n: int, vector: int) -> tvm.s_tir.Schedule:
    """Map the attention program onto a CPU with AMX: one task per (batch, head, Q block) as the CPU
    schedule's; the two products on the tiles, the rest vectorised."""
    tile = sch.get_sblock("tile")
    sch.parallel(sch.fuse(*sch.get_loops(tile)))
    for load, layout in VNNI.items():
        sch.transform_layout(load, ("write", 0), layout)
    for load in VNNI:
        pack_pairs(sch, load)
    for name in ("load_q", "init_acc", "store_o", "score", "exp", "cast_p"):
        cpu.vectorize_inner(sch, name, vector)
    tile_product(sch, "qk", vector)
    tile_product(sch, "pv", vector)
    tensorize_row(sch, "row_max", "max")
    tensorize_row(sch, "row_sum", "sum")
    return sch


def pack_pairs(sch, block_name):
    """A load into the pair-interleaved layout in runs of 16 unrolled pairs of stores to consecutive
    addresses, which LLVM's SLP vectorizer packs (V: two rows interleaved; K: 16 keys' pairs, each
    pair one 32-bit move)."""
    j, d = sch.get_loops(block_name)[-2:]
    if block_name == "load_v":  # Vt[j // 2, d, j % 2]
        pairs, pair = sch.split(j, [None, 2])
        outer, run = sch.split(d, [None, 16])
        sch.reorder(pairs, outer, run, pair)
    else:  # Kt[d // 2, j, d % 2]
        pairs, pair = sch.split(d, [None, 2])
        outer, run = sch.split(j, [None, 16])
        sch.reorder(pairs, outer, run, pair)
    sch.unroll(run)
    sch.unroll(pair)


def tile_product(sch, block_name, vector):
    """A (rows, cols, reduction) block as tile products, 32 rows by all the columns a call (over the
    whole reduction); its init (QKᵀ's zero, PV's rescale) a vectorised block of its own before each."""
    i, n, k = sch.get_loops(block_name)[-3:]
    cols, reduction = (int(sch.get(loop).extent) for loop in (n, k))
    _, rows = sch.split(i, [None, BLOCK])
    init = sch.decompose_reduction(block_name, rows)
    cpu.vectorize_inner(sch, init, vector)
    common.hide_init_reads(sch, sch.get_sblock(f"{block_name}_update"))
    sch.tensorize(rows, dot_intrin(reduction, cols))
