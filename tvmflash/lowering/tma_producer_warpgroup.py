"""The TMA lowering's producer="warpgroup" (FA3's producer warpgroup): one more warpgroup issues the
copies (``split_warpgroups``), and the consumer warpgroups' block-wide barriers become named barriers
that count them only (``NameConsumerBarriers``, after ThreadSync)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.script import tirx as T

from tvmflash.lowering.ir import CALL, find, find_attrs, is_attr, prim_func_pass, transform, unmarked
from tvmflash.lowering.tma_device_functions import device_call, device_statement
from tvmflash.lowering.tma_plan import ISSUE_MARK, q_tile_visible, reads_tiles

_CONSUMER_MARK = "tvmflash.tma_consumers"  # around the consumer warpgroups' code, until their barriers are named
CONSUMER_BARRIER = 1  # named barrier id of the consumer warpgroups (0 is __syncthreads)


def split_warpgroups(plan, stmts, k, q_issue, tile_buffers):
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
        return len(find_attrs(stmt, ISSUE_MARK))

    def only_issues(seq):  # a sequence that holds issues keeps just those (an issue's own sequence stays whole)
        if not issues(seq):
            return seq
        kept = [s for s in seq.seq if issues(s)]
        return tirx.SeqStmt(kept) if len(kept) > 1 else kept[0]

    moved = []
    before, after, total = stmts[:k], stmts[k + 1:], issues(stmts[k])
    # a trip count read from memory (``loops_and_blocks.BindLoadedPipelineExtents``: a BlockMask's list)
    # stays before the branch: both sides run the pipeline's loop
    counts = [s for s in before if isinstance(s, tirx.Bind) and s.var.name.endswith("_extent")]
    before = [s for s in before if not any(s.same_as(c) for c in counts)]
    y = plan.threads["threadIdx.y"][0]
    warpgroup = tirx.const(plan.producer_warpgroup, "int32")

    def split(block):  # the innermost block that holds every issue
        if issues(block.body) != total or any(issues(b.body) == total for b in find(
                block.body, tvm.s_tir.SBlock)):
            return None
        producer = unmarked(tvm_ffi.structural_map(block.body, (tirx.SeqStmt, only_issues)), ISSUE_MARK)
        if find(producer, CALL, lambda n: n.op.name in ("tirx.ptx.wgmma", "tirx.tvm_storage_sync")):
            raise RuntimeError("TMA: the producer warpgroup's slice of the K/V pipeline kept consumer work")
        pipeline = transform(block.body, tirx.AttrStmt,
                              lambda n: tirx.Evaluate(0) if is_attr(n, ISSUE_MARK) else None)
        consumers = tirx.SeqStmt([device_statement("tvmflash_setmaxnreg_inc"), *([q_issue] if q_issue else []), *before,
                                  *q_tile_visible(), pipeline, *after])
        moved.extend(b for b in tile_buffers if b.scope() == "shared.dyn" and not _touches(producer, b))
        consumers = tvm.s_tir.SBlockRealize([], True, tvm.s_tir.SBlock([], [], [], "consumers", consumers,
                                                                       alloc_buffers=moved))
        body = tirx.IfThenElse(T.tvm_thread_invariant(tirx.EQ(y, warpgroup)),
                               tirx.SeqStmt([device_statement("tvmflash_setmaxnreg_dec"), producer]),
                               tirx.AttrStmt(0, _CONSUMER_MARK, plan.block_threads, consumers))
        return tvm.s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body, block.init,
                                block.alloc_buffers, block.match_buffers, block.annotations)

    setup = tirx.IfThenElse(tirx.all(tirx.EQ(y, warpgroup), plan.is_producer()),
                            tirx.SeqStmt(plan.barrier_init()), None)
    split_work = transform(stmts[k], tvm.s_tir.SBlock, split)
    return tirx.SeqStmt([*counts, setup, tirx.Evaluate(T.tvm_storage_sync("shared")), split_work]), moved


def walk_warpgroups(plan, stmts, k, walk):
    """``split_warpgroups`` for a persistent walk (``tma_copies._persistent_walk``): one tile's statements
    (``stmts``, the pipeline in ``stmts[k]``) split between the producer warpgroup and the consumers, each
    side walking the tiles in a loop of its own (``walk(counter, stmt, sync)``, ``counter`` the side's count of
    copies or waits; the producer's with no barrier) inside one branch, so that setmaxnreg runs once and the producer fills the next tile's
    stages while the consumers finish this one. The barriers are set up before the branch. Returns that and
    the buffers of the blocks both sides keep (those around the copies), which the caller allocates once:
    a block in both walks would allocate its buffers twice."""
    def issues(stmt):
        return len(find_attrs(stmt, ISSUE_MARK))

    def only_issues(seq):
        if not issues(seq):
            return seq
        kept = [s for s in seq.seq if issues(s)]
        return tirx.SeqStmt(kept) if len(kept) > 1 else kept[0]

    if any(isinstance(s, tirx.Bind) and s.var.name.endswith("_extent") for s in stmts[:k]):
        raise RuntimeError("TMA: a persistent walk takes no trip count read from memory (a BlockMask's)")
    hoisted = []

    def unallocated(block):  # a block around the copies, both sides keep it: its buffers go up to the walk's
        if not issues(block.body):
            return None
        hoisted.extend(block.alloc_buffers)
        return tvm.s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, block.body, block.init,
                                [], block.match_buffers, block.annotations)
    pipeline = transform(stmts[k], tvm.s_tir.SBlock, unallocated)
    producer = unmarked(tvm_ffi.structural_map(pipeline, (tirx.SeqStmt, only_issues)), ISSUE_MARK)
    if find(producer, CALL, lambda n: n.op.name in ("tirx.ptx.wgmma", "tirx.tvm_storage_sync")):
        raise RuntimeError("TMA: the producer warpgroup's slice of the K/V pipeline kept consumer work")
    pipeline = transform(pipeline, tirx.AttrStmt, lambda n: tirx.Evaluate(0) if is_attr(n, ISSUE_MARK) else None)
    consumers = tirx.SeqStmt([device_statement("tvmflash_setmaxnreg_inc"), walk(plan.consumed, tirx.SeqStmt(
        [*stmts[:k], *q_tile_visible(), pipeline, *stmts[k + 1:]]))])
    y = plan.threads["threadIdx.y"][0]
    warpgroup = tirx.const(plan.producer_warpgroup, "int32")
    setup = tirx.IfThenElse(tirx.all(tirx.EQ(y, warpgroup), plan.is_producer()), tirx.SeqStmt(plan.barrier_init()), None)
    branch = tirx.IfThenElse(T.tvm_thread_invariant(tirx.EQ(y, warpgroup)),
                             tirx.SeqStmt([device_statement("tvmflash_setmaxnreg_dec"), walk(plan.issued, producer, sync=False)]),
                             tirx.AttrStmt(0, _CONSUMER_MARK, plan.block_threads, consumers))
    return tirx.SeqStmt([setup, tirx.Evaluate(T.tvm_storage_sync("shared")), branch]), hoisted


def _touches(stmt, buffer):
    """Whether ``stmt`` accesses ``buffer`` (a load, a store or a pointer into it; not a block's
    read or write region)."""
    stores = find(stmt, tirx.BufferStore, lambda n: n.buffer.same_as(buffer))
    return bool(stores) or reads_tiles(stmt, [buffer])


def consumer_barriers(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """After ThreadSync: each block-wide barrier inside the consumer warpgroups' branch becomes a
    named barrier that counts their threads only (the producer warpgroup never reaches it)."""
    marked = find_attrs(func.body, _CONSUMER_MARK)
    if not marked:
        return func
    consumers = int(marked[0].value)  # the mark's value: how many threads the consumers are

    def name_barriers(node):
        if not is_attr(node, _CONSUMER_MARK):
            return None

        def named(call):
            if call.op.name != "tirx.tvm_storage_sync":
                return call
            return device_call("tvmflash_named_barrier", CONSUMER_BARRIER, consumers)
        return tvm_ffi.structural_map(node.body, (tvm.ir.Call, named))  # the mark goes: this runs once
    return func.with_body(transform(func.body, tirx.AttrStmt, name_barriers))


def NameConsumerBarriers():  # noqa: N802
    """After the last ThreadSync: ``consumer_barriers``."""
    return prim_func_pass(consumer_barriers, "tvmflash.NameConsumerBarriers")
