"""The host side of the TMA lowering: one tensor map per global tensor that a kernel copies from (or,
dkdv's dq_accum, adds into) by TMA, encoded before the launch, reaching the kernel as a ``__grid_constant__`` parameter."""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

SWIZZLE_64B, SWIZZLE_128B, L2_PROMOTION_128B = 2, 3, 2  # CUtensorMapSwizzle, CUtensorMapL2promotion
_TMA_SWIZZLES = {128: SWIZZLE_128B, 64: SWIZZLE_64B}  # by a swizzled row's bytes


def encode_tensor_maps(plan):
    """Host statements: one tensor map per global tensor, over its (a swizzled row's elements, row,
    column group, head, batch) view, the box one tile (columns, rows, groups, 1, 1), in the swizzle of
    rows of that many bytes (128 or 64: 64 or 32 16-bit columns, 32 float32); a row vector's
    (``tma_plan._row_vector_copy``) over its (row, head, batch) view, the box (rows, 1, 1), no
    swizzle. The strides are the buffer's (the program's stride arguments), in bytes; TMA needs them
    multiples of 16 bytes."""
    stmts = []
    for buffer, (var, box) in plan.tensor_maps.items():
        element = buffer.dtype.bits // 8
        strides = list(buffer.strides) or [math.prod(buffer.shape[i + 1:]) for i in range(len(buffer.shape))]
        in_bytes = [tirx.Cast("int64", stride) * element for stride in strides]  # a stride may pass 2**31 bytes
        if len(buffer.shape) == 3:  # (batch, heads, seqlen) -> (row, head, batch)
            batch, heads, seqlen = buffer.shape
            dims, byte_strides, swizzle = [seqlen, heads, batch], [in_bytes[1], in_bytes[0]], 0
        else:  # (batch, seqlen, heads, head_dim) -> (columns, row, column group, head, batch)
            batch, seqlen, heads, head_dim = buffer.shape
            columns = box[0]  # a swizzled row: 128 bytes (64 16-bit columns, 32 float32) or 64
            dims = [columns, seqlen, head_dim // columns, heads, batch]
            byte_strides, swizzle = [in_bytes[1], columns * element, in_bytes[2], in_bytes[0]], _TMA_SWIZZLES[columns * element]
        rank = len(dims)
        stmts.append(tirx.Bind(var, T.tvm_stack_alloca("tensormap", 1)))
        stmts.append(tirx.Evaluate(T.tensormap_encode_tiled(
            var, buffer.data, *dims, *byte_strides, *box, *[1] * (rank - len(box)), *[1] * rank,
            descriptor_dtype=str(buffer.dtype), rank=rank, swizzle=swizzle, l2_promotion=L2_PROMOTION_128B)))
    return stmts
