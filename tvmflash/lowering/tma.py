"""Streamed tiles by TMA: the software pipeline's cp.async copies become tensor-memory-accelerator
copies completing on mbarriers (sm_90a). The forward's K/V tiles; the backward dkdv's Q blocks (q
and dout as the forward's K and V, and the rows' lse and delta, ``_row_vector_copy``).

A schedule asks for it by annotating its pipelined copy blocks ``TMA_LOAD`` (the sm90 schedule's
``kv_copy="tma"`` and ``dkdv_copy="tma"``), after laying their tiles out as TMA writes them (128-byte
swizzle, 64-column halves; a row vector as it is). TensorIR has no TMA copy, so ``lowered_to_tma``
rewrites what InjectSoftwarePipeline made of those blocks (``LowerToTMA``, right after that pass in
``pipeline.py``):

  * each commit group of annotated copies (one K/V tile) becomes one thread's
    ``mbarrier.arrive.expect_tx`` on the stage's "full" barrier and one ``cp.async.bulk.tensor`` per
    tile, after that thread waited on the stage's "empty" barrier (the tile ``num_stages`` earlier
    was consumed);
  * each wait for a tile becomes every thread's wait on the stage's full barrier, and after the
    last statement that reads the tile every thread arrives on its empty barrier, once its
    warpgroup's wgmma are done (``tvmflash_release_after_wgmma``). No block-wide
    barrier is left in the K/V loop: a warpgroup waits only for its own tile, and the issuing
    thread only for the stage it refills (FA3's pipeline, with thread 0 as the producer);
  * the host encodes one tensor map per global tensor (``tensormap_encode_tiled``: the 5-D view
    (64 elements, row, 64-column half, head, batch), 128-byte swizzle; a row vector's 3-D (row, head,
    batch), no swizzle), which reaches the kernel as a ``__grid_constant__`` parameter.

Phases: a thread's k-th wait on the full barriers is for tile k, in stage k % num_stages, phase
(k // num_stages) % 2; the producer counts its issues the same way. Each is a per-thread counter
in a register, so the pipeline's index expressions are never parsed.

The producer thread initialises the barriers first thing; right before the pipeline one
``fence.proxy.async`` and barrier make the Q tile's stores visible to wgmma (``_q_tile_visible``).
An annotated copy before the pipeline (the Q tile, ``q_copy="tma"``) becomes one TMA copy on a
barrier of its own, which every thread waits on (``_one_off_copy``). With the sm90 schedule's
``overlap``, V has one stage more than K and a step reads V of the tile before the one it waits for;
``_waits_and_releases`` says how the waits and releases follow.

Who issues (the annotation's value, one of ``TMA_PRODUCERS``): "thread", thread 0 of the first warpgroup,
between its own wgmma; or "warpgroup", FA3's producer warpgroup (``_split_warpgroups``): one more
warpgroup (threadIdx.y == the number of consumer warpgroups) runs the pipeline sliced down to its
issues, gives its registers to the consumers by setmaxnreg (24 and 240 a thread), and the
consumers' block-wide barriers become named barriers that count them only (``consumer_barriers``,
after ThreadSync). The releases follow each stage's last reader's commit and wait
(``_only_commits_or_waits``). Every build's TMA destinations are checked to sit on 1024-byte
boundaries (``check_tile_alignment``): shared-memory merging places them, and a build that finds
them off grows the barriers (``annotations.TMA_BARRIER_PADDINGS``, ``pipeline.build``) and builds again. The barriers and
TMA's shared-memory pointers are ``tvm_access_ptr`` with an empty access mask: ThreadSync then
plans no barrier for them (the mbarriers order them), while shared-memory merging still sees them
live (after the last wait it may reuse their bytes, for the LSE staging).
"""

from __future__ import annotations

import math

import tvm
import tvm.sym
import tvm_ffi
from tvm import tirx
from tvm.script import tirx as T

from tvmflash.lowering.annotations import (NARROW_SWIZZLE_COLUMNS, SWIZZLE_COLUMNS, TMA_BARRIER_BYTES,
                                           TMA_BARRIER_PADDING_ATTR, TMA_LOAD, TMA_PRODUCERS,
                                           WGMMA_SWIZZLE_LAYOUTS)
from tvmflash.lowering.ir import (find, inlined, is_attr, is_call, is_load, let_values, loaded, prim_func_pass,
                                  substitute, transform, unmarked)

_WAIT_MARK, _RELEASED_MARK = "tvmflash.tma_wait", "tvmflash.tma_released"  # on the tile waits, during the pass
_ISSUE_MARK = "tvmflash.tma_issue"  # on each TMA issue, during the pass
_CONSUMER_MARK = "tvmflash.tma_consumers"  # around the consumer warpgroups' code, until their barriers are named
# producer="warpgroup" (FA3): a warpgroup of its own issues the copies; setmaxnreg moves registers from it
# to the two consumer warpgroups (128 * 24 + 256 * 240 <= 65536).
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 24, 240
CONSUMER_BARRIER = 1  # named barrier id of the consumer warpgroups (0 is __syncthreads)
SWIZZLE_64B, SWIZZLE_128B, L2_PROMOTION_128B = 2, 3, 2  # CUtensorMapSwizzle, CUtensorMapL2promotion
_TMA_SWIZZLES = {SWIZZLE_COLUMNS: SWIZZLE_128B, NARROW_SWIZZLE_COLUMNS: SWIZZLE_64B}  # a swizzled row's columns

_SMEM = "(unsigned)__cvta_generic_to_shared"
# One CUDA helper per function (TVM emits a helper's source once per function name).
_HELPERS = {
    "tvmflash_mbarrier_init": (
        "__device__ __forceinline__ void tvmflash_mbarrier_init(void* bar, int count) {\n"
        f'  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"({_SMEM}(bar)), "r"(count) : "memory");\n}}'),
    "tvmflash_mbarrier_init_fence": (
        "__device__ __forceinline__ void tvmflash_mbarrier_init_fence() {\n"
        '  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");\n}'),
    "tvmflash_mbarrier_expect_tx": (
        "__device__ __forceinline__ void tvmflash_mbarrier_expect_tx(void* bar, int bytes) {\n"
        '  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"'
        f' :: "r"({_SMEM}(bar)), "r"(bytes) : "memory");\n}}'),
    # A tile is released once this warpgroup's wgmma have read it. The wait sits in the same asm:
    # after a separate wgmma.wait_group, ptxas hoisted the SYNCS.ARRIVE above the WARPGROUP.DEPBAR
    # (the wgmma's shared-memory reads are no register dependency), so the producer could refill a
    # stage that the last PV wgmma was still reading (seen in the SASS of the d128 build).
    "tvmflash_release_after_wgmma": (
        "__device__ __forceinline__ void tvmflash_release_after_wgmma(void* bar) {\n"
        '  asm volatile("wgmma.wait_group.sync.aligned 0;\\n\\tmbarrier.arrive.shared::cta.b64 _, [%0];"'
        f' :: "r"({_SMEM}(bar)) : "memory");\n}}'),
    "tvmflash_mbarrier_wait": (
        "__device__ __forceinline__ void tvmflash_mbarrier_wait(void* bar, int parity) {\n"
        '  asm volatile("{\\n .reg .pred done;\\n WAIT:\\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\\n"\n'
        f'               " @!done bra WAIT;\\n}}" :: "r"({_SMEM}(bar)), "r"(parity) : "memory");\n}}'),
    "tvmflash_tma_load_5d": (
        "__device__ __forceinline__ void tvmflash_tma_load_5d(void* dst, unsigned long long map, void* bar,\n"
        "                                                     int c0, int c1, int c2, int c3, int c4) {\n"
        '  asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"\n'
        '               " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"\n'
        f'               :: "r"({_SMEM}(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"({_SMEM}(bar))\n'
        '               : "memory");\n}'),
    "tvmflash_tma_load_3d": (
        "__device__ __forceinline__ void tvmflash_tma_load_3d(void* dst, unsigned long long map, void* bar,\n"
        "                                                     int c0, int c1, int c2) {\n"
        '  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"\n'
        '               " [%0], [%1, {%2, %3, %4}], [%5];"\n'
        f'               :: "r"({_SMEM}(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"({_SMEM}(bar))\n'
        '               : "memory");\n}'),
    "tvmflash_named_barrier": (
        "__device__ __forceinline__ void tvmflash_named_barrier(int id, int threads) {\n"
        '  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");\n}'),
    "tvmflash_setmaxnreg_dec": (
        "__device__ __forceinline__ void tvmflash_setmaxnreg_dec() {\n"
        f'  asm volatile("setmaxnreg.dec.sync.aligned.u32 {PRODUCER_REGISTERS};");\n}}'),
    "tvmflash_setmaxnreg_inc": (
        "__device__ __forceinline__ void tvmflash_setmaxnreg_inc() {\n"
        f'  asm volatile("setmaxnreg.inc.sync.aligned.u32 {CONSUMER_REGISTERS};");\n}}'),
    "tvmflash_fence_proxy_async": (
        "__device__ __forceinline__ void tvmflash_fence_proxy_async() {\n"
        '  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");\n}'),
}


def _device_call(name, *args):
    return T.cuda.func_call(name, *args, source_code=_HELPERS[name])


def _call(name, *args):
    return tirx.Evaluate(_device_call(name, *args))


def _pointer(buffer, offset):
    """A pointer into ``buffer`` that ThreadSync does not count as an access (mask 0)."""
    return T.tvm_access_ptr(T.type_annotation(buffer.dtype), buffer.data, offset, 1, 0)


def _flat(buffer, indices):
    strides = list(buffer.strides) if buffer.strides else None
    if strides is None:
        strides, size = [], 1
        for extent in reversed(buffer.shape):
            strides.insert(0, size)
            size = size * extent
    return sum((i * s for i, s in zip(indices, strides)), tirx.const(0, "int32"))



class _Plan:
    """What one kernel needs: its thread variables, the barriers and counters, a tensor map per
    global tensor copied from."""

    def __init__(self, func):
        self.threads = {}
        for loop in find(func.body, lambda n: isinstance(n, tirx.For) and n.thread_binding is not None):
            self.threads[loop.thread_binding.thread_tag] = (loop.loop_var, loop.extent)
        self.block_threads = 1
        for tag in ("threadIdx.x", "threadIdx.y", "threadIdx.z"):
            if tag in self.threads:
                self.block_threads *= int(self.threads[tag][1])
        self.consumed = tirx.decl_buffer((1,), "int32", "tma_consumed", scope="local")
        self.issued = tirx.decl_buffer((1,), "int32", "tma_issued", scope="local")
        self.released = tirx.decl_buffer((1,), "int32", "tma_released", scope="local")  # overlap only
        self.tensor_maps = {}  # global buffer -> (tensor map var, its box)
        self.num_stages = None
        self.q_copy = None  # the statement of the Q tile's one-off TMA copy, if any (``_one_off_copy``)
        producers = {str(n.annotations[TMA_LOAD]) for n in find(
            func.body, lambda n: isinstance(n, tvm.s_tir.SBlock) and TMA_LOAD in n.annotations)}
        if len(producers) != 1 or not producers <= set(TMA_PRODUCERS):
            raise RuntimeError(f"TMA: the copy blocks' {TMA_LOAD} must all name one of {TMA_PRODUCERS}, got {producers}")
        self.producer = producers.pop()
        self.producer_warpgroup = self.block_threads // 128  # threadIdx.y of the producer warpgroup, if any
        # sized so that the tiles after them stay on 1024-byte boundaries (``check_tile_alignment``)
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
        init = [_call("tvmflash_mbarrier_init", self.full(s), 1) for s in range(self.num_stages)]
        init += [_call("tvmflash_mbarrier_init", self.empty(s), self.block_threads) for s in range(self.num_stages)]
        if self.q_copy is not None:
            init.append(_call("tvmflash_mbarrier_init", self.q_full(), 1))
        return init + [_call("tvmflash_mbarrier_init_fence")]

    def full(self, stage):
        return _pointer(self.barriers, stage)

    def empty(self, stage):
        return _pointer(self.barriers, self.num_stages + stage)

    def q_full(self):
        """The barrier of the Q tile's one-off copy (``q_copy="tma"``), after the stages' ones."""
        return _pointer(self.barriers, 2 * self.num_stages)

    def tensor_map(self, buffer, box):
        if buffer not in self.tensor_maps:
            var = tirx.Var(f"{buffer.name}_tensormap", ty=T.handle("tensormap").ty)
            self.tensor_maps[buffer] = (var, box)
        return self.tensor_maps[buffer][0]


def _copy(plan, stmt):
    """The annotated copy block in ``stmt`` (an ``async_scope``'s body, or the statement of the Q tile's
    one-off copy) -> (its stage and number of stages, or None for the one-off copy; a function from the
    barrier it completes on to its tensor-map TMA call; its bytes). A pipeline's tile has its stages
    first, (stages, halves, rows, 8, 8); the Q tile is (halves, rows, 8, 8); a row vector's (of a
    (batch, heads, seqlen) tensor) is (stages, rows)."""
    blocks = find(stmt, lambda n: isinstance(n, tvm.s_tir.SBlock) and TMA_LOAD in n.annotations)
    if len(blocks) != 1:
        raise RuntimeError(f"TMA: expected one annotated copy block in an async scope, found {len(blocks)}")
    store = blocks[0].body
    if type(store).__name__ != "BufferStore":
        raise RuntimeError(f"TMA: the copy block {blocks[0].name_hint} is not one store")
    # the tensor copied: the load of the tile's dtype (varlen's also read the sequence offsets, int32,
    # in the row index and the predicate; TMA reads past the sequence's end, which the mask hides)
    loads = [load for load in find(store.value, is_load) if loaded(load).dtype == store.buffer.dtype]
    if len(loads) != 1:
        raise RuntimeError(f"TMA: the copy block {blocks[0].name_hint} must read one global tensor: {loads}")
    source = loads[0]
    # The tile's origin: every loop inside the statement and every thread index at 0.
    zero = [(loop.loop_var, tirx.const(0, "int32")) for loop in find(stmt, lambda n: isinstance(n, tirx.For))]
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
    call = lambda barrier: tirx.Evaluate(_device_call(  # noqa: E731
        "tvmflash_tma_load_5d", _pointer(tile, _flat(tile, destination)), T.address_of(tensor_map),
        barrier, col % columns, row, col // columns, head, batch))
    return stage, call, columns * rows * halves * tile.dtype.bits // 8


def _row_vector_copy(plan, source, tile, destination, origin):
    """``_copy`` of a pipeline's (stages, rows) tile of a (batch, heads, seqlen) float32 tensor (the
    backward's lse and delta a Q block): one 3-D TMA copy of ``rows`` values, no swizzle, rows past
    the end zero-filled."""
    batch, head, row = origin
    stages, rows = (int(e) for e in tile.shape)
    plan.num_stages = max(plan.num_stages or 0, stages)
    tensor_map = plan.tensor_map(loaded(source), (rows,))
    call = lambda barrier: tirx.Evaluate(_device_call(  # noqa: E731
        "tvmflash_tma_load_3d", _pointer(tile, _flat(tile, destination)), T.address_of(tensor_map), barrier,
        row, head, batch))
    return (destination[0], stages), call, rows * tile.dtype.bits // 8


def _issue(plan, commit):
    """A commit group of annotated copies -> the producer thread's TMA issue, on the stage of the tile
    with the most stages (V's, with overlap): every copy of the group completes on that stage's full
    barrier, whichever version of its own tile it fills (K's stage differs with overlap).

    Before it refills a stage the producer waits for the release that frees it: tile t's, for tile
    t + num_stages. With overlap K has one version fewer, so tile t overwrites K of tile
    t - num_stages + 1, whose QK^T the consumers wait for one step before they release the stage
    that V of tile t needs. There the release is counted per wait for all wgmma, the pipeline's
    first one included (``_waits_and_releases``), and tile t waits for release t - num_stages + 1."""
    scopes = find(commit.body, lambda n: is_attr(n, "async_scope"))
    copies = [_copy(plan, scope.body) for scope in scopes]
    stage = max((c[0] for c in copies), key=lambda s: s[1])[0]
    issued = plan.issued[0]
    if len({c[0][1] for c in copies}) == 1:  # the tile's copies have as many versions as stages
        lag = plan.num_stages
        refill = _device_call("tvmflash_mbarrier_wait", plan.empty(stage),
                              tirx.floormod(tirx.floordiv(issued, plan.num_stages) + 1, 2))
    else:  # overlap: K has one version fewer
        lag = plan.num_stages - 1
        release = issued - lag
        refill = _device_call("tvmflash_mbarrier_wait", plan.empty(tirx.floormod(release, plan.num_stages)),
                              tirx.floormod(tirx.floordiv(release, plan.num_stages), 2))
    body = [
        tirx.IfThenElse(issued >= lag, tirx.Evaluate(refill), None),  # the release that frees this tile's buffers
        _call("tvmflash_mbarrier_expect_tx", plan.full(stage), sum(c[2] for c in copies)),
        *[c[1](plan.full(stage)) for c in copies],
        tirx.BufferStore(plan.issued, issued + 1, [0]),
    ]
    return tirx.IfThenElse(plan.is_producer(), tirx.SeqStmt(body), None)


def _wait_for_next_tile(plan):
    """Every thread waits for the oldest tile in flight on its stage's full barrier."""
    consumed = plan.consumed[0]
    return [_call("tvmflash_mbarrier_wait", plan.full(tirx.floormod(consumed, plan.num_stages)),
                  tirx.floormod(tirx.floordiv(consumed, plan.num_stages), 2)),
            tirx.BufferStore(plan.consumed, consumed + 1, [0])]


def _reads_tiles(stmt, tiles):
    def reads(node):
        if is_load(node):
            return any(loaded(node).same_as(t) for t in tiles)
        if type(node).__name__ == "Call" and node.op.name == "tirx.tvm_access_ptr":
            data = node.args[1]  # buffer.data: a call on the buffer variable
            return type(data).__name__ == "Call" and any(data.args[0].same_as(t) for t in tiles)
        return False
    return bool(find(stmt, reads))


_TMA_LOADS = {"tvmflash_tma_load_5d": 1024, "tvmflash_tma_load_3d": 128}  # each copy's shared-memory alignment


def _names_tma_issue(node):
    return (type(node).__name__ == "Call" and node.op.name == "tirx.cuda.func_call"
            and node.args[0].value in _TMA_LOADS)


def _only_commits_or_waits(stmt):
    """Whether ``stmt`` only commits wgmma groups or waits for them."""
    calls = find(stmt, lambda n: type(n).__name__ == "Call")
    return bool(calls) and all(c.op.name.startswith("tirx.ptx.wgmma") and any(
        getattr(a, "value", None) in ("commit_group", "wait_group") for a in c.args) for c in calls)


def _waits_all(stmt):
    """Whether ``stmt`` waits for every committed wgmma group (``wgmma.wait_group 0``)."""
    return bool(find(stmt, lambda n: type(n).__name__ == "Call" and n.op.name.startswith("tirx.ptx.wgmma")
                      and any(getattr(a, "value", None) == "wait_group" for a in n.args)
                      and any(isinstance(a, tirx.IntImm) and a.value == 0 for a in n.args)))


def _guarded(stmt, body):
    """``body`` (statements) under ``stmt``'s predicate, where ``stmt`` is a predicated block (the
    software pipeline's prologue and epilogue run some stages in some of their steps only)."""
    predicate = getattr(stmt, "predicate", None)
    body = tirx.SeqStmt(body) if len(body) > 1 else body[0]
    if predicate is None or (isinstance(predicate, tirx.IntImm) and predicate.value == 1):
        return body
    return tirx.IfThenElse(predicate, body, None)


def _waits_and_releases(plan, stmt, tiles):
    """Where the pipeline waited for a tile (the mark of each wait): in the innermost sequence that
    holds it, every thread waits on the tile's full barrier as early as it can (after the step's
    issue, or the loop before: not between wgmma.fence and the wgmma, where ptxas would add a
    warpgroup.arrive), and arrives on its empty barrier right after the last statement that reads
    a TMA tile, each under the predicate of the statement it goes with (the pipeline's epilogue
    runs a step only where the loop had one). The mark is then renamed, so that the sequences
    around do not do it again.

    With overlap, V has one stage more than K, and a step reads V of the tile before the one it waits
    for: there, the wait is only where the sequence reads K (not before the pipeline's last PV), and
    the release follows the next wait for all wgmma groups after the sequence's last read of a tile
    (this tile's QK^T's: the PV was only committed), the first step's too (QK^T of tile 0 alone:
    it frees K's version that tile num_stages - 1 fills); the releases are counted apart
    (``released``), and the producer waits for release t - num_stages + 1 before it issues tile t."""
    stages = {t: int(t.shape[0]) for t in tiles}
    early = [t for t in tiles if stages[t] == min(stages.values())]
    late = [t for t in tiles if stages[t] == max(stages.values())]
    lagged = early != late

    def reads(stmt, which):  # a statement's reads of these tiles, not its TMA issues' pointers into them
        return _reads_tiles(transform(stmt, tirx.AttrStmt, lambda n: tirx.Evaluate(0) if is_attr(n, _ISSUE_MARK)
                                       else None), which)

    def rewrite(node):
        seq = list(node.seq)
        marked = [i for i, s in enumerate(seq) if find(s, lambda n: is_attr(n, _WAIT_MARK))]
        if not marked:
            return None
        readers = [i for i, s in enumerate(seq) if reads(s, tiles if lagged else late)]
        if readers:
            last = readers[-1]
            if lagged:
                last = next((i for i in range(last + 1, len(seq)) if _waits_all(seq[i])), last)
            while last + 1 < len(seq) and _only_commits_or_waits(seq[last + 1]):
                last += 1  # after the last reader's commit and wait: its wgmma then sit in a group to wait on
            if lagged:  # under the reader's predicate: the pipeline's prologue and epilogue are 2-step loops
                released = plan.released[0]
                seq.insert(last + 1, _guarded(seq[readers[-1]], [
                    _call("tvmflash_release_after_wgmma", plan.empty(tirx.floormod(released, plan.num_stages))),
                    tirx.BufferStore(plan.released, released + 1, [0])]))
            else:  # under the reader's predicate too: a pipeline of no step (dkdv's K/V block that no
                # query sees) runs its epilogue's statements under a false one
                stage = tirx.floormod(plan.consumed[0] - 1, plan.num_stages)
                seq.insert(last + 1, _guarded(seq[readers[-1]], [
                    _call("tvmflash_release_after_wgmma", plan.empty(stage))]))
        k_readers = [i for i in range(marked[0], len(seq)) if reads(seq[i], early)]
        if k_readers:
            first = marked[0]
            while first > 0 and not find(seq[first - 1], lambda n: isinstance(n, tirx.For) or _names_tma_issue(n)):
                first -= 1
            wait = _wait_for_next_tile(plan)  # under the predicate of the (K) tile's first reader
            seq[first:first] = [_guarded(seq[k_readers[0]], wait)]
        return transform(tirx.SeqStmt(seq), tirx.AttrStmt, lambda n: tirx.AttrStmt(
            n.node, _RELEASED_MARK, n.value, n.body) if is_attr(n, _WAIT_MARK) else None)
    return transform(stmt, tirx.SeqStmt, rewrite)


def lowered_to_tma(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` after InjectSoftwarePipeline, with its TMA_LOAD copies on TMA (module docstring);
    unchanged if it has none."""
    if not find(func.body, lambda n: isinstance(n, tvm.s_tir.SBlock) and TMA_LOAD in n.annotations):
        return func
    if len(find(func.body, lambda n: isinstance(n, tvm.s_tir.SBlock) and n.name_hint == "tile")) != 1:
        raise RuntimeError("TMA: expected one block named 'tile' (the per-thread-block scope)")
    plan = _Plan(func)
    commits = find(func.body, lambda n: is_attr(n, "async_commit_queue_scope"))
    waits = find(func.body, lambda n: is_attr(n, "async_wait_queue_scope"))
    tiles = []
    for commit in commits:
        for scope in find(commit.body, lambda n: is_attr(n, "async_scope")):
            for block in find(scope.body, lambda n: isinstance(n, tvm.s_tir.SBlock) and TMA_LOAD in n.annotations):
                tiles.append(block.body.buffer)

    def rewrite(node):
        if is_attr(node, "async_commit_queue_scope"):
            return tirx.AttrStmt(0, _ISSUE_MARK, 1, _issue(plan, node))
        if is_attr(node, "async_wait_queue_scope"):
            inner = node.body.body if is_attr(node.body, "async_wait_inflight_count") else node.body
            return tirx.AttrStmt(0, _WAIT_MARK, 1, inner)
        return None

    if len(commits) < 1 or len(waits) < 1:
        raise RuntimeError("TMA: the annotated copies are not in a software pipeline's async stage")
    body = transform(func.body, tirx.AttrStmt, rewrite)
    body = _waits_and_releases(plan, body, tiles)

    body = unmarked(body, _RELEASED_MARK)

    def allocate(node):  # barriers and counters in the per-thread-block scope, counters at 0
        if not (isinstance(node, tvm.s_tir.SBlock) and node.name_hint == "tile"):
            return None
        buffers = [*node.alloc_buffers, plan.barriers, plan.consumed, plan.issued, plan.released]
        inside, under_test = _inside_run_if(node.body)
        stmts, k = _pipeline_start(inside)
        stmts, q_issue = _one_off_copy(plan, stmts, k)
        if plan.producer == "warpgroup":
            work, moved = _split_warpgroups(plan, stmts, k, q_issue, node.alloc_buffers)
            buffers = [b for b in buffers if not any(b.same_as(m) for m in moved)]
        else:  # the producer thread sets the barriers up first (and issues Q); the pipeline starts once Q is in
            init = [tirx.IfThenElse(plan.is_producer(), tirx.SeqStmt(plan.barrier_init()), None)]
            if q_issue is not None:  # every thread waits on the Q barrier: its set-up must be seen first
                init += [tirx.Evaluate(T.tvm_storage_sync("shared")), q_issue]
            work = unmarked(tirx.SeqStmt([*init, *stmts[:k], *_q_tile_visible(), *stmts[k:]]), _ISSUE_MARK)
        start = under_test(tirx.SeqStmt([*[tirx.BufferStore(b, 0, [0]) for b in (plan.consumed, plan.issued,
                                                                                 plan.released)], work]))
        return tvm.s_tir.SBlock(node.iter_vars, node.reads, node.writes, node.name_hint, start, node.init,
                                buffers, node.match_buffers, node.annotations)
    body = transform(body, tvm.s_tir.SBlock, allocate)
    if plan.producer == "warpgroup":  # one more warpgroup: threadIdx.y runs over it too
        body = transform(body, tirx.For, lambda n: tirx.For(
            n.loop_var, n.min, n.extent + 1, n.kind, n.body, n.thread_binding, n.annotations)
            if n.thread_binding is not None and n.thread_binding.thread_tag == "threadIdx.y" else None)
    copies = len(find(body, _names_tma_issue))
    return func.with_body(_after_declarations(body, _encode_tensor_maps(plan), plan.tensor_maps)).with_attr(
        _TMA_COPIES_ATTR, copies)


def _after_declarations(body, stmts, buffers):
    """``body`` with ``stmts`` (host statements that read ``buffers``) before everything but the
    declarations of those buffers (the program's strided views of its arguments)."""
    def declares(node):
        return isinstance(node, tirx.DeclBuffer) and any(node.buffer.same_as(b) for b in buffers)

    found = find(body, lambda n: isinstance(n, tirx.SeqStmt) and any(declares(s) for s in n.seq))
    if not found:
        return tirx.SeqStmt([*stmts, body])
    seq = found[0]
    k = max(i for i, s in enumerate(seq.seq) if declares(s)) + 1
    return transform(body, tirx.SeqStmt, lambda n: tirx.SeqStmt([*seq.seq[:k], *stmts, *seq.seq[k:]])
                      if n.same_as(seq) else None)


def _split_warpgroups(plan, stmts, k, q_issue, tile_buffers):
    """producer="warpgroup": the thread block's work (``stmts``, the pipeline in ``stmts[k]``; the
    Q tile's TMA issue ``q_issue``, or None), split between a producer warpgroup
    (threadIdx.y == the number of consumer warpgroups) and the consumers, in one branch. Returns
    that and the thread block's buffers it moved into the consumers' branch.

    The branch sits in the block that holds the K/V pipeline (it allocates the tiles, which both
    sides use). The producer runs the pipeline sliced down to its TMA issues (the loops and guards
    around them kept); the consumers run the pipeline without them, and what came before it (the Q
    tile, the running values) and after it (the output), moved in. The barriers are set up before the
    branch. setmaxnreg gives the producer's registers to the consumers; ptxas allocates 240 a consumer
    thread only for code that every path reaches through the increase, hence one branch. The
    condition is uniform per warpgroup (``tvm_thread_invariant``), so that ThreadSync may plan the
    consumers' barriers inside it; they become named ones (``consumer_barriers``).

    The shared-memory buffers that only the consumers use (the Q tile, the output's staging tile,
    the LSE's) are allocated in the consumers' branch: shared-memory merging counts a buffer live over
    the whole statement, at the level of its allocation, that touches it, so at the thread block's
    level all of them would live through the branch, and the output's staging could not reuse the Q
    tile's memory."""
    def issues(stmt):
        return len(find(stmt, lambda n: is_attr(n, _ISSUE_MARK)))

    def only_issues(seq):  # a sequence that holds issues keeps just those (an issue's own sequence stays whole)
        if not issues(seq):
            return seq
        kept = [s for s in seq.seq if issues(s)]
        return tirx.SeqStmt(kept) if len(kept) > 1 else kept[0]

    moved = []
    before, after, total = stmts[:k], stmts[k + 1:], issues(stmts[k])
    y = plan.threads["threadIdx.y"][0]
    warpgroup = tirx.const(plan.producer_warpgroup, "int32")

    def split(block):  # the innermost block that holds every issue
        if issues(block.body) != total or any(issues(b.body) == total for b in find(
                block.body, lambda n: isinstance(n, tvm.s_tir.SBlock))):
            return None
        producer = unmarked(tvm_ffi.structural_map(block.body, (tirx.SeqStmt, only_issues)), _ISSUE_MARK)
        if find(producer, lambda n: type(n).__name__ == "Call" and n.op.name in ("tirx.ptx.wgmma", "tirx.tvm_storage_sync")):
            raise RuntimeError("TMA: the producer warpgroup's slice of the K/V pipeline kept consumer work")
        pipeline = transform(block.body, tirx.AttrStmt,
                              lambda n: tirx.Evaluate(0) if is_attr(n, _ISSUE_MARK) else None)
        consumers = tirx.SeqStmt([_call("tvmflash_setmaxnreg_inc"), *([q_issue] if q_issue else []), *before,
                                  *_q_tile_visible(), pipeline, *after])
        moved.extend(b for b in tile_buffers if b.scope() == "shared.dyn" and not _touches(producer, b))
        consumers = tvm.s_tir.SBlockRealize([], True, tvm.s_tir.SBlock([], [], [], "consumers", consumers,
                                                                       alloc_buffers=moved))
        body = tirx.IfThenElse(T.tvm_thread_invariant(tirx.EQ(y, warpgroup)),
                               tirx.SeqStmt([_call("tvmflash_setmaxnreg_dec"), producer]),
                               tirx.AttrStmt(0, _CONSUMER_MARK, plan.block_threads, consumers))
        return tvm.s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body, block.init,
                                block.alloc_buffers, block.match_buffers, block.annotations)

    setup = tirx.IfThenElse(tirx.all(tirx.EQ(y, warpgroup), plan.is_producer()),
                            tirx.SeqStmt(plan.barrier_init()), None)
    split_work = transform(stmts[k], tvm.s_tir.SBlock, split)
    return tirx.SeqStmt([setup, tirx.Evaluate(T.tvm_storage_sync("shared")), split_work]), moved


def _one_off_copy(plan, stmts, k):
    """The Q tile's TMA copy (a ``TMA_LOAD`` block before the pipeline, ``q_copy="tma"``): its
    statement in ``stmts`` becomes every thread's wait on the Q barrier. Returns the statements and
    the issue, by thread 0 of the first warpgroup (None without such a copy). Not the producer
    warpgroup's: the Q tile then stays the consumers' own, so that the output's staging may reuse
    its memory (``_split_warpgroups``)."""
    copies = [i for i, stmt in enumerate(stmts[:k])
              if find(stmt, lambda n: isinstance(n, tvm.s_tir.SBlock) and TMA_LOAD in n.annotations)]
    if not copies:
        return stmts, None
    i = copies[0]
    if len(copies) > 1 or len(find(stmts[i], lambda n: isinstance(n, tvm.s_tir.SBlock))) != 1:
        raise RuntimeError("TMA: expected one copy block outside the pipeline (the Q tile), alone in its statement")
    plan.q_copy = stmts[i]
    _, call, size = _copy(plan, stmts[i])
    issue = tirx.SeqStmt([_call("tvmflash_mbarrier_expect_tx", plan.q_full(), size), call(plan.q_full())])
    wait = _call("tvmflash_mbarrier_wait", plan.q_full(), 0)
    first = tirx.all(*[var == 0 for tag, (var, _) in plan.threads.items() if tag.startswith("threadIdx")])
    return [*stmts[:i], wait, *stmts[i + 1:]], tirx.IfThenElse(first, issue, None)


def _inside_run_if(body):
    """A tile's body and a function that puts a body back where it was: under the uniform test that
    ``loops_and_blocks.RunBlocksIf`` wraps a tile in (varlen's Q blocks past their sequence), the statements
    inside it, so that the Q tile's proxy fence (``_q_tile_visible``) lands after the Q tile's stores
    and not before the test, ahead of them."""
    if (isinstance(body, tirx.IfThenElse) and body.else_case is None
            and is_call(body.condition, "tirx.tvm_thread_invariant")):
        return body.then_case, lambda inner: tirx.IfThenElse(body.condition, inner, None)
    return body, lambda inner: inner


def _pipeline_start(work):
    """The thread block's statements, and the index of the one that holds the K/V pipeline (its first
    TMA issue)."""
    stmts = list(work.seq) if isinstance(work, tirx.SeqStmt) else [work]
    return stmts, next(i for i, stmt in enumerate(stmts) if find(stmt, lambda n: is_attr(n, _ISSUE_MARK)))


def _q_tile_visible():
    """Before the K/V pipeline: the threads' stores of the Q tile made visible to wgmma (the async
    proxy), and the barriers' set-up to every thread. Here rather than at the first issue, which may
    sit in a loop of the pipeline's prologue."""
    return [_call("tvmflash_fence_proxy_async"), tirx.Evaluate(T.tvm_storage_sync("shared"))]


def _touches(stmt, buffer):
    """Whether ``stmt`` accesses ``buffer`` (a load, a store or a pointer into it; not a block's
    read or write region)."""
    stores = find(stmt, lambda n: type(n).__name__ == "BufferStore" and n.buffer.same_as(buffer))
    return bool(stores) or _reads_tiles(stmt, [buffer])


def consumer_barriers(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """After ThreadSync: each block-wide barrier inside the consumer warpgroups' branch becomes a
    named barrier that counts their threads only (the producer warpgroup never reaches it)."""
    marked = find(func.body, lambda n: is_attr(n, _CONSUMER_MARK))
    if not marked:
        return func
    consumers = int(marked[0].value)  # the mark's value: how many threads the consumers are

    def name_barriers(node):
        if not is_attr(node, _CONSUMER_MARK):
            return None

        def named(call):
            if call.op.name != "tirx.tvm_storage_sync":
                return call
            return _device_call("tvmflash_named_barrier", CONSUMER_BARRIER, consumers)
        return tvm_ffi.structural_map(node.body, (tvm.ir.Call, named))  # the mark goes: this runs once
    return func.with_body(transform(func.body, tirx.AttrStmt, name_barriers))


def _encode_tensor_maps(plan):
    """Host statements: one tensor map per global tensor, over its (64 elements, row, 64-column half,
    head, batch) view, the box one tile (64, rows, halves, 1, 1), 128-byte swizzle; a row vector's
    (``_row_vector_copy``) over its (row, head, batch) view, the box (rows, 1, 1), no swizzle. The
    strides are the buffer's (the program's stride arguments), in bytes; TMA needs them multiples of
    16 bytes."""
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
            columns = box[0]  # 64: the 128-byte swizzle; 32: 64-byte
            dims = [columns, seqlen, head_dim // columns, heads, batch]
            byte_strides, swizzle = [in_bytes[1], columns * element, in_bytes[2], in_bytes[0]], _TMA_SWIZZLES[columns]
        rank = len(dims)
        stmts.append(tirx.Bind(var, T.tvm_stack_alloca("tensormap", 1)))
        stmts.append(tirx.Evaluate(T.tensormap_encode_tiled(
            var, buffer.data, *dims, *byte_strides, *box, *[1] * (rank - len(box)), *[1] * rank,
            descriptor_dtype=str(buffer.dtype), rank=rank, swizzle=swizzle, l2_promotion=L2_PROMOTION_128B)))
    return stmts


@tvm_ffi.register_error  # so that it reaches ``pipeline.build`` through TVM's pass machinery as itself
class MisalignedTiles(RuntimeError):
    """A TMA tile or a swizzled wgmma operand off the swizzle's 1024-byte boundary."""


_TMA_COPIES_ATTR = "tvmflash.tma_copies"  # set by lowered_to_tma: how many TMA copies it wrote
# a wgmma descriptor's swizzle layout type -> (the boundary its tile starts on, 8 rows of 2 c bytes for rows
# of c columns; how far past one an operand may start, up to a row: a k16 slice of a K-major tile starts 32
# bytes along a row)
_SWIZZLED_OPERANDS = {layout: (16 * c, 2 * c) for c, layout in WGMMA_SWIZZLE_LAYOUTS.items()}


def _shared_byte_offsets(pointer, what, lets, units16=0):
    """The byte offsets in dynamic shared memory that ``pointer`` (``T.address_of(buffer[index])`` or
    ``T.tvm_access_ptr(...)`` into merged "shared.dyn" memory) plus ``units16`` 16-byte units (a wgmma descriptor's offset) takes
    with the let variables of ``lets`` inlined and every other variable at 0, 1, ..., 5. Raises
    RuntimeError where the pointer is not of that form or the index does not fold to a constant:
    an unread tile is never taken for an aligned one."""
    if is_call(pointer, "tirx.tvm_access_ptr"):  # (type annotation, data, offset in elements, extent, mask)
        data, index, element = pointer.args[1], pointer.args[2], tvm.DataType(str(pointer.args[0].ty.dtype))
    elif is_call(pointer, "tirx.address_of") and is_load(pointer.args[0]) and len(pointer.args[0].indices) == 1:
        load = pointer.args[0]
        data, index, element = loaded(load).data, load.indices[0], tvm.DataType(str(loaded(load).dtype))
    else:
        data = None
    if data is None or getattr(data.ty, "storage_scope", None) != "shared.dyn":
        raise RuntimeError(f"TMA alignment check: cannot read where {what} lands in shared memory: {pointer}")
    byte = inlined(index * (element.bits // 8) + units16 * 16, lets)
    variables = find(byte, lambda n: isinstance(n, tirx.Var) and isinstance(n.ty, tvm.ir.PrimType))
    analyzer = tvm.sym.Analyzer()
    for step in range(6):
        at = analyzer.simplify(substitute(byte, [(v, tirx.const(step, v.ty.dtype)) for v in variables]))
        if not isinstance(at, tirx.IntImm):
            raise RuntimeError(f"TMA alignment check: the offset of {what} does not fold to a constant: {byte}")
        yield at.value, byte


def check_tile_alignment(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """After MergeSharedMemoryAllocations (which places the tiles): every TMA destination starts on a
    1024-byte boundary, and every swizzled wgmma operand within the first 128 bytes after one (a k16
    slice of a K-major tile starts 32 bytes further along its rows), as the 128-byte swizzle (of the
    copy and of the wgmma descriptors) assumes. Raises MisalignedTiles where one is off
    (``pipeline.build`` then builds again with larger barriers), rather than let the kernel compute
    garbage; and RuntimeError where a TMA build has no copy or no swizzled operand to check, or one
    the check cannot read."""
    expected = int((func.attrs or {}).get(_TMA_COPIES_ATTR, 0))
    calls = find(func.body, lambda n: is_call(n, "tirx.cuda.func_call"))
    # (pointer, 16-byte units past it, the boundary it needs, how far past the boundary it may start)
    copies = [(c.args[1], 0, _TMA_LOADS[c.args[0].value], 1) for c in calls if c.args[0].value in _TMA_LOADS]
    operands = [(c.args[1], c.args[2], *_SWIZZLED_OPERANDS[int(c.args[5])]) for c in calls
                if c.args[0].value == "tvmflash_wgmma_descriptor" and int(c.args[5]) in _SWIZZLED_OPERANDS]
    if expected and not (copies and operands):
        raise RuntimeError(f"TMA alignment check: the build wrote {expected} TMA copies, but the check finds "
                           f"{len(copies)} TMA copies and {len(operands)} swizzled wgmma operands to check")
    # let variables bound to arithmetic are inlined; one bound to a call (the warpgroup index, a shuffle)
    # stays a variable, as the loop and thread indices do
    lets = [(var, value) for var, value in let_values(func.body) if not find(value, lambda n: isinstance(n, tvm.ir.expr.Call))]
    for pointers, what in ((copies, "a TMA tile"), (operands, "a swizzled wgmma operand")):
        for pointer, units16, boundary, slack in pointers:
            for byte, expression in _shared_byte_offsets(pointer, what, lets, units16):
                if byte % boundary >= slack:
                    raise MisalignedTiles(f"TMA: {what} lands at shared-memory byte {byte}, not on a {boundary}-byte "
                                          f"boundary ({expression}); the copies would be wrong")
    return func


def CheckTileAlignment():  # noqa: N802
    """``check_tile_alignment``, as a pass."""
    return prim_func_pass(check_tile_alignment, "tvmflash.CheckTileAlignment")


def LowerToTMA():  # noqa: N802 - named as TVM's passes are
    """Right after InjectSoftwarePipeline: the TMA_LOAD copies on TMA (``lowered_to_tma``; its barriers
    grown by the function's ``TMA_BARRIER_PADDING_ATTR`` bytes)."""
    return prim_func_pass(lowered_to_tma, "tvmflash.LowerToTMA")


def NameConsumerBarriers():  # noqa: N802
    """After the last ThreadSync: ``consumer_barriers``."""
    return prim_func_pass(consumer_barriers, "tvmflash.NameConsumerBarriers")
