"""Streamed tiles by TMA: the software pipeline's cp.async copies become tensor-memory-accelerator
copies completing on mbarriers (sm_90a). The forward's K/V tiles; the backward dkdv's Q blocks (q
and dout as the forward's K and V, and the rows' lse and delta, ``tma_plan._row_vector_copy``).

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
  * a loop annotated ``TMA_REDUCE_PRAGMA`` becomes one TMA reduction a warpgroup
    (``tma_reductions``);
  * the host encodes one tensor map per global tensor (``tensormap_encode_tiled``: the 5-D view
    (64 elements, row, 64-column half, head, batch), 128-byte swizzle; a row vector's 3-D (row, head,
    batch), no swizzle), which reaches the kernel as a ``__grid_constant__`` parameter
    (``tma_tensor_maps``).

Phases: a thread's k-th wait on the full barriers is for tile k, in stage k % num_stages, phase
(k // num_stages) % 2; the producer counts its issues the same way. Each is a per-thread counter
in a register, so the pipeline's index expressions are never parsed.

The producer thread initialises the barriers first thing; right before the pipeline one
``fence.proxy.async`` and barrier make the Q tile's stores visible to wgmma (``tma_plan.q_tile_visible``).
An annotated copy before the pipeline (the Q tile, ``q_copy="tma"``) becomes one TMA copy on a
barrier of its own, which every thread waits on (``_one_off_copy``). With the sm90 schedule's
``overlap``, V has one stage more than K and a step reads V of the tile before the one it waits for;
``_waits_and_releases`` says how the waits and releases follow.

Who issues (the annotation's value, one of ``TMA_PRODUCERS``): "thread", thread 0 of the first
warpgroup, between its own wgmma; or "warpgroup", FA3's producer warpgroup
(``tma_producer_warpgroup``): one more warpgroup (threadIdx.y == the number of consumer warpgroups)
runs the pipeline sliced down to its issues, gives its registers to the consumers by setmaxnreg (24
and 240 a thread), and the consumers' block-wide barriers become named barriers that count them
only (after ThreadSync). The releases follow each stage's last reader's commit and wait
(``_only_commits_or_waits``). Every build's TMA destinations are checked to sit on 1024-byte
boundaries (``tile_alignment``): shared-memory merging places them, and a build that finds them off
grows the barriers (``annotations.TMA_BARRIER_PADDINGS``, ``pipeline.build``) and builds again. The
barriers and TMA's shared-memory pointers are not accesses that ThreadSync counts
(``tma_device_functions.untracked_pointer``).
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from tvmflash.lowering.annotations import PERSISTENT_WALK, TMA_LOAD
from tvmflash.lowering.ir import CALL, find, find_attrs, is_attr, is_call, prim_func_pass, transform, unmarked
from tvmflash.lowering.tile_alignment import TMA_COPIES_ATTR
from tvmflash.lowering.tma_device_functions import TMA_LOADS, device_call, device_statement
from tvmflash.lowering.tma_plan import ISSUE_MARK, Plan, q_tile_visible, reads_tiles, tile_copy
from tvmflash.lowering.tma_producer_warpgroup import split_warpgroups, walk_warpgroups
from tvmflash.lowering.tma_reductions import reductions_on_tma
from tvmflash.lowering.tma_tensor_maps import encode_tensor_maps
from tvmflash.lowering.tvm_fixes import LAUNCH_BOUNDS_ATTRS

MIN_BLOCKS_ATTR = LAUNCH_BOUNDS_ATTRS[0]  # tirx.launch_bounds_min_blocks_per_sm

_WAIT_MARK, _RELEASED_MARK = "tvmflash.tma_wait", "tvmflash.tma_released"  # on the tile waits, during the pass


def _issue(plan, commit):
    """A commit group of annotated copies -> the producer thread's TMA issue, on the stage of the tile
    with the most stages (V's, with overlap): every copy of the group completes on that stage's full
    barrier, whichever version of its own tile it fills (K's stage differs with overlap).

    Before it refills a stage the producer waits for the release that frees it: tile t's, for tile
    t + num_stages. With overlap K has one version fewer, so tile t overwrites K of tile
    t - num_stages + 1, whose QK^T the consumers wait for one step before they release the stage
    that V of tile t needs. There the release is counted per wait for all wgmma, the pipeline's
    first one included (``_waits_and_releases``), and tile t waits for release t - num_stages + 1."""
    scopes = find_attrs(commit.body, "async_scope")
    copies = [tile_copy(plan, scope.body) for scope in scopes]
    stage = max((c[0] for c in copies), key=lambda s: s[1])[0]
    issued = plan.issued[0]
    if plan.persistent:  # parity 1 of a barrier that never completed a phase passes at once (CUTLASS's
        # producer start state), so no test of the count: a persistent walk's stage may have been filled by an
        # earlier tile
        if len({c[0][1] for c in copies}) != 1:
            raise RuntimeError("TMA: a persistent walk takes tiles of as many versions as stages (no overlap)")
        lag = 0
        refill = device_call("tvmflash_mbarrier_wait", plan.empty(stage), tirx.bitwise_xor(plan.parity(issued, stage), 1))
    elif len({c[0][1] for c in copies}) == 1:  # the tile's copies have as many versions as stages
        lag = plan.num_stages
        refill = device_call("tvmflash_mbarrier_wait", plan.empty(stage),
                              tirx.floormod(tirx.floordiv(issued, plan.num_stages) + 1, 2))
    else:  # overlap: K has one version fewer
        lag = plan.num_stages - 1
        release = issued - lag
        refill = device_call("tvmflash_mbarrier_wait", plan.empty(tirx.floormod(release, plan.num_stages)),
                              tirx.floormod(tirx.floordiv(release, plan.num_stages), 2))
    body = [
        tirx.Evaluate(refill) if plan.persistent  # the release that frees this tile's buffers
        else tirx.IfThenElse(issued >= lag, tirx.Evaluate(refill), None),
        device_statement("tvmflash_mbarrier_expect_tx", plan.full(stage), sum(c[2] for c in copies)),
        *[c[1](plan.full(stage)) for c in copies],
        tirx.BufferStore(plan.issued, issued + 1, [0]),
    ]
    return tirx.IfThenElse(plan.is_producer(), tirx.SeqStmt(body), None)


def _wait_for_next_tile(plan):
    """Every thread waits for the oldest tile in flight on its stage's full barrier."""
    consumed = plan.consumed[0]
    stage = tirx.floormod(consumed, plan.num_stages)
    return [device_statement("tvmflash_mbarrier_wait", plan.full(stage), plan.parity(consumed, stage)),
            tirx.BufferStore(plan.consumed, consumed + 1, [0])]


def _names_tma_issue(node):
    return (type(node).__name__ == "Call" and node.op.name == "tirx.cuda.func_call"
            and node.args[0].value in TMA_LOADS)


def _only_commits_or_waits(stmt):
    """Whether ``stmt`` only commits wgmma groups or waits for them."""
    calls = find(stmt, CALL)
    return bool(calls) and all(c.op.name.startswith("tirx.ptx.wgmma") and any(
        getattr(a, "value", None) in ("commit_group", "wait_group") for a in c.args) for c in calls)


def _waits_all(stmt):
    """Whether ``stmt`` waits for every committed wgmma group (``wgmma.wait_group 0``)."""
    return bool(find(stmt, CALL, lambda n: n.op.name.startswith("tirx.ptx.wgmma")
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
        return reads_tiles(transform(stmt, tirx.AttrStmt, lambda n: tirx.Evaluate(0) if is_attr(n, ISSUE_MARK)
                                       else None), which)

    def rewrite(node):
        seq = list(node.seq)
        marked = [i for i, s in enumerate(seq) if find_attrs(s, _WAIT_MARK)]
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
                    device_statement("tvmflash_release_after_wgmma", plan.empty(tirx.floormod(released, plan.num_stages))),
                    tirx.BufferStore(plan.released, released + 1, [0])]))
            else:  # under the reader's predicate too: a pipeline of no step (dkdv's K/V block that no
                # query sees) runs its epilogue's statements under a false one
                stage = tirx.floormod(plan.consumed[0] - 1, plan.num_stages)
                seq.insert(last + 1, _guarded(seq[readers[-1]], [
                    device_statement("tvmflash_release_after_wgmma", plan.empty(stage))]))
        k_readers = [i for i in range(marked[0], len(seq)) if reads(seq[i], early)]
        if k_readers:
            first = marked[0]
            while first > 0 and not find(seq[first - 1], (tirx.For, CALL),
                                         lambda n: isinstance(n, tirx.For) or _names_tma_issue(n)):
                first -= 1
            wait = _wait_for_next_tile(plan)  # under the predicate of the (K) tile's first reader
            seq[first:first] = [_guarded(seq[k_readers[0]], wait)]
        return transform(tirx.SeqStmt(seq), tirx.AttrStmt, lambda n: tirx.AttrStmt(
            n.node, _RELEASED_MARK, n.value, n.body) if is_attr(n, _WAIT_MARK) else None)
    return transform(stmt, tirx.SeqStmt, rewrite)


def lowered_to_tma(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` after InjectSoftwarePipeline, with its TMA_LOAD copies on TMA (module docstring);
    unchanged if it has none."""
    if not find(func.body, tvm.s_tir.SBlock, lambda n: TMA_LOAD in n.annotations):
        return func
    if len(find(func.body, tvm.s_tir.SBlock, lambda n: n.name_hint == "tile")) != 1:
        raise RuntimeError("TMA: expected one block named 'tile' (the per-thread-block scope)")
    plan = Plan(func)
    commits = find_attrs(func.body, "async_commit_queue_scope")
    waits = find_attrs(func.body, "async_wait_queue_scope")
    tiles = []
    for commit in commits:
        for scope in find_attrs(commit.body, "async_scope"):
            for block in find(scope.body, tvm.s_tir.SBlock, lambda n: TMA_LOAD in n.annotations):
                tiles.append(block.body.buffer)

    def rewrite(node):
        if is_attr(node, "async_commit_queue_scope"):
            return tirx.AttrStmt(0, ISSUE_MARK, 1, _issue(plan, node))
        if is_attr(node, "async_wait_queue_scope"):
            inner = node.body.body if is_attr(node.body, "async_wait_inflight_count") else node.body
            return tirx.AttrStmt(0, _WAIT_MARK, 1, inner)
        return None

    if len(commits) < 1 or len(waits) < 1:
        raise RuntimeError("TMA: the annotated copies are not in a software pipeline's async stage")
    body = transform(func.body, tirx.AttrStmt, rewrite)
    body = _waits_and_releases(plan, body, tiles)
    body = reductions_on_tma(plan, body)

    body = unmarked(body, _RELEASED_MARK)

    def allocate(node):  # barriers and counters in the per-thread-block scope, counters at 0
        if not (isinstance(node, tvm.s_tir.SBlock) and node.name_hint == "tile"):
            return None
        buffers = [*node.alloc_buffers, plan.barriers, plan.consumed, plan.issued, plan.released]
        inside, under_test = _inside_run_if(node.body)
        stmts, k = _pipeline_start(inside)
        stmts, q_issue = _one_off_copy(plan, stmts, k)
        if plan.producer == "warpgroup":
            work, moved = split_warpgroups(plan, stmts, k, q_issue, node.alloc_buffers)
            buffers = [b for b in buffers if not any(b.same_as(m) for m in moved)]
        else:  # the producer thread sets the barriers up first (and issues Q); the pipeline starts once Q is in
            init = [tirx.IfThenElse(plan.is_producer(), tirx.SeqStmt(plan.barrier_init()), None)]
            if q_issue is not None:  # every thread waits on the Q barrier: its set-up must be seen first
                init += [tirx.Evaluate(T.tvm_storage_sync("shared")), q_issue]
            work = unmarked(tirx.SeqStmt([*init, *stmts[:k], *q_tile_visible(), *stmts[k:]]), ISSUE_MARK)
        start = under_test(tirx.SeqStmt([*[tirx.BufferStore(b, 0, [0]) for b in (plan.consumed, plan.issued,
                                                                                 plan.released)], work]))
        return tvm.s_tir.SBlock(node.iter_vars, node.reads, node.writes, node.name_hint, start, node.init,
                                buffers, node.match_buffers, node.annotations)
    if plan.persistent:
        body = transform(body, tirx.For, lambda n: _persistent_walk(plan, n) if PERSISTENT_WALK in n.annotations else None)
    else:
        body = transform(body, tvm.s_tir.SBlock, allocate)
    if plan.producer == "warpgroup":  # one more warpgroup: threadIdx.y runs over it too
        body = transform(body, tirx.For, lambda n: tirx.For(
            n.loop_var, n.min, n.extent + 1, n.kind, n.body, n.thread_binding, n.annotations)
            if n.thread_binding is not None and n.thread_binding.thread_tag == "threadIdx.y" else None)
    copies = len(find(body, CALL, _names_tma_issue))
    func = func.with_body(_after_declarations(body, encode_tensor_maps(plan), plan.tensor_maps)).with_attr(
        TMA_COPIES_ATTR, copies)
    if plan.persistent:  # a thread block an SM, said to ptxas: with __launch_bounds__(threads) alone it may leave
        # the register count at the kernel's entry open and then ignore setmaxnreg (C7508), its consumers held to
        # 65536 / threads registers (d64's dkdv spilled so)
        func = func.with_attr(MIN_BLOCKS_ATTR, 1)
    return func


def _persistent_walk(plan, loop):
    """A persistent walk (``annotations.PERSISTENT_WALK``: ``loop`` over the thread block's tiles, its
    body the "tile" block under the predicate that the walk's last step has a tile) -> one block that
    sets the barriers up once, then walks the tiles: the producer's copies and the consumers' work each in
    a walk of their own (``tma_producer_warpgroup.walk_warpgroups``), or with thread 0 as the producer
    one walk. The counters count one tile's copies and waits, from 0 (the pipeline's stages are its steps
    mod num_stages, from 0 each tile); after a tile its phases go into ``plan.phases``, so that each wait
    is for its barrier's next phase whatever the tiles before did. Each tile's work starts at a barrier of
    the threads that do it: its K and V overwrite the last tile's, which the slowest warpgroup may still read."""
    realize = loop.body
    if not (isinstance(realize, tvm.s_tir.SBlockRealize) and realize.block.name_hint == "tile"):
        raise RuntimeError("TMA: a persistent walk's body must be the 'tile' block")
    block = realize.block
    inside, _ = _inside_run_if(block.body)
    if not inside.same_as(block.body):
        raise RuntimeError("TMA: a persistent walk takes no tile that runs only under a test (varlen's)")
    stmts, k = _pipeline_start(block.body)
    stmts, q_issue = _one_off_copy(plan, stmts, k)
    if q_issue is not None:
        raise RuntimeError("TMA: a persistent walk takes no one-off copy before the pipeline")
    uniform = T.tvm_thread_invariant(realize.predicate)

    def walk(counter, stmt, sync=True):  # the tiles, each from its counter at 0 to its phases added up
        tile = tirx.SeqStmt([tirx.BufferStore(counter, 0, [0]),
                             *([tirx.Evaluate(T.tvm_storage_sync("shared"))] if sync else []), stmt,
                             plan.tile_done(counter)])
        return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL,
                        tirx.IfThenElse(uniform, tile, None), annotations={PERSISTENT_WALK: 1})

    buffers = [*block.alloc_buffers, plan.barriers, plan.consumed, plan.issued, plan.phases]
    if plan.producer == "warpgroup":
        work, hoisted = walk_warpgroups(plan, stmts, k, walk)
        buffers += hoisted
    else:  # thread 0 issues and consumes: both of its counts from 0 a tile (equal at its end)
        tile = tirx.SeqStmt([tirx.BufferStore(plan.issued, 0, [0]),
                             unmarked(tirx.SeqStmt([*stmts[:k], *q_tile_visible(), *stmts[k:]]), ISSUE_MARK)])
        work = tirx.SeqStmt([tirx.IfThenElse(plan.is_producer(), tirx.SeqStmt(plan.barrier_init()), None),
                             walk(plan.consumed, tile)])
    start = tirx.SeqStmt([*[tirx.BufferStore(b, 0, [0]) for b in (plan.consumed, plan.issued, plan.phases)], work])
    return tvm.s_tir.SBlockRealize([], True, tvm.s_tir.SBlock([], [], [], "tile", start, None, buffers))


def _after_declarations(body, stmts, buffers):
    """``body`` with ``stmts`` (host statements that read ``buffers``) before everything but the
    declarations of those buffers (the program's strided views of its arguments)."""
    def declares(node):
        return isinstance(node, tirx.DeclBuffer) and any(node.buffer.same_as(b) for b in buffers)

    found = find(body, tirx.SeqStmt, lambda n: any(declares(s) for s in n.seq))
    if not found:
        return tirx.SeqStmt([*stmts, body])
    seq = found[0]
    k = max(i for i, s in enumerate(seq.seq) if declares(s)) + 1
    return transform(body, tirx.SeqStmt, lambda n: tirx.SeqStmt([*seq.seq[:k], *stmts, *seq.seq[k:]])
                      if n.same_as(seq) else None)


def _one_off_copy(plan, stmts, k):
    """The Q tile's TMA copy (a ``TMA_LOAD`` block before the pipeline, ``q_copy="tma"``; dkdv's K and V
    tiles with ``dkdv_kv_copy="tma"``, both on the one barrier): the first one's statement in ``stmts``
    becomes every thread's wait on the Q barrier. Returns the statements and
    the issue, by thread 0 of the first warpgroup (None without such a copy). Not the producer
    warpgroup's: the Q tile then stays the consumers' own, so that the output's staging may reuse
    its memory (``split_warpgroups``)."""
    copies = [i for i, stmt in enumerate(stmts[:k])
              if find(stmt, tvm.s_tir.SBlock, lambda n: TMA_LOAD in n.annotations)]
    if not copies:
        return stmts, None
    if any(len(find(stmts[i], tvm.s_tir.SBlock)) != 1 for i in copies):
        raise RuntimeError("TMA: expected the copy blocks outside the pipeline (the Q tile; dkdv's K and V tiles) "
                           "each alone in its statement")
    # several (dkdv_kv_copy "tma": K and V) go on the one barrier, the bytes of all expected at once
    plan.q_copy = stmts[copies[0]]
    calls, size = [], 0
    for i in copies:
        _, call, bytes_ = tile_copy(plan, stmts[i])
        calls.append(call(plan.q_full()))
        size = size + bytes_
    issue = tirx.SeqStmt([device_statement("tvmflash_mbarrier_expect_tx", plan.q_full(), size), *calls])
    wait = device_statement("tvmflash_mbarrier_wait", plan.q_full(), 0)
    first = tirx.all(*[var == 0 for tag, (var, _) in plan.threads.items() if tag.startswith("threadIdx")])
    # the first copy's statement becomes the wait, the others nothing (``k`` keeps pointing at the pipeline)
    stmts = [wait if i == copies[0] else tirx.Evaluate(0) if i in copies else stmt for i, stmt in enumerate(stmts)]
    return stmts, tirx.IfThenElse(first, issue, None)


def _inside_run_if(body):
    """A tile's body and a function that puts a body back where it was: under the uniform test that
    ``loops_and_blocks.RunBlocksIf`` wraps a tile in (varlen's Q blocks past their sequence), the statements
    inside it, so that the Q tile's proxy fence (``q_tile_visible``) lands after the Q tile's stores
    and not before the test, ahead of them."""
    if (isinstance(body, tirx.IfThenElse) and body.else_case is None
            and is_call(body.condition, "tirx.tvm_thread_invariant")):
        return body.then_case, lambda inner: tirx.IfThenElse(body.condition, inner, None)
    return body, lambda inner: inner


def _pipeline_start(work):
    """The thread block's statements, and the index of the one that holds the K/V pipeline (its first
    TMA issue)."""
    stmts = list(work.seq) if isinstance(work, tirx.SeqStmt) else [work]
    return stmts, next(i for i, stmt in enumerate(stmts) if find_attrs(stmt, ISSUE_MARK))


def LowerToTMA():  # noqa: N802 - named as TVM's passes are
    """Right after InjectSoftwarePipeline: the TMA_LOAD copies on TMA (``lowered_to_tma``; its barriers
    grown by the function's ``TMA_BARRIER_PADDING_ATTR`` bytes)."""
    return prim_func_pass(lowered_to_tma, "tvmflash.LowerToTMA")
