"""The AMX backward: the CPU schedule's tasks and vectorised loops (``cpu.schedule_backward``), with the
products of dkdv (sᵀ = k qᵀ, dpᵀ = v doutᵀ, dv += pᵀ dout, dk += dsᵀ q) and dq (s = q kᵀ, dp = dout vᵀ,
dq += ds k) as blocks of 32 rows of tile products (``forward.tile_product``).

Each product's right operand is a copy of its own in AMX's pair layout (``packing``): where the product
runs along head_dim (sᵀ, dpᵀ, s, dp) the transpose's pairs (``pack_transposed``), where it sums over the
tile's rows (dv, dk, dq) the rows interleaved in pairs (``pack_rows``). Its left operands (K, V, pᵀ, dsᵀ,
q, dout, ds) are read as they are stored."""

from __future__ import annotations

import tvm

from .. import cpu
from .forward import tile_product
from .packing import copy_transposed, pack_rows, pack_transposed

# Per program: the products along head_dim and their right operands (packed transposed), then the
# products over the tile's rows and theirs (packed by rows).
PRODUCTS = {
    "dkdv": ((("qk", "Qt"), ("dp", "dOt")), (("dv", "dOt"), ("dk", "Qt"))),
    "dq": ((("qk", "Kt"), ("dp", "Vt")), (("dq", "Kt"),)),
}


def schedule_backward(sch: tvm.s_tir.Schedule, *, block_m: int, block_n: int, vector: int,
                      dq_atomic: bool = False) -> tvm.s_tir.Schedule:
    """Map the backward programs (delta, dkdv, dq) onto a CPU with AMX: delta as the CPU schedule's; one
    task per dkdv and dq tile, the products on the tiles, the rest vectorised. ``dq_atomic``: no dq
    program; dkdv also makes dq's share, ds k (its left operand dsᵀ copied transposed, as a tile product
    reads rows), and adds it, in the CPU schedule's tasks (``cpu.backward_tiles``)."""
    cpu.schedule_delta(sch)
    for func in ("dkdv",) + (("convert_dq",) if dq_atomic else ("dq",)):
        sch.work_on(func)
        if func == "convert_dq":
            cpu.schedule_convert_dq(sch, vector)
            continue
        cpu.backward_tiles(sch, func)
        transposed, rows = PRODUCTS[func]
        if func == "dkdv" and dq_atomic:
            rows = rows + (("dq", "Kt"),)
            copy_transposed(sch, "dq", "dSc")
        for product, operand in transposed:
            pack_transposed(sch, product, operand)
        for product, operand in rows:
            pack_rows(sch, product, operand)
        for product, _ in transposed + rows:
            tile_product(sch, product, vector)
        cpu.vectorize_backward_rows(sch, func, vector)
        if func == "dkdv" and dq_atomic:
            cpu.vectorize_inner(sch, "accumulate_dq", vector)
    return sch
