"""Helpers shared by the schedules."""

from __future__ import annotations

import tvm


def element_bytes(sch: tvm.s_tir.Schedule, block_name: str) -> int:
    """Bytes per element of the buffer a block writes (the program's dtype, for the load blocks)."""
    written = sch.get(sch.get_sblock(block_name)).writes[0].source
    return tvm.DataType(str(written.dtype)).bits // 8


def bind_grid(sch: tvm.s_tir.Schedule) -> None:
    """One thread block per tile: (batch, head, Q block) -> blockIdx.(z, y, x)."""
    b, h, qb = sch.get_loops("tile")
    sch.bind(qb, "blockIdx.x")
    sch.bind(h, "blockIdx.y")
    sch.bind(b, "blockIdx.z")
