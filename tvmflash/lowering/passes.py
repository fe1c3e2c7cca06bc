"""tvmflash's own lowering passes (other than TMA, ``tma.py``): what the schedules ask of the lowering
through annotations and pragmas, and changes to TVM's lowering that TVM has no knob for. Each is a pass
in ``pipeline.py``'s list."""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm import tirx
from tvm.script import tirx as T

from tvmflash.lowering.annotations import (ATOMIC_ADD_PRAGMA, REG_FENCE, REVERSED, RUNS_IF, SKIP_UNIT_RESCALE_PRAGMA,
                                           WGMMA_WAIT_PRAGMA)
from tvmflash.lowering.ir import (every_element, find, folded, is_call, is_load, loaded, loaded_buffers, map_loops, prim_func_pass,
                                  substitute, transform, with_children)


# ---------------------------------------------------------------------------------- reversed loops
def _reversed(loop):
    if REVERSED not in loop.annotations:
        return loop
    old = loop.loop_var
    new = type(old)(old.name, old.ty)
    flipped = loop.min + loop.extent - 1 - new
    body = substitute(loop.body, [(old, flipped)])
    annotations = {key: value for key, value in loop.annotations.items() if key != REVERSED}
    return tirx.For(new, loop.min, loop.extent, loop.kind, body, loop.thread_binding, annotations)


def ReverseLoops():  # noqa: N802 - named as TVM's passes are
    """Each loop annotated ``REVERSED`` visits its iterations last to first: its variable i becomes
    min + extent - 1 - i in the body. The schedules use it on a loop bound to blockIdx, whose
    iterations are independent thread blocks, to choose the order the GPU starts them in. TensorIR's
    Schedule has no primitive that reverses a loop."""
    return prim_func_pass(lambda func: func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, _reversed))),
                          "tvmflash.ReverseLoops")


# ---------------------------------------------------------------------------------- guarded blocks
def _run_if(block):
    if RUNS_IF not in block.annotations:
        return block
    annotations = {key: value for key, value in block.annotations.items() if key != RUNS_IF}
    # the same for every thread of the block: ThreadSync then places barriers under it
    uniform = T.tvm_thread_invariant(block.annotations[RUNS_IF])
    return tvm.s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint,
                            tirx.IfThenElse(uniform, block.body, None), block.init, block.alloc_buffers,
                            block.match_buffers, annotations)


def RunBlocksIf():  # noqa: N802
    """Before the blocks are lowered: a block annotated ``RUNS_IF`` (by the program) runs its body only
    where that condition of its iteration variables holds. On a GPU the block is a thread block, so
    the test is uniform: varlen's Q blocks past their own sequence's end return at once instead of
    loading a Q block of zeros and running a masked K/V tile."""
    def run(func):
        return func.with_body(tvm_ffi.structural_map(func.body, (tvm.s_tir.SBlock, _run_if)))
    return prim_func_pass(run, "tvmflash.RunBlocksIf")


# ---------------------------------------------------------------------------------- loaded extents
def _extent_bound(loop):
    """A pipelined loop whose extent reads a buffer, as that value bound to a variable first."""
    if "software_pipeline_stage" not in loop.annotations or not find(
            loop.extent, lambda n: type(n).__name__ in ("TensorLoad", "BufferLoad")):
        return loop
    # A constant floor stays in sight: the program's max(min_kv_tiles, count) keeps the pipeline's
    # epilogue unguarded (``sm90.min_kv_tiles``); under a guard, varlen's sm90 wgmma spilled 2.6 KB.
    floor, counted = None, loop.extent
    if isinstance(loop.extent, tirx.Max):
        for a, b in ((loop.extent.a, loop.extent.b), (loop.extent.b, loop.extent.a)):
            if isinstance(a, tirx.IntImm):
                floor, counted = a, b
                break
    bound = tirx.Var(f"{loop.loop_var.name}_extent", loop.extent.ty)
    extent = bound if floor is None else tirx.Max(floor, bound)
    return tirx.SeqStmt([tirx.Bind(bound, counted),
                         tirx.For(loop.loop_var, loop.min, extent, loop.kind, loop.body, loop.thread_binding,
                                  loop.annotations)])


def BindLoadedPipelineExtents():  # noqa: N802
    """Before InjectSoftwarePipeline: a pipelined loop whose trip count is read from memory (decode's
    K/V loop runs over its sequence's tiles, from ``cache_seqlens``) gets it bound to a variable first.
    The pipeline's guards (``kb + 1 < extent`` in a loop of extent - 1 steps) then simplify as over
    any symbolic extent; over the buffer load they did not, and the cp.async wait count was left an
    ``if_then_else``, which the CUDA code generator rejects. Loops with other extents are untouched."""
    return prim_func_pass(lambda func: func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, _extent_bound))),
                          "tvmflash.BindLoadedPipelineExtents")


# ---------------------------------------------------------------------------------- pragmas
def _wait_and_fence_accumulators(attr):
    """The statements for a ``WGMMA_WAIT_PRAGMA`` AttrStmt: ``wgmma.wait_group 0``, a register fence
    of each element of the accumulators its loop reads (local float32 buffers whose names start with
    the pragma's value where it is a string, else with ``acc``), then the loop."""
    prefix = attr.value.value if isinstance(attr.value, tvm.ir.StringImm) else "acc"
    accumulators = [buffer for name, buffer in loaded_buffers(attr.body).items()
                    if name.startswith(prefix) and buffer.scope() == "local" and str(buffer.dtype) == "float32"]
    fences = [tirx.Evaluate(T.cuda.func_call("tvmflash_wgmma_reg_fence", element, source_code=REG_FENCE))
              for buffer in accumulators for element in every_element(buffer)]
    wait = tirx.Evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
    return tirx.SeqStmt([wait, *fences, attr.body])


def _skipped_where_factors_are_one(attr):
    """The statement for a ``SKIP_UNIT_RESCALE_PRAGMA`` AttrStmt: its loop, ``x[i] = x[i] * f[...]``
    over the elements a thread holds, run only where some lane of the warp has a factor other than 1
    (``__any_sync`` over every element of the thread's factor buffers ``f``: a branch the whole warp
    takes or skips, which nvcc keeps as a branch; a per-thread test became a predicate on each
    multiply)."""
    scaled = {store.buffer.name for store in find(attr.body, lambda n: type(n).__name__ == "BufferStore")}
    factors = {name: buffer for name, buffer in loaded_buffers(attr.body).items() if name not in scaled}
    if len(scaled) != 1 or not factors or any(b.scope() != "local" for b in factors.values()):
        raise ValueError(f"{attr.attr_key}: expected a loop that scales one buffer by local factors, got "
                         f"stores to {sorted(scaled)} and factors {sorted(factors)}")
    not_one = [element != tirx.const(1, buffer.dtype) for buffer in factors.values() for element in every_element(buffer)]
    some_lane = tirx.call_extern("bool", "__any_sync", tirx.const(0xFFFFFFFF, "uint32"), functools.reduce(tirx.Or, not_one))
    return tirx.IfThenElse(some_lane, attr.body, None)


def _atomic_add(store):
    """``x[i] = x[i] + y`` as ``atomicAdd(&x[i], y)`` (its result unused: nvcc emits a ``red``)."""
    return tirx.Evaluate(T.cuda.atomic_add(_address(store), _addend(store)))


def _addend(store):
    """y of a store ``x[i] = x[i] + y``."""
    value = store.value
    if not (isinstance(value, tirx.Add) and is_load(value.a) and loaded(value.a).same_as(store.buffer)
            and tvm_ffi.structural_equal(list(value.a.indices), list(store.indices))):
        raise ValueError(f"{ATOMIC_ADD_PRAGMA}: expected stores x[i] = x[i] + y, got {store}")
    return value.b


def _address(store):
    return tirx.call_intrin("handle", "tirx.address_of", tirx.BufferLoad(store.buffer, store.indices))


RED_ADD_V2 = ("__device__ __forceinline__ void tvmflash_red_add_v2(float* address, float a, float b) "
              '{ asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(address), "f"(a), "f"(b) : "memory"); }')


def _paired_atomic_add(loop):
    """A loop of two float32 additions to adjacent elements (x[i + e] = x[i + e] + y[e], e = 0, 1, i
    even) as one vector reduction (``red.global.add.v2.f32``, sm_90): half the atomic operations."""
    store = loop.body
    if not (int(loop.extent) == 2 and type(store).__name__ == "BufferStore" and str(store.buffer.dtype) == "float32"):
        return None
    first, second = (substitute(store, [(loop.loop_var, loop.min + e)]) for e in range(2))
    *outer_first, last_first = first.indices
    *outer_second, last_second = second.indices
    if not (tvm_ffi.structural_equal(outer_first, outer_second)
            and tvm.sym.Analyzer().can_prove_equal(last_second - last_first, 1)):
        return None
    return tirx.Evaluate(T.cuda.func_call("tvmflash_red_add_v2", _address(first), _addend(first), _addend(second),
                                          source_code=RED_ADD_V2))


def _atomic_adds(attr, vector: bool):
    """The statement for an ``ATOMIC_ADD_PRAGMA`` AttrStmt: its loop, each store an atomic addition;
    with ``vector`` (sm_90, and the pragma's value 2), each loop over two adjacent elements one vector
    reduction."""
    body = attr.body
    if vector and int(attr.value) == 2:
        body = transform(body, tirx.For, _paired_atomic_add)
    return transform(body, tirx.BufferStore, _atomic_add)


def _target_of(func, kind: str):
    """The target ``tvm.compile`` bound to ``func`` where it is of ``kind`` ("cuda", "llvm"), else None."""
    target = func.attrs.get("target") if func.attrs is not None else None
    return target if target is not None and target.kind.name == kind else None


def _has_vector_reductions(func) -> bool:
    """Does the function's target have ``red.global.add.v2.f32`` (CUDA sm_90 and newer)?"""
    target = _target_of(func, "cuda")
    arch = str(target.attrs.get("arch", "")) if target is not None else ""
    return arch.startswith("sm_") and int("".join(c for c in arch[3:] if c.isdigit()) or 0) >= 90


def _pragma_lowerings(func) -> dict:
    """Each of tvmflash's pragmas and the function that lowers its AttrStmt, for ``func``'s target."""
    return {WGMMA_WAIT_PRAGMA: _wait_and_fence_accumulators,
            SKIP_UNIT_RESCALE_PRAGMA: _skipped_where_factors_are_one,
            ATOMIC_ADD_PRAGMA: functools.partial(_atomic_adds, vector=_has_vector_reductions(func))}


def _lowered_pragmas(stmt, lowerings: dict):  # by hand: structural_map rejects the fences' loads
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key in lowerings:
        return lowerings[stmt.attr_key](stmt)
    return with_children(stmt, lambda child: _lowered_pragmas(child, lowerings))


def LowerPragmas():  # noqa: N802
    """After ``LowerOpaqueBlock`` (which turns a loop's pragma annotation into an AttrStmt around it):
    each loop annotated with one of tvmflash's pragmas becomes its statements. ``WGMMA_WAIT_PRAGMA``:
    the wait and fences of ``_wait_and_fence_accumulators``, then the loop;
    ``SKIP_UNIT_RESCALE_PRAGMA``: the loop under ``_skipped_where_factors_are_one``'s warp-wide test;
    ``ATOMIC_ADD_PRAGMA``: the loop with its additions atomic (``_atomic_adds``)."""
    return prim_func_pass(lambda func: func.with_body(_lowered_pragmas(func.body, _pragma_lowerings(func))),
                          "tvmflash.LowerPragmas")


# ---------------------------------------------------------------------------------- block-uniform loads
def _variables(expr) -> list:
    return find(expr, lambda n: isinstance(n, tirx.Var))


def _block_uniform_loads_bound(func, names):
    """``func`` with each load of an integer buffer of ``names`` that it never writes, at an index that
    is the same for the whole thread block (it reads block indices and the function's arguments, no
    loop, let or thread variable), read once into a variable bound at the start of the kernel."""
    thread_attrs = find(func.body, lambda n: isinstance(n, tirx.AttrStmt) and n.attr_key == "thread_extent")
    block_attrs = [attr for attr in thread_attrs if attr.node.thread_tag.startswith("blockIdx")]
    varying = [attr.node.var for attr in thread_attrs if not attr.node.thread_tag.startswith("blockIdx")]
    varying += [n.loop_var for n in find(func.body, lambda n: isinstance(n, tirx.For))]
    varying += [n.var for n in find(func.body, lambda n: isinstance(n, tirx.Bind))]
    written = {store.buffer.name for store in find(func.body, lambda n: isinstance(n, tirx.BufferStore))}

    def uniform(load):
        buffer = loaded(load)
        variables = [v for index in load.indices for v in _variables(index)]
        return (block_attrs and buffer.name in names and buffer.name not in written
                and str(buffer.dtype).startswith("int") and not any(v.same_as(w) for v in variables for w in varying))

    bound = []  # (variable, load), in the order first met

    def bind(load):
        if not uniform(load):
            return None
        for var, value in bound:
            if tvm_ffi.structural_equal(value, load):
                return var
        var = tirx.Var(f"{loaded(load).name.lower()}_{len(bound)}", loaded(load).dtype)
        bound.append((var, load))
        return var
    body = transform(func.body, tvm.ir.expr.TensorLoad, bind)  # TVM 0.27's BufferLoad
    if not bound:
        return func
    # other let values keep their loads (see BindBlockUniformLoads)
    lets = find(func.body, lambda n: isinstance(n, tirx.Bind))
    body = transform(body, tirx.Bind, lambda new: next(
        (tirx.Bind(new.var, old.value) for old in lets if old.var.same_as(new.var)), None))
    used = [attr for attr in block_attrs
            if any(v.same_as(attr.node.var) for _, load in bound for index in load.indices for v in _variables(index))]
    used = used or block_attrs
    # the block indices' attributes nest: the binding goes inside the innermost that the indices read
    innermost = next(a for a in used if all(b.same_as(a) or find(b.body, lambda n, a=a: n.same_as(a)) for b in used))

    def define(attr):
        if not (attr.attr_key == "thread_extent" and attr.node.same_as(innermost.node)):
            return None
        return tirx.AttrStmt(attr.node, attr.attr_key, attr.value,
                             tirx.SeqStmt([*(tirx.Bind(var, load) for var, load in bound), attr.body]))
    return func.with_body(transform(body, tirx.AttrStmt, define))


def BindBlockUniformLoads(names):  # noqa: N802
    """After ``LowerOpaqueBlock``: each load of a read-only integer buffer of ``names`` at an index of
    block indices only (varlen's ``cu_seqlens_q[b]`` and ``cu_seqlens_q[b + 1]``, where the tile's
    sequence starts and ends) is read once, into a variable bound at the kernel's start, and that
    variable is read everywhere else. Left as loads, they were repeated in each mask test and loop
    bound, and nvcc could hoist none of them out of the score's element loops (a load under a branch may
    not move ahead of it): varlen's causal forward ran 2.5x slower than the dense one at equal lengths
    (H200), slower than its own non-causal forward. sm80, d64 causal: the K/V step's PTX went from 2828
    instructions with 258 global loads to 1694 with none (dense: 1108 on interior tiles, 1261 on
    masked ones). The let values of other variables keep their loads (``BindLoadedPipelineExtents``'
    tile count): StmtSimplify inlines a pure integer let value, and the pipeline's guards on the count
    then no longer simplify away."""
    return prim_func_pass(lambda func: _block_uniform_loads_bound(func, set(names)), "tvmflash.BindBlockUniformLoads")


# ---------------------------------------------------------------------------------- hoisting
def _block_uniform(value, varying: set) -> bool:
    """Is ``value`` the same for every thread of a block: it reads none of the ``varying`` variables
    (thread indices, loop variables, let variables of such values) and loads global memory only?"""
    return (not any(var in varying for var in find(value, lambda n: isinstance(n, tirx.Var)))
            and all(loaded(load).scope() == "global" for load in find(value, is_load)))


def _block_indices_aliased(func, aliases: dict):
    """``func`` with its blockIdx.* variables (and the let variables bound outside every loop) read
    through aliases (new variables, added to ``aliases``) in the condition of each IfThenElse that is
    a loop's whole body: what HoistIfThenElse would lift out of that loop."""
    thread_extents = find(func.body, lambda n: isinstance(n, tirx.AttrStmt) and n.attr_key == "thread_extent")
    for attr in thread_extents:
        if attr.node.thread_tag.startswith("blockIdx"):
            aliases[attr.node.var] = tirx.Var(attr.node.var.name + "_alias", attr.node.var.ty)
    # and the let variables bound outside every loop to a value the same for the whole thread block
    # (``_block_uniform``): varlen's sequence offsets (``BindBlockUniformLoads``) and its K/V tile
    # count (``BindLoadedPipelineExtents``). HoistIfThenElse keeps a condition that reads a let
    # variable in its loop: the pipeline epilogue's causal tile test, on the count, was tested per
    # score (varlen d64 causal, sm90: 64 tests a K/V step).
    loops = find(func.body, lambda n: isinstance(n, tirx.For))
    in_loops = {bind.var for loop in loops for bind in find(loop.body, lambda n: isinstance(n, tirx.Bind))}
    varying = {attr.node.var for attr in thread_extents if not attr.node.thread_tag.startswith("blockIdx")}
    varying |= {loop.loop_var for loop in loops}
    for bind in find(func.body, lambda n: isinstance(n, tirx.Bind)):  # in program order
        if bind.var in in_loops or not _block_uniform(bind.value, varying):
            varying.add(bind.var)
        else:
            aliases[bind.var] = tirx.Var(bind.var.name + "_alias", bind.var.ty)

    def condition_aliased(loop):
        if not isinstance(loop.body, tirx.IfThenElse):
            return loop
        body = tirx.IfThenElse(substitute(loop.body.condition, aliases.items()), loop.body.then_case,
                               loop.body.else_case)
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding, loop.annotations)
    return func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, condition_aliased))) if aliases else func


def HoistBlockIndexConditions():  # noqa: N802
    """TVM's ``HoistIfThenElse``, with conditions that read a block index hoisted too.

    HoistIfThenElse leaves a condition in its loop when the condition reads a thread index, blockIdx.*
    included, although a block index is the same for the whole kernel body. The causal tile test
    (``program.tile_visible``) reads the Q block, so on sm90 each of a causal K/V step's score
    elements kept its own branch on it (d128: 762 SASS instructions a step against 472; d64: 1241
    against 657), where the non-causal test is hoisted out of the element loops. The block indices
    are renamed in the conditions for the pass (a block index is bound around the whole kernel,
    outside every loop the pass can hoist out of) and restored after it."""
    aliases = {}  # block index -> its alias, per function

    def restored(func):
        return func.with_body(substitute(func.body, [(a, v) for v, a in aliases.items()]))
    return tvm.transform.Sequential([
        prim_func_pass(lambda func: _block_indices_aliased(func, aliases), "tvmflash.AliasBlockIndices"),
        tvm.s_tir.transform.HoistIfThenElse(),
        prim_func_pass(restored, "tvmflash.RestoreBlockIndices")], name="tvmflash.HoistBlockIndexConditions")


# ---------------------------------------------------------------------------------- one barrier a step
def _is_barrier(stmt) -> bool:
    value = getattr(stmt, "value", None) if type(stmt).__name__ == "Evaluate" else None
    return type(value).__name__ == "Call" and getattr(value.op, "name", "") == "tirx.tvm_storage_sync"


def _without_leading_barrier(stmt):
    """``stmt`` with the barrier that opens it (through lets, attributes and sequences) dropped, and
    that barrier (None if there was none)."""
    kind = type(stmt).__name__
    if kind == "SeqStmt":  # past the Binds (let variables) that open it
        seq = list(stmt.seq)
        i = next((i for i, s in enumerate(seq) if type(s).__name__ != "Bind"), len(seq))
        if i == len(seq):
            return stmt, None
        if _is_barrier(seq[i]):
            rest = seq[:i] + seq[i + 1:]
            return (rest[0] if len(rest) == 1 else tirx.SeqStmt(rest)), seq[i]
        first, barrier = _without_leading_barrier(seq[i])
        return tirx.SeqStmt(seq[:i] + [first] + seq[i + 1:]), barrier
    if kind in ("LetStmt", "AttrStmt"):
        body, barrier = _without_leading_barrier(stmt.body)
        return with_children(stmt, lambda _: body), barrier
    return stmt, None


def _tile_wait_first(loop_body):
    """One K/V step of a cp.async pipeline (after ThreadSync) as: wait for the tile this step
    computes, barrier, issue the next tile's copies, compute; or None if it is not that loop.

    What InjectSoftwarePipeline and ThreadSync make is: barrier (the stage about to be refilled was
    read last step), issue the copies, wait, barrier (the tile just waited for), compute. Once the
    wait comes first, its barrier also orders last step's reads before the refill, so one barrier
    is enough. On sm90 the wait's ``fence.proxy.async`` (``tvm_fixes.ConstantAsyncWaitCounts``), a
    ``MEMBAR.ALL.CTA`` in SASS, then also stops waiting for the copies just issued. H200, d128
    bf16 non-causal: sm90 at block_m 256 325 -> 397 TFLOP/s, sm80 324 -> 343 (commit 8763f5b).
    """
    commit, wait = [], []

    def visit(stmt):  # the commit and wait scopes of this loop level (not of inner loops)
        kind = type(stmt).__name__
        if kind == "AttrStmt" and stmt.attr_key == "async_commit_queue_scope":
            commit.append(stmt)
        elif kind == "AttrStmt" and stmt.attr_key == "async_wait_queue_scope":
            wait.append(stmt)
        elif kind == "SeqStmt":
            for s in stmt.seq:
                visit(s)
        elif kind in ("LetStmt", "AttrStmt"):
            visit(stmt.body)

    visit(loop_body)
    if len(commit) != 1 or len(wait) != 1:
        return None
    count = wait[0].body
    if type(count).__name__ != "AttrStmt" or count.attr_key != "async_wait_inflight_count":
        return None
    in_flight = folded(count.value)  # static causal shapes: if_then_else(True & True, 1, 0)
    if not isinstance(in_flight, tvm.tirx.IntImm) or in_flight.value < 1:
        return None
    copies, refill_barrier = _without_leading_barrier(commit[0])
    compute, tile_barrier = _without_leading_barrier(count.body)
    if refill_barrier is None or tile_barrier is None:
        return None
    # The copies of this step are not committed yet where the wait now stands: one group fewer in flight.
    hoisted = tirx.AttrStmt(wait[0].node, wait[0].attr_key, wait[0].value, tirx.AttrStmt(
        count.node, count.attr_key, in_flight.value - 1, tirx.SeqStmt([tile_barrier, copies])))

    def rewrite(stmt):  # the two scopes moved; inner loops hold neither
        if stmt.same_as(commit[0]):
            return hoisted
        if stmt.same_as(wait[0]):
            return compute
        return stmt if type(stmt).__name__ == "For" else with_children(stmt, rewrite)

    return rewrite(loop_body)


def OneBarrierPerPipelinedStep():  # noqa: N802
    """After ``ThreadSync("shared.dyn")``: rewrite each cp.async-pipelined loop so that its step waits
    for its tile first (``_tile_wait_first``): one barrier a step instead of two.

    Not a bug fix but a better schedule of the same pipeline, which TVM has no knob for: the
    pipeline's order puts a stage's wait right before its first consumer."""
    return prim_func_pass(lambda func: func.with_body(map_loops(func.body, _tile_wait_first)),
                          "tvmflash.OneBarrierPerPipelinedStep")


# ---------------------------------------------------------------------------------- uniform descriptors
def _define_after(stmt, thread_tag, var, value):
    """``stmt`` with ``var = value`` bound first thing inside the thread_extent attribute of ``thread_tag``."""
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "thread_extent" and stmt.node.thread_tag == thread_tag:
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, tirx.SeqStmt([tirx.Bind(var, value), stmt.body]))
    return with_children(stmt, lambda s: _define_after(s, thread_tag, var, value))


def _uniform_warpgroup_descriptors(func):
    """``func`` with threadIdx.y, in the offsets of its wgmma descriptors, read through a variable set
    once at the kernel's start to thread y of lane 0 (``__shfl_sync``)."""
    extents = {attr.node.thread_tag: attr for attr in find(func.body, lambda n: isinstance(n, tirx.AttrStmt)
                                                         and n.attr_key == "thread_extent")}
    x, y = extents.get("threadIdx.x"), extents.get("threadIdx.y")
    if y is None or x is None or not isinstance(x.value, tirx.IntImm) or x.value.value % 32:
        return func
    thread_y = y.node.var
    warpgroup = tirx.Var("warpgroup", "int32")

    def uniform(call):
        if not (getattr(call.op, "name", "") == "tirx.cuda.func_call" and call.args[0].value == "tvmflash_wgmma_descriptor"):
            return call
        args = list(call.args)
        args[2] = substitute(args[2], [(thread_y, warpgroup)])
        return tvm.ir.expr.Call(call.op, args, call.attrs, ty_args=call.ty_args, span=call.span, ret_ty=call.ty)

    body = tvm_ffi.structural_map(func.body, (tvm.ir.expr.Call, uniform))
    if not find(body, lambda n: isinstance(n, tirx.Var) and n.same_as(warpgroup)):
        return func
    lane0 = tirx.call_extern("int32", "__shfl_sync", tirx.const(0xFFFFFFFF, "uint32"), thread_y, 0, 32)
    return func.with_body(_define_after(body, "threadIdx.y", warpgroup, lane0))


def UniformWarpgroupDescriptors():  # noqa: N802
    """Before ``CommonSubexprElim`` (which would move the descriptors' offsets into let variables that
    other statements share): read threadIdx.y in the wgmma descriptors' offsets through a variable
    set once to lane 0's, as CUTLASS's canonical_warp_group_idx does.

    threadIdx.y (the warpgroup) is the same across a warp where threadIdx.x spans whole warps, but
    nvcc does not know that: the Q tile's descriptors, which depend on it, then sit in ordinary
    registers and are moved to uniform ones before every wgmma (two R2UR and a constant move each,
    16 of the 44 of a d128 K/V step's wgmma issue). After the shuffle they are uniform values."""
    return prim_func_pass(_uniform_warpgroup_descriptors, "tvmflash.UniformWarpgroupDescriptors")


# ---------------------------------------------------------------------------------- 64-bit offsets
_ARITHMETIC = ("Add", "Sub", "Mul", "LShift", "FloorDiv", "FloorMod", "Div", "Mod", "Min", "Max", "RShift")
_PRODUCTS = ("Mul", "LShift")


def _int64(expr):
    """``expr``, an int32 index (scalar or vector), computed in int64 wherever a product may pass
    2**31: the arithmetic above each product is made int64 from the leaves up (a variable, a load, a
    call is cast; constants become int64). A subexpression with no product (a dimension's own index:
    ``blockIdx.x >> 3``, ``min(p, capacity - 1)``) stays int32 and is cast once: every dimension is
    below 2**31. One walk of the expression (``_widened_index``)."""
    return _widened_index(expr)[0]


def _widened_index(expr):
    """(``expr`` in int64 as ``_int64`` says, whether it holds a product)."""
    kind = type(expr).__name__
    ty = str(expr.ty)
    if not ty.startswith("int32"):
        return expr, False
    wide_ty = ty.replace("int32", "int64")
    if kind == "IntImm":
        return tirx.IntImm("int64", expr.value), False
    if kind in _ARITHMETIC:
        (a, product_a), (b, product_b) = _widened_index(expr.a), _widened_index(expr.b)
        if product_a or product_b or kind in _PRODUCTS:
            return getattr(tirx, kind)(a, b), True
    elif kind == "Ramp":
        (base, product_base), (stride, product_stride) = _widened_index(expr.base), _widened_index(expr.stride)
        if product_base or product_stride:
            return tirx.Ramp(base, stride, expr.lanes), True
    elif kind == "Broadcast":
        value, product = _widened_index(expr.value)
        if product:
            return tirx.Broadcast(value, expr.lanes), True
    elif kind == "Select":
        (a, product_a), (b, product_b) = _widened_index(expr.true_value), _widened_index(expr.false_value)
        if product_a or product_b:
            return tirx.Select(expr.condition, a, b), True
    return tirx.Cast(wide_ty, expr), False


def _is_global(data) -> bool:
    return getattr(data.ty, "storage_scope", None) in ("global", "")


def _widened(node):
    kind = type(node).__name__
    if kind in ("TensorLoad", "BufferLoad") and _is_global(node.source.data):
        return tirx.BufferLoad(node.source, [_int64(i) for i in node.indices])
    if kind == "BufferStore" and _is_global(node.buffer.data):
        return tirx.BufferStore(node.buffer, node.value, [_int64(i) for i in node.indices])
    if kind == "Call" and getattr(node.op, "name", "") == "tirx.tvm_access_ptr" and _is_global(node.args[1]):
        args = list(node.args)
        args[2] = _int64(args[2])
        return tvm.ir.expr.Call(node.op, args, node.attrs, ty_args=node.ty_args, span=node.span, ret_ty=node.ty)
    return node


def WidenGlobalIndices():  # noqa: N802
    """After FlattenBuffer and VectorizeLoop, in a build for tensors of 2**31 elements or more: every
    index into a global buffer (a kernel argument) is computed in int64 (``_int64``). Each dimension's
    index stays int32 (every dimension, and every stride, is below 2**31); their flattened sum of
    products is what may pass 2**31. Builds for smaller tensors skip this pass and keep their int32
    arithmetic (and their generated code) unchanged."""
    def run(func):
        return func.with_body(tvm_ffi.structural_map(
            func.body, [((tirx.BufferStore, tvm.ir.expr.TensorLoad, tvm.ir.expr.Call), _widened)]))
    return prim_func_pass(run, "tvmflash.WidenGlobalIndices")


def _merged_guards(seq, varying):
    """``seq`` with each run of adjacent ``if (c) {...}`` (no else) of one non-constant condition ``c``
    that reads no buffer and none of the ``varying`` variables (thread indices, loop variables) made
    one ``if (tvm_thread_invariant(c))``: sound, as no statement can change such a condition, and the
    mark lets ThreadSync plan barriers inside it. (A loop's own guards, such as a pipeline's on its
    next tile, stay as they are: the passes after this one read that loop's statements.)"""
    def uniform(stmt):  # (a constant condition is left to StmtSimplify)
        return (isinstance(stmt, tirx.IfThenElse) and stmt.else_case is None
                and not isinstance(stmt.condition, tirx.IntImm) and not find(stmt.condition, is_load)
                and not find(stmt.condition, lambda n: isinstance(n, tirx.Var) and any(n.same_as(v) for v in varying)))

    runs = []  # [condition, statements]: a run of guarded statements, or [None, [statement]]
    for stmt in seq.seq:
        if uniform(stmt) and runs and runs[-1][0] is not None and tvm_ffi.structural_equal(runs[-1][0], stmt.condition):
            runs[-1][1].append(stmt)
        else:
            runs.append([stmt.condition if uniform(stmt) else None, [stmt]])
    if len(runs) == len(seq.seq):
        return None
    stmts = [run[0] if len(run) == 1 else tirx.IfThenElse(T.tvm_thread_invariant(condition), tirx.SeqStmt(
        [part for guarded in run for part in (guarded.then_case.seq if isinstance(guarded.then_case, tirx.SeqStmt)
                                              else [guarded.then_case])]), None)
        for condition, run in runs]
    return tirx.SeqStmt(stmts) if len(stmts) > 1 else stmts[0]


def _guards_merged(func):
    varying = [n.node.var for n in find(func.body, lambda n: isinstance(n, tirx.AttrStmt)
                                        and n.attr_key == "thread_extent" and n.node.thread_tag.startswith("threadIdx"))]
    varying += [n.loop_var for n in find(func.body, lambda n: isinstance(n, tirx.For))]
    return func.with_body(transform(func.body, tirx.SeqStmt, lambda seq: _merged_guards(seq, varying)))


def MergeAdjacentGuards():  # noqa: N802
    """After LowerOpaqueBlock: adjacent statements under one block-uniform condition share one ``if``
    (``_merged_guards``). InjectSoftwarePipeline guards each statement of a pipeline's epilogue on its
    own (the loop may have had no step); ptxas then kept the sm90 dkdv's step values in registers across
    the separate branches and spilled (d128 with TMA: 580 bytes, none with the guards merged)."""
    return prim_func_pass(_guards_merged, "tvmflash.MergeAdjacentGuards")


# ---------------------------------------------------------------------------------- exp2 on the CPU
# 2**f on [-0.5, 0.5] as 1 + f * P(f), P's coefficients highest first: the minimax fit of Cephes'
# exp2f (relative error at most 1.7e-7 over the float range, 2-3 ulp; libm's is 0.5 ulp).
_EXP2_COEFFICIENTS = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3,
                      5.550332471162809e-2, 2.402264791363012e-1, 6.931472028550421e-1)


def polynomial_exp2(x):
    """float32 2**x in arithmetic that vectorises: x = n + f with n an integer and |f| <= 0.5, 2**n
    written into a float's exponent bits, 2**f a polynomial. 0 below -126.5 (where libm's would be at
    most twice the smallest normal float, or a denormal; -inf gives 0 as libm's does), inf from 127.5
    up, NaN for NaN."""
    f32 = "float32"
    value = tirx.Var("exp2_x", f32)
    clamped = tirx.Var("exp2_clamped", f32)
    whole = tirx.Var("exp2_n", f32)
    frac = tirx.Var("exp2_f", f32)
    poly = tirx.const(_EXP2_COEFFICIENTS[0], f32)
    for coefficient in _EXP2_COEFFICIENTS[1:]:
        poly = poly * frac + tirx.const(coefficient, f32)
    two_to_n = tirx.reinterpret(f32, tirx.shift_left(tirx.Cast("int32", whole) + 127, tirx.const(23, "int32")))
    result = two_to_n * (poly * frac + tirx.const(1, f32))
    return tirx.Let(value, x, tirx.Let(
        clamped, tirx.max(tirx.min(value, tirx.const(128, f32)), tirx.const(-127, f32)), tirx.Let(
            whole, tirx.floor(clamped + tirx.const(0.5, f32)), tirx.Let(
                frac, clamped - whole,
                tirx.Select(tirx.isnan(value), value, result)))))


def PolynomialExp2OnCPU():  # noqa: N802
    """Before VectorizeLoop, in the functions built for the CPU (llvm): each float32 ``exp2`` becomes
    ``polynomial_exp2``. LLVM turns a vector ``llvm.exp2`` into one libm call an element (no vector
    math library is linked), which took a third of the CPU forward's time; the polynomial vectorises
    with the loop around it. CUDA keeps its ``ex2.approx``."""
    def rewrite(func):
        if _target_of(func, "llvm") is None:
            return func
        return func.with_body(transform(func.body, tvm.ir.expr.Call, lambda call: polynomial_exp2(call.args[0])
                                        if is_call(call, "tirx.exp2") and str(call.ty) == "float32" else None))
    return prim_func_pass(rewrite, "tvmflash.PolynomialExp2OnCPU")
