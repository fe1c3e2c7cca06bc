"""Values the same for a whole thread block (or warp), made so that TVM and nvcc can see it: block-uniform
loads read once (``BindBlockUniformLoads``), conditions on block indices hoisted out of their loops
(``HoistBlockIndexConditions``), adjacent guards of one block-uniform condition merged
(``MergeAdjacentGuards``), and the wgmma descriptors' warpgroup index read through a warp-uniform value
(``UniformWarpgroupDescriptors``)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.script import tirx as T

from tvmflash.lowering.ir import LOAD, find, find_attrs, loaded, prim_func_pass, substitute, transform, with_children


# ---------------------------------------------------------------------------------- block-uniform loads
def _variables(expr) -> list:
    return find(expr, tirx.Var)


def _block_uniform_loads_bound(func, names):
    """``func`` with each load of an integer buffer of ``names`` that it never writes, at an index that
    is the same for the whole thread block (it reads block indices and the function's arguments, no
    loop, let or thread variable), read once into a variable bound at the start of the kernel."""
    thread_attrs = find_attrs(func.body, "thread_extent")
    block_attrs = [attr for attr in thread_attrs if attr.node.thread_tag.startswith("blockIdx")]
    varying = [attr.node.var for attr in thread_attrs if not attr.node.thread_tag.startswith("blockIdx")]
    varying += [n.loop_var for n in find(func.body, tirx.For)]
    varying += [n.var for n in find(func.body, tirx.Bind)]
    written = {store.buffer.name for store in find(func.body, tirx.BufferStore)}

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
    lets = find(func.body, tirx.Bind)
    body = transform(body, tirx.Bind, lambda new: next(
        (tirx.Bind(new.var, old.value) for old in lets if old.var.same_as(new.var)), None))
    used = [attr for attr in block_attrs
            if any(v.same_as(attr.node.var) for _, load in bound for index in load.indices for v in _variables(index))]
    used = used or block_attrs
    # the block indices' attributes nest: the binding goes inside the innermost that the indices read
    innermost = next(a for a in used
                     if all(b.same_as(a) or find(b.body, tirx.AttrStmt, lambda n, a=a: n.same_as(a)) for b in used))

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
    not move ahead of it): varlen's causal forward ran far slower than the dense one at equal lengths,
    slower than its own non-causal forward, and its K/V step held global loads that the dense one does
    not. The let values of other variables keep their loads (``BindLoadedPipelineExtents``'
    tile count): StmtSimplify inlines a pure integer let value, and the pipeline's guards on the count
    then no longer simplify away."""
    return prim_func_pass(lambda func: _block_uniform_loads_bound(func, set(names)), "tvmflash.BindBlockUniformLoads")


# ---------------------------------------------------------------------------------- hoisting
def _block_uniform(value, varying: set) -> bool:
    """Is ``value`` the same for every thread of a block: it reads none of the ``varying`` variables
    (thread indices, loop variables, let variables of such values) and loads global memory only?"""
    return (not any(var in varying for var in find(value, tirx.Var))
            and all(loaded(load).scope() == "global" for load in find(value, LOAD)))


def _block_indices_aliased(func, aliases: dict):
    """``func`` with its blockIdx.* variables (and the let variables bound outside every loop) read
    through aliases (new variables, added to ``aliases``) in the condition of each IfThenElse that is
    a loop's whole body: what HoistIfThenElse would lift out of that loop."""
    thread_extents = find_attrs(func.body, "thread_extent")
    for attr in thread_extents:
        if attr.node.thread_tag.startswith("blockIdx"):
            aliases[attr.node.var] = tirx.Var(attr.node.var.name + "_alias", attr.node.var.ty)
    # and the let variables bound outside every loop to a value the same for the whole thread block
    # (``_block_uniform``): varlen's sequence offsets (``BindBlockUniformLoads``) and its K/V tile
    # count (``BindLoadedPipelineExtents``). HoistIfThenElse keeps a condition that reads a let
    # variable in its loop: the pipeline epilogue's causal tile test, on the count, was tested per
    # score.
    loops = find(func.body, tirx.For)
    in_loops = {bind.var for loop in loops for bind in find(loop.body, tirx.Bind)}
    varying = {attr.node.var for attr in thread_extents if not attr.node.thread_tag.startswith("blockIdx")}
    varying |= {loop.loop_var for loop in loops}
    for bind in find(func.body, tirx.Bind):  # in program order
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
    elements kept its own branch on it (a step of far more instructions than the non-causal one),
    where the non-causal test is hoisted out of the element loops. The block indices
    are renamed in the conditions for the pass (a block index is bound around the whole kernel,
    outside every loop the pass can hoist out of) and restored after it."""
    aliases = {}  # block index -> its alias, per function

    def restored(func):
        return func.with_body(substitute(func.body, [(a, v) for v, a in aliases.items()]))
    return tvm.transform.Sequential([
        prim_func_pass(lambda func: _block_indices_aliased(func, aliases), "tvmflash.AliasBlockIndices"),
        tvm.s_tir.transform.HoistIfThenElse(),
        prim_func_pass(restored, "tvmflash.RestoreBlockIndices")], name="tvmflash.HoistBlockIndexConditions")


# ---------------------------------------------------------------------------------- merged guards
def _merged_guards(seq, varying):
    """``seq`` with each run of adjacent ``if (c) {...}`` (no else) of one non-constant condition ``c``
    that reads no buffer and none of the ``varying`` variables (thread indices, loop variables) made
    one ``if (tvm_thread_invariant(c))``: sound, as no statement can change such a condition, and the
    mark lets ThreadSync plan barriers inside it. (A loop's own guards, such as a pipeline's on its
    next tile, stay as they are: the passes after this one read that loop's statements.)"""
    def uniform(stmt):  # (a constant condition is left to StmtSimplify)
        return (isinstance(stmt, tirx.IfThenElse) and stmt.else_case is None
                and not isinstance(stmt.condition, tirx.IntImm) and not find(stmt.condition, LOAD)
                and not find(stmt.condition, tirx.Var, lambda n: any(n.same_as(v) for v in varying)))

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
    varying = [n.node.var for n in find(func.body, tirx.AttrStmt, lambda n: n.attr_key == "thread_extent"
                                        and n.node.thread_tag.startswith("threadIdx"))]
    varying += [n.loop_var for n in find(func.body, tirx.For)]
    return func.with_body(transform(func.body, tirx.SeqStmt, lambda seq: _merged_guards(seq, varying)))


def MergeAdjacentGuards():  # noqa: N802
    """After LowerOpaqueBlock: adjacent statements under one block-uniform condition share one ``if``
    (``_merged_guards``). InjectSoftwarePipeline guards each statement of a pipeline's epilogue on its
    own (the loop may have had no step); ptxas then kept the sm90 dkdv's step values in registers across
    the separate branches and spilled (and did not with the guards merged)."""
    return prim_func_pass(_guards_merged, "tvmflash.MergeAdjacentGuards")


# ---------------------------------------------------------------------------------- uniform descriptors
def _define_after(stmt, thread_tag, var, value):
    """``stmt`` with ``var = value`` bound first thing inside the thread_extent attribute of ``thread_tag``."""
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "thread_extent" and stmt.node.thread_tag == thread_tag:
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, tirx.SeqStmt([tirx.Bind(var, value), stmt.body]))
    return with_children(stmt, lambda s: _define_after(s, thread_tag, var, value))


def _uniform_warpgroup_descriptors(func):
    """``func`` with threadIdx.y, in the offsets of its wgmma descriptors, read through a variable set
    once at the kernel's start to thread y of lane 0 (``__shfl_sync``)."""
    extents = {attr.node.thread_tag: attr for attr in find_attrs(func.body, "thread_extent")}
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
    if not find(body, tirx.Var, lambda n: n.same_as(warpgroup)):
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
    a large share of a K/V step's wgmma issue). After the shuffle they are uniform values."""
    return prim_func_pass(_uniform_warpgroup_descriptors, "tvmflash.UniformWarpgroupDescriptors")
