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
from .packing import pack_rows, pack_transposed

# Per program: the products along head_dim and their right operands (packed transposed), then the
# products over the tile's rows and theirs (packed by rows).
PRODUCTS = {
    "dkdv": ((("qk", "Qt"), ("dp", "dOt")), (("dv", "dOt"), ("dk", "Qt"))),
    "dq": ((("qk", "Kt"), ("dp", "Vt")), (("dq", "Kt"),)),
}


def schedule_backward(sch: tvm.s_tir.Schedule, *, block_m: int, block_n: int, vector: int) -> tvm.s_tir.Schedule:
    """Map the backward programs (delta, dkdv, dq) onto a CPU with AMX: delta as the CPU schedule's; one
    task per dkdv and dq tile, the products on the tiles, the rest vectorised."""
    cpu.schedule_delta(sch)
    for func, (transposed, rows) in PRODUCTS.items():
        sch.work_on(func)
        cpu.backward_tiles(sch, func)
        for product, operand in transposed:
            pack_transposed(sch, product, operand)
        for product, operand in rows:
            pack_rows(sch, product, operand)
        for product, _ in transposed + rows:
            tile_product(sch, product, vector)
        cpu.vectorize_backward_rows(sch, func, vector)
    return sch
