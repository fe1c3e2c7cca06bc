"""The AMX forward: the CPU schedule's tasks and vectorised loops, with QKᵀ and PV as blocks of 32 rows
of tile products (``intrinsics.dot_intrin``)."""

from __future__ import annotations

import tvm

from .. import common, cpu
from .intrinsics import BLOCK, dot_intrin
from .packing import pack_k, pack_v
from .rows import tensorize_row


def schedule(sch: tvm.s_tir.Schedule, *, block_m: int, block_n: int, vector: int) -> tvm.s_tir.Schedule:
    """Map the attention program onto a CPU with AMX: one task per (batch, head, Q block) as the CPU
    schedule's; the two products on the tiles, the rest vectorised."""
    tile = sch.get_sblock("tile")
    sch.parallel(sch.fuse(*sch.get_loops(tile)))
    pack_k(sch, vector)
    pack_v(sch)
    for name in ("load_q", "init_acc", "store_o", "score", "exp", "cast_p"):
        cpu.vectorize_inner(sch, name, vector)
    tile_product(sch, "qk", vector)
    tile_product(sch, "pv", vector)
    tensorize_row(sch, "row_max", "max")
    tensorize_row(sch, "row_sum", "sum")
    return sch


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
