"""``DoubleBuffers``: a shared-memory tile that each step of a loop writes and then reads, held in two
buffers that the steps take in turn, so that one block-wide barrier a step is enough where ThreadSync
placed two.

A schedule asks for it by annotating the loop that writes the tile with ``DOUBLE_BUFFERED_PRAGMA``
(sm90's dkdv with ``ds_buffers`` 2: the dsᵀ tile that dq's share reads). A use of the tile is its
writes, a barrier (ThreadSync's: every thread's writes before any read), and its reads, in one
sequence of statements; ThreadSync also puts a barrier before the writes, because the previous use's
reads (other threads') must end before this use overwrites them. With two buffers the writes of use
k + 1 go where use k - 1 was read, and every thread finished those reads before it reached use k's
barrier, which every writer of use k + 1 passed: the barrier before the writes is not needed, and
this pass drops it; where ThreadSync put none there (an earlier barrier of the step orders the writes,
as with plain loads), there is nothing to drop and the tile stays in one buffer. (The tile's readers
must have finished their reads when they reach the next use's barrier: wgmma's reads are waited
for, ``wgmma.wait_group``, before it.)

Which buffer a use takes is a per-thread counter in a register, flipped after each use's last read,
so that the copies of a step that InjectSoftwarePipeline writes (its epilogue) need no index
arithmetic. Runs after ThreadSync and before shared-memory merging (which sizes the allocation).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.script import tirx as T

from tvmflash.lowering.annotations import DOUBLE_BUFFERED_PRAGMA
from tvmflash.lowering.ir import (CALL, LOAD, find, find_attrs, is_attr, is_barrier, is_call, is_load, loaded,
                                  prim_func_pass, unmarked, with_children)


def _points_into(node, tile) -> bool:
    """Is ``node`` a ``tvm_access_ptr`` into ``tile`` (a wgmma descriptor's operand)?"""
    return is_call(node, "tirx.tvm_access_ptr") and any(
        node.args[1].same_as(x) or tvm_ffi.structural_equal(node.args[1], x) for x in (tile, tile.data))


def _touches(stmt, tile) -> bool:
    """Does ``stmt`` read or write the buffer of ``tile`` (a load, a store, or an access pointer)?"""
    def uses(n):
        if isinstance(n, tirx.BufferStore):
            return n.buffer.same_as(tile)
        if is_load(n):
            return loaded(n).same_as(tile)
        return _points_into(n, tile)
    return bool(find(stmt, (tirx.BufferStore, LOAD, CALL), uses))


def _leading_barrier(stmts, i) -> str | None:
    """Where ThreadSync put the barrier before the marked writes ``stmts[i]``: "before" them, "inside"
    the mark (first), or None (none: an earlier barrier of the step orders them, as with plain loads)."""
    if i and is_barrier(stmts[i - 1]):
        return "before"
    first = stmts[i].body.seq[0] if isinstance(stmts[i].body, tirx.SeqStmt) else stmts[i].body
    return "inside" if is_barrier(first) else None


def _without_leading_barrier(writes):
    seq = list(writes.seq)[1:]
    return seq[0] if len(seq) == 1 else tirx.SeqStmt(seq)


def _uses_in_turn(seq, tile, parity):
    """The sequence that holds the marked writes, with each use of the tile (its writes, up to the last
    statement that touches the tile before the next writes) followed by the parity's flip, the barrier
    right before each use's writes dropped (module docstring), and the marks gone."""
    stmts = list(seq.seq)
    starts = [i for i, s in enumerate(stmts) if is_attr(s, DOUBLE_BUFFERED_PRAGMA)]
    touching = [i for i, s in enumerate(stmts) if _touches(s, tile)]
    if touching[0] != starts[0]:
        raise RuntimeError("DoubleBuffers: the double-buffered tile is touched before its writes")
    ends = [max(i for i in touching if i < nxt) for nxt in starts[1:]] + [touching[-1]]
    flip = tirx.BufferStore(parity, 1 - tirx.BufferLoad(parity, [0]), [0])
    out = []
    for i, stmt in enumerate(stmts):
        if i + 1 in starts and _leading_barrier(stmts, i + 1) == "before":
            continue  # the barrier before a use's writes (module docstring)
        if i in starts:
            stmt = _without_leading_barrier(stmt.body) if _leading_barrier(stmts, i) == "inside" else stmt.body
        out.append(stmt)
        if i in ends:
            out.append(flip)
    return tirx.SeqStmt(out)


def double_buffered(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with its marked tile in two buffers taken in turn (module docstring); unchanged if it
    has none."""
    marks = find_attrs(func.body, DOUBLE_BUFFERED_PRAGMA)
    if not marks:
        return func
    sequences = find(func.body, tirx.SeqStmt, lambda n: any(
        is_attr(s, DOUBLE_BUFFERED_PRAGMA) for s in n.seq))
    if not all(_leading_barrier(list(seq.seq), i) for seq in sequences for i, s in enumerate(seq.seq)
               if is_attr(s, DOUBLE_BUFFERED_PRAGMA)):  # nothing to drop: one buffer, as it is
        return func.with_body(unmarked(func.body, DOUBLE_BUFFERED_PRAGMA))
    tiles = {s.buffer.name: s.buffer for m in marks for s in find(m.body, tirx.BufferStore)}
    if len(tiles) != 1:
        raise RuntimeError(f"DoubleBuffers: the marked loops write {len(tiles)} buffers, not one")
    tile = next(iter(tiles.values()))  # TVM 0.27: a buffer is a variable
    size = int(tile.shape[0])  # flattened
    doubled = tirx.decl_buffer((2 * size,), tile.dtype, tile.name, scope=tile.scope())
    parity = tirx.decl_buffer((1,), "int32", "tile_parity", scope="local")
    offset = tirx.BufferLoad(parity, [0]) * size

    def rewrite(stmt):
        if not isinstance(stmt, tirx.SeqStmt):
            return with_children(stmt, rewrite)
        if any(is_attr(s, DOUBLE_BUFFERED_PRAGMA) for s in stmt.seq):
            return _uses_in_turn(stmt, tile, parity)
        out = []
        for s in stmt.seq:
            if isinstance(s, tirx.AllocBuffer) and s.buffer.same_as(tile):
                out += [tirx.AllocBuffer(doubled, s.annotations), tirx.AllocBuffer(parity),
                        tirx.BufferStore(parity, tirx.const(0, "int32"), [0])]
            else:
                out.append(rewrite(s))
        return tirx.SeqStmt(out)

    def shifted_store(node):  # every access to the tile, in the buffer of this use
        if node.buffer.same_as(tile):
            return tirx.BufferStore(doubled, node.value, [node.indices[0] + offset])
        return node

    def shifted_load(node):
        if loaded(node).same_as(tile):
            return tirx.BufferLoad(doubled, [node.indices[0] + offset])
        return node

    def shifted_pointer(node):
        if _points_into(node, tile):
            kind, _, start, extent, mask = node.args
            return T.tvm_access_ptr(kind, doubled.data, start + offset, extent, mask)
        return node

    body = rewrite(func.body)
    if find_attrs(body, DOUBLE_BUFFERED_PRAGMA):
        raise RuntimeError("DoubleBuffers: a marked loop outside the sequence that uses the tile")
    body = tvm_ffi.structural_map(body, [(tirx.BufferStore, shifted_store), (tvm.ir.expr.TensorLoad, shifted_load),
                                         (tvm.ir.expr.Call, shifted_pointer)])
    return func.with_body(body)


def DoubleBuffers():  # noqa: N802
    """After ``ThreadSync("shared.dyn")``: ``double_buffered``."""
    return prim_func_pass(double_buffered, "tvmflash.DoubleBuffers")
