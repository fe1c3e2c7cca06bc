"""Rows added into global memory by one TMA reduction a warpgroup (``annotations.TMA_REDUCE_PRAGMA``):
sm90 dkdv's share of dq (``dq_reduce="tma"``), FA3's way.

The schedule lays the shared-memory tile out as TMA reads it (float32 rows of 128 bytes in the
128-byte swizzle, ``schedules.sm90.layouts.swizzled_map`` with 32 columns of 4-element chunks: the
threads' stores of pairs from the accumulator layout meet no bank twice) and annotates the loop over
the warpgroup's rows that adds it into the global tensor. Here, within the TMA lowering (whose plan
encodes the tensor maps on the host), that loop becomes: every thread's ``fence.proxy.async`` (its
stores visible to the copy engine), the warpgroup's named barrier, then thread 0 of the warpgroup
issues one ``cp.reduce.async.bulk.tensor`` of the whole tile, the box (32 columns, rows, column
groups) of the global tensor's tensor map, and commits it to its bulk group. The waits before the
tile is written again and before the block ends are ``BULK_REDUCE_WAIT_PRAGMA``'s
(``pragmas.LowerPragmas``)."""

from __future__ import annotations

import tvm
import tvm.sym
from tvm import tirx
from tvm.script import tirx as T

from tvmflash.lowering.annotations import BULK_REDUCE_BARRIER, TMA_REDUCE_PRAGMA
from tvmflash.lowering.ir import find, is_load, loaded, substitute, transform
from tvmflash.lowering.tma_device_functions import device_statement, untracked_pointer
from tvmflash.lowering.tma_plan import flat_index

ROW_COLUMNS = 32  # float32 columns of a 128-byte swizzled row
CHUNK = 4  # float32 elements of a 16-byte chunk


def _swizzled_offset(row, column, rows):
    """Where element (row, column) of a tile of ``rows`` rows sits in TMA's 128-byte swizzle of float32."""
    group, chunk = column // ROW_COLUMNS, column % ROW_COLUMNS // CHUNK
    return ((group * rows + row) * (ROW_COLUMNS // CHUNK) + (chunk ^ (row % 8))) * CHUNK + column % CHUNK


def _refused(loop, why):
    return ValueError(f"{TMA_REDUCE_PRAGMA}: {why}; expected a loop over rows, in it one over a row's columns, "
                      f"in it one store x[...] = x[...] + tile[...] of float32, got {loop}")


def _reduction(plan, loop):
    """The statements that replace one annotated loop (module docstring)."""
    stores = find(loop, tirx.BufferStore)
    loops = [loop, *find(loop.body, tirx.For)]
    if len(stores) != 1 or len(loops) != 2:
        raise _refused(loop, f"{len(stores)} stores in {len(loops)} loops")
    store, (rows, columns) = stores[0], loops
    value = store.value
    if not (isinstance(value, tirx.Add) and is_load(value.a) and loaded(value.a).same_as(store.buffer)
            and is_load(value.b) and str(store.buffer.dtype) == "float32" and len(store.buffer.shape) == 4):
        raise _refused(loop, "not an addition of a tile into a 4-D float32 tensor")
    tile_load, n_rows, n_columns = value.b, int(rows.extent), int(columns.extent)
    tile = loaded(tile_load)
    if (len(tile.shape) != 4 or [int(e) for e in tile.shape[1:]] != [n_rows, ROW_COLUMNS // CHUNK, CHUNK]
            or n_columns % ROW_COLUMNS):
        raise _refused(loop, f"the tile {tile.name} {list(tile.shape)} is not (groups, {n_rows}, 8, 4), TMA's "
                             f"128-byte swizzle of float32 rows, or {n_columns} columns no multiple of {ROW_COLUMNS}")
    x, y = plan.threads["threadIdx.x"][0], plan.threads["threadIdx.y"][0]
    analyzer = tvm.sym.Analyzer()

    def at(i, c, exprs):
        return [analyzer.simplify(substitute(e, [(rows.loop_var, rows.min + i), (columns.loop_var, columns.min + c),
                                                 (x, tirx.const(0, "int32"))])) for e in exprs]

    batch, row, head, column = at(0, 0, store.indices)
    origin = flat_index(tile, at(0, 0, tile_load.indices))
    if not analyzer.can_prove_equal(column % ROW_COLUMNS, 0):
        raise _refused(loop, f"the rows start at column {column}, not on a {ROW_COLUMNS}-column group")
    for i, c in ((1, 0), (0, 1), (5, 13), (n_rows - 1, n_columns - 1)):  # the tensor's rows and columns in order,
        b, r, h, col = at(i, c, store.indices)  # the tile's in TMA's swizzle
        here = at(i, c, [flat_index(tile, tile_load.indices) - origin])[0]
        if not all(analyzer.can_prove_equal(a, e) for a, e in ((b, batch), (h, head), (r, row + i), (col, column + c),
                                                              (here, _swizzled_offset(i, c, n_rows)))):
            raise _refused(loop, f"element ({i}, {c}) is not where a tile of rows in TMA's swizzle puts it")
    tensor_map = plan.tensor_map(store.buffer, (ROW_COLUMNS, n_rows, n_columns // ROW_COLUMNS))
    issue = tirx.SeqStmt([
        device_statement("tvmflash_tma_reduce_add_5d", untracked_pointer(tile, origin), T.address_of(tensor_map),
                         column % ROW_COLUMNS, row, column // ROW_COLUMNS, head, batch),
        device_statement("tvmflash_bulk_commit")])
    threads = int(loop.annotations[TMA_REDUCE_PRAGMA])
    return tirx.SeqStmt([device_statement("tvmflash_fence_proxy_async"),
                         device_statement("tvmflash_named_barrier", BULK_REDUCE_BARRIER + y, threads),
                         tirx.IfThenElse(x == 0, issue, None)])


def reductions_on_tma(plan, body):
    """``body`` with each loop annotated ``TMA_REDUCE_PRAGMA`` replaced by its TMA reduction."""
    return transform(body, tirx.For, lambda n: _reduction(plan, n) if TMA_REDUCE_PRAGMA in n.annotations else None)

