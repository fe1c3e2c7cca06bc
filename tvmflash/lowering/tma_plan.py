"""What the TMA lowering of one kernel works from (``Plan``): its thread variables, its mbarriers and
counters, a tensor map per global tensor copied from, and each annotated copy block read as one TMA
copy (``tile_copy``). Also what both the pipeline's rewrite (``tma_copies``) and the producer
warpgroup's split (``tma_producer_warpgroup``) use: the mark on each issue, the Q tile's fence, and
whether a statement reads the tiles."""

from __future__ import annotations

import tvm
import tvm.sym
from tvm import tirx
from tvm.script import tirx as T

from tvmflash.lowering.annotations import (PERSISTENT_WALK, TMA_BARRIER_BYTES, TMA_BARRIER_PADDING_ATTR, TMA_LOAD,
                                           TMA_PRODUCERS)
from tvmflash.lowering.ir import CALL, LOAD, find, is_load, loaded, substitute
from tvmflash.lowering.tma_device_functions import device_call, device_statement, untracked_pointer

ISSUE_MARK = "tvmflash.tma_issue"  # on each TMA issue, during the pass


def flat_index(buffer, indices):
    """The element offset of ``buffer[indices]``, from its strides or shape."""
    strides = list(buffer.strides) if buffer.strides else None
    if strides is None:
        strides, size = [], 1
        for extent in reversed(buffer.shape):
            strides.insert(0, size)
            size = size * extent
    return sum((i * s for i, s in zip(indices, strides)), tirx.const(0, "int32"))


class Plan:
    """What one kernel needs: its thread variables, the barriers and counters, a tensor map per
    global tensor copied from."""

    def __init__(self, func):
        self.threads = {}
        for loop in find(func.body, tirx.For, lambda n: n.thread_binding is not None):
            self.threads[loop.thread_binding.thread_tag] = (loop.loop_var, loop.extent)
        self.block_threads = 1
        for tag in ("threadIdx.x", "threadIdx.y", "threadIdx.z"):
            if tag in self.threads:
                self.block_threads *= int(self.threads[tag][1])
        self.consumed = tirx.decl_buffer((1,), "int32", "tma_consumed", scope="local")
        self.issued = tirx.decl_buffer((1,), "int32", "tma_issued", scope="local")
        self.released = tirx.decl_buffer((1,), "int32", "tma_released", scope="local")  # overlap only
        # a persistent walk's (``annotations.PERSISTENT_WALK``): bit s, the parity of the phases stage s's
        # barriers completed in the tiles before this one (the counters count one tile's copies)
        self.phases = tirx.decl_buffer((1,), "int32", "tma_phases", scope="local")
        self.persistent = bool(find(func.body, tirx.For, lambda n: PERSISTENT_WALK in n.annotations))
        self.tensor_maps = {}  # global buffer -> (tensor map var, its box)
        self.num_stages = None
        self.q_copy = None  # the statement of the Q tile's one-off TMA copy, if any (``tma_copies._one_off_copy``)
        producers = {str(n.annotations[TMA_LOAD]) for n in find(
            func.body, tvm.s_tir.SBlock, lambda n: TMA_LOAD in n.annotations)}
        if len(producers) != 1 or not producers <= set(TMA_PRODUCERS):
            raise RuntimeError(f"TMA: the copy blocks' {TMA_LOAD} must all name one of {TMA_PRODUCERS}, got {producers}")
        self.producer = producers.pop()
        self.producer_warpgroup = self.block_threads // 128  # threadIdx.y of the producer warpgroup, if any
        # sized so that the tiles after them stay on 1024-byte boundaries (``tile_alignment.check_tile_alignment``)
        barrier_bytes = TMA_BARRIER_BYTES[self.producer] + int((func.attrs or {}).get(TMA_BARRIER_PADDING_ATTR, 0))
        self.barriers = tirx.decl_buffer((barrier_bytes // 8,), "uint64", "tma_barriers", scope="shared.dyn")

    def is_producer(self):
        """The thread that issues the copies: thread 0, or thread 0 of the producer warpgroup (the
        condition inside that warpgroup's branch)."""
        if self.producer == "warpgroup":
            return self.threads["threadIdx.x"][0] == 0
        return tirx.all(*[var == 0 for tag, (var, _) in self.threads.items() if tag.startswith("threadIdx")])

    def barrier_init(self):
        """The producer sets the barriers up: full ones await one arrival (and the bytes), empty ones
        every consumer thread."""
        init = [device_statement("tvmflash_mbarrier_init", self.full(s), 1) for s in range(self.num_stages)]
        init += [device_statement("tvmflash_mbarrier_init", self.empty(s), self.block_threads) for s in range(self.num_stages)]
        if self.q_copy is not None:
            init.append(device_statement("tvmflash_mbarrier_init", self.q_full(), 1))
        return init + [device_statement("tvmflash_mbarrier_init_fence")]

    def full(self, stage):
        return untracked_pointer(self.barriers, stage)

    def empty(self, stage):
        return untracked_pointer(self.barriers, self.num_stages + stage)

    def q_full(self):
        """The barrier of the Q tile's one-off copy (``q_copy="tma"``), after the stages' ones."""
        return untracked_pointer(self.barriers, 2 * self.num_stages)

    def parity(self, count, stage):
        """The parity of the phase that the ``count``-th use in this tile of ``stage``'s barriers waits
        for (count // num_stages, plus a persistent walk's earlier tiles' phases)."""
        parity = tirx.floordiv(count, self.num_stages)
        if self.persistent:
            parity = tirx.bitwise_xor(parity, tirx.shift_right(self.phases[0], stage))
        return tirx.floormod(parity, 2) if not self.persistent else tirx.bitwise_and(parity, 1)

    def tile_done(self, counter):
        """After a persistent walk's tile: the phases its ``counter`` copies (or waits) completed, added
        into ``phases`` (stage s had (counter + num_stages - 1 - s) // num_stages of them)."""
        flips = [tirx.shift_left(tirx.bitwise_and(tirx.floordiv(counter[0] + (self.num_stages - 1 - s), self.num_stages), 1), s)
                 for s in range(self.num_stages)]
        return tirx.BufferStore(self.phases, tirx.bitwise_xor(self.phases[0], sum(flips[1:], flips[0])), [0])

    def tensor_map(self, buffer, box):
        if buffer not in self.tensor_maps:
            var = tirx.Var(f"{buffer.name}_tensormap", ty=T.handle("tensormap").ty)
            self.tensor_maps[buffer] = (var, box)
        return self.tensor_maps[buffer][0]


def tile_copy(plan, stmt):
    """The annotated copy block in ``stmt`` (an ``async_scope``'s body, or the statement of the Q tile's
    one-off copy) -> (its stage and number of stages, or None for the one-off copy; a function from the
    barrier it completes on to its tensor-map TMA call; its bytes). A pipeline's tile has its stages
    first, (stages, halves, rows, 8, 8); the Q tile is (halves, rows, 8, 8); a row vector's (of a
    (batch, heads, seqlen) tensor) is (stages, rows)."""
    blocks = find(stmt, tvm.s_tir.SBlock, lambda n: TMA_LOAD in n.annotations)
    if len(blocks) != 1:
        raise RuntimeError(f"TMA: expected one annotated copy block in an async scope, found {len(blocks)}")
    store = blocks[0].body
    if type(store).__name__ != "BufferStore":
        raise RuntimeError(f"TMA: the copy block {blocks[0].name_hint} is not one store")
    # the tensor copied: the load of the tile's dtype (varlen's also read the sequence offsets, int32,
    # in the row index and the predicate; TMA reads past the sequence's end, which the mask hides)
    loads = [load for load in find(store.value, LOAD) if loaded(load).dtype == store.buffer.dtype]
    if len(loads) != 1:
        raise RuntimeError(f"TMA: the copy block {blocks[0].name_hint} must read one global tensor: {loads}")
    source = loads[0]
    # The tile's origin: every loop inside the statement and every thread index at 0.
    zero = [(loop.loop_var, tirx.const(0, "int32")) for loop in find(stmt, tirx.For)]
    zero += [(var, tirx.const(0, "int32")) for tag, (var, _) in plan.threads.items() if tag.startswith("threadIdx")]
    analyzer = tvm.sym.Analyzer()
    at_origin = lambda e: analyzer.simplify(substitute(e, zero))  # noqa: E731
    destination = [at_origin(i) for i in store.indices]
    tile = store.buffer
    if len(source.indices) == 3:  # a row vector, (batch, head, row): the backward's lse and delta
        return _row_vector_copy(plan, source, tile, destination, [at_origin(i) for i in source.indices])
    batch, row, head, col = [at_origin(i) for i in source.indices]
    if len(tile.shape) == 4:  # the Q tile
        stage, (halves, rows, chunks) = None, (int(e) for e in tile.shape[:3])
    else:  # the pipeline's versions of a K or V tile
        stages, halves, rows, chunks = (int(e) for e in tile.shape[:4])
        # K and V have the same number of stages, or (overlap) V one more: the barriers follow V's
        plan.num_stages = max(plan.num_stages or 0, stages)
        stage = (destination[0], stages)
    columns = 8 * chunks  # a swizzled row: 64 (the 128-byte swizzle) or 32 (64-byte)
    tensor_map = plan.tensor_map(loaded(source), (columns, rows, halves))
    call = lambda barrier: tirx.Evaluate(device_call(  # noqa: E731
        "tvmflash_tma_load_5d", untracked_pointer(tile, flat_index(tile, destination)), T.address_of(tensor_map),
        barrier, col % columns, row, col // columns, head, batch))
    return stage, call, columns * rows * halves * tile.dtype.bits // 8


def _row_vector_copy(plan, source, tile, destination, origin):
    """``tile_copy`` of a pipeline's (stages, rows) tile of a (batch, heads, seqlen) float32 tensor (the
    backward's lse and delta a Q block): one 3-D TMA copy of ``rows`` values, no swizzle, rows past
    the end zero-filled."""
    batch, head, row = origin
    stages, rows = (int(e) for e in tile.shape)
    plan.num_stages = max(plan.num_stages or 0, stages)
    tensor_map = plan.tensor_map(loaded(source), (rows,))
    call = lambda barrier: tirx.Evaluate(device_call(  # noqa: E731
        "tvmflash_tma_load_3d", untracked_pointer(tile, flat_index(tile, destination)), T.address_of(tensor_map), barrier,
        row, head, batch))
    return (destination[0], stages), call, rows * tile.dtype.bits // 8


def reads_tiles(stmt, tiles):
    """Whether ``stmt`` reads one of ``tiles`` (a load, or a pointer into it)."""
    def reads(node):
        if is_load(node):
            return any(loaded(node).same_as(t) for t in tiles)
        if node.op.name == "tirx.tvm_access_ptr":
            data = node.args[1]  # buffer.data: a call on the buffer variable
            return isinstance(data, CALL) and any(data.args[0].same_as(t) for t in tiles)
        return False
    return bool(find(stmt, (LOAD, CALL), reads))


def q_tile_visible():
    """Before the K/V pipeline: the threads' stores of the Q tile made visible to wgmma (the async
    proxy), and the barriers' set-up to every thread. Here rather than at the first issue, which may
    sit in a loop of the pipeline's prologue."""
    return [device_statement("tvmflash_fence_proxy_async"), tirx.Evaluate(T.tvm_storage_sync("shared"))]
