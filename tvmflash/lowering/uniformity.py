"""Values the same for a whole thread block (or warp), made so that TVM and nvcc can see it: block-uniform
loads read once (``BindBlockUniformLoads``), divisors of those loaded values computed once
(``BindLoadedDivisors``), a BlockMask's tile read once a step (``BindStepLoads``),
conditions on block indices hoisted out of their loops
(``HoistBlockIndexConditions``), adjacent guards of one block-uniform condition merged
(``MergeAdjacentGuards``), and the wgmma descriptors' warpgroup index read through a warp-uniform value
(``UniformWarpgroupDescriptors``)."""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm import tirx
from tvm.script import tirx as T

from tvmflash.lowering.annotations import PERSISTENT_WALK
from tvmflash.lowering.ir import (CALL, LOAD, find, find_attrs, inlined, is_call, loaded, prim_func_pass, substitute, transform,
                                  with_children)


# ---------------------------------------------------------------------------------- block-uniform loads
def _variables(expr) -> list:
    return find(expr, tirx.Var)


def _varying(body, thread_attrs, kept=()) -> list:
    """The variables of ``body`` that may differ within a thread block or from step to step: thread
    indices (not blockIdx), loop variables, and let variables other than those of ``kept``."""
    varying = [attr.node.var for attr in thread_attrs if not attr.node.thread_tag.startswith("blockIdx")]
    varying += [n.loop_var for n in find(body, tirx.For)]
    return varying + [n.var for n in find(body, tirx.Bind) if not any(n.var.same_as(v) for v in kept)]


def _block_uniform_loads_bound(func, names):
    """``func`` with each load of an integer buffer of ``names`` that it never writes, at an index that
    is the same for the whole thread block (it reads block indices and the function's arguments, no
    loop, let or thread variable), read once into a variable bound at the start of the kernel."""
    thread_attrs = find_attrs(func.body, "thread_extent")
    block_attrs = [attr for attr in thread_attrs if attr.node.thread_tag.startswith("blockIdx")]
    varying = _varying(func.body, thread_attrs)
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


# ---------------------------------------------------------------------------------- a BlockMask's step values
class _ListValues:
    """The values of a function that read its read-only integer buffers of ``names`` (a BlockMask's lists):
    each integer ``if_then_else`` that holds such a load (the walk's tile, which keeps the load under its
    condition), then each such load outside one."""

    def __init__(self, func, names):
        self.names = names
        self.written = {store.buffer.name for store in find(func.body, tirx.BufferStore)}
        self.threads = [attr.node.var for attr in find_attrs(func.body, "thread_extent")
                        if not attr.node.thread_tag.startswith("blockIdx")]

    def listed(self, load) -> bool:
        buffer = loaded(load)
        return (buffer.name in self.names and buffer.name not in self.written
                and str(buffer.dtype).startswith("int"))

    def reads_lists(self, stmt) -> bool:
        return bool(find(stmt, LOAD, lambda n: loaded(n).name in self.names))

    def found(self, stmt, kind, fixed) -> list:
        """The distinct values of ``kind`` (CALL: the if_then_else, LOAD: the loads) under ``stmt`` for
        which ``fixed(value)`` holds, in walk order."""
        if kind is CALL:
            def wanted(n):
                return (is_call(n, "prim.if_then_else") and str(n.ty).startswith("int")
                        and bool(find(n, LOAD, lambda m: self.listed(m) and fixed(m))) and fixed(n))
        else:
            def wanted(n):
                return self.listed(n) and fixed(n)
        values = []
        for node in find(stmt, kind, wanted):
            if not any(tvm_ffi.structural_equal(node, known) for known in values):
                values.append(node)
        return values

    def fixed_in(self, stmt, step=None):
        """A test of a value: does it read none of what changes inside ``stmt`` (thread indices, its
        loops' and lets' variables), and ``step`` (a loop's variable) where given?"""
        inner = self.threads + [n.loop_var for n in find(stmt, tirx.For)] + [n.var for n in find(stmt, tirx.Bind)]

        def fixed(value) -> bool:
            variables = _variables(value)
            return (not any(v.same_as(w) for v in variables for w in inner)
                    and (step is None or any(v.same_as(step) for v in variables)))
        return fixed


def _replaced(stmt, kind, pairs):
    """``stmt`` with each node of ``kind`` structurally equal to a value of ``pairs`` ((var, value))
    replaced by its variable."""
    def apply(node):
        return next((var for var, value in pairs if tvm_ffi.structural_equal(node, value)), None)
    return transform(stmt, kind, apply)


def _once_a_step(values: _ListValues, loop):
    """``loop`` with the values that read its variable computed once, first thing in its body."""
    if not values.reads_lists(loop.body):
        return None
    fixed = values.fixed_in(loop.body, loop.loop_var)
    body, bound = loop.body, []
    for kind, name in ((CALL, "selected"), (LOAD, None)):
        found = values.found(body, kind, fixed)
        pairs = [(tirx.Var(f"{name or loaded(v).name.lower()}_{loop.loop_var.name}_{len(bound) + n}",
                           v.ty if kind is CALL else loaded(v).dtype), v) for n, v in enumerate(found)]
        body = _replaced(body, kind, pairs)
        bound += pairs
    if not bound:
        return None
    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind,
                    tirx.SeqStmt([*(tirx.Bind(var, value) for var, value in bound), body]),
                    loop.thread_binding, loop.annotations)


def _once_where_used(values: _ListValues, stmt, counter):
    """``stmt`` with each value used by two or more statements of a sequence, or by a loop, computed once
    just before the first of them (the values that ``_once_a_step`` left: a pipeline's prologue and
    epilogue, outside the loop). A value used by one other statement only is placed inside it, so that
    none lives longer than its uses (across a loop it is not used in, it would hold a register through
    the loop)."""
    if not values.reads_lists(stmt):
        return stmt
    if isinstance(stmt, tirx.SeqStmt):
        fixed = values.fixed_in(stmt)
        parts = list(stmt.seq)
        for kind, name in ((CALL, "selected"), (LOAD, None)):
            for value in values.found(tirx.SeqStmt(parts), kind, fixed):
                users = [i for i, part in enumerate(parts)  # (a let's value keeps its loads, as above)
                         if not isinstance(part, tirx.Bind)
                         and find(part, kind, lambda n, value=value: tvm_ffi.structural_equal(n, value))]
                if len(users) < 2 and not (users and isinstance(parts[users[0]], tirx.For)):
                    continue
                var = tirx.Var(f"{name or loaded(value).name.lower()}_{len(counter)}",
                               value.ty if kind is CALL else loaded(value).dtype)
                counter.append(var)
                parts = [_replaced(part, kind, [(var, value)]) if i in users else part for i, part in enumerate(parts)]
                parts.insert(users[0], tirx.Bind(var, value))
        return tirx.SeqStmt([_once_where_used(values, part, counter) for part in parts])
    return with_children(stmt, lambda s: _once_where_used(values, s, counter))


def _step_values_bound(func, names):
    values = _ListValues(func, names)
    body = transform(func.body, tirx.For, lambda loop: _once_a_step(values, loop))
    return func.with_body(_once_where_used(values, body, []))


def BindStepLoads(names):  # noqa: N802
    """After ``BindBlockUniformLoads``: the values that read a BlockMask's lists (the read-only integer
    buffers of ``names``) computed once a step: in each loop, each ``if_then_else`` that holds a load of
    them at an index of the loop's variable (the walk's tile, ``program_block_sparse.BlockWalk.tile``: it keeps
    the load under its condition), then each such load outside one, bound first thing in the loop's body
    (``_once_a_step``); outside the loops (a pipeline's prologue and epilogue), just before the first
    statement that uses them, where several do (``_once_where_used``).

    The programs write a step's tile as one expression, ``if_then_else(t < count, list[t] ..., end)``,
    wherever they use it: in each copy's coordinates and in each score's mask. Holding a load, it is
    shared by neither TVM's CommonSubexprElim nor the simplifiers, and a block-sparse sm90 build carried
    hundreds of copies of it (the backward's also a division by the loaded count each, for its query head
    and step): CUDA of 0.5 MB (forward) and 2.1 MB (backward), builds of 13 and 39 s on the CPU where the
    kernels without the lists take 2 and 4 s (LowerIntrin alone 23 s on the backward's divisions, then
    StmtSimplify and RemoveNoOp), and about twice the SASS (the backward's dkdv spilled). A value bound
    reads no thread index and nothing bound inside its loop, so it is the same wherever it was; a load
    outside an ``if_then_else`` was already read unconditionally there, or at an index the programs clamp
    into the list (``BlockWalk``), whose shape the host checks (``flex_block_mask``)."""
    return prim_func_pass(lambda func: _step_values_bound(func, set(names)), "tvmflash.BindStepLoads")


# ---------------------------------------------------------------------------------- divisions by loaded values
def _non_negative(expr) -> bool:
    """Is ``expr`` >= 0 by its form (a max with a non-negative term, an ``if_then_else`` of two such)?"""
    if isinstance(expr, tirx.IntImm):
        return expr.value >= 0
    if isinstance(expr, tirx.Max):
        return _non_negative(expr.a) or _non_negative(expr.b)
    if isinstance(expr, tirx.Min):
        return _non_negative(expr.a) and _non_negative(expr.b)
    if is_call(expr, "prim.if_then_else"):
        return _non_negative(expr.args[1]) and _non_negative(expr.args[2])
    return tvm.sym.Analyzer().can_prove(expr >= 0)


def _innermost_block_attr(block_attrs, values):
    """The innermost of the blockIdx attributes whose variables ``values`` read (all of them nest), or
    of all of them where the values read none."""
    used = [attr for attr in block_attrs
            if any(v.same_as(attr.node.var) for value in values for v in _variables(value))] or block_attrs
    return next(a for a in used
                if all(b.same_as(a) or find(b.body, tirx.AttrStmt, lambda n, a=a: n.same_as(a)) for b in used))


def _loaded_divisors_bound(func, names):
    """``func`` with each block-uniform divisor that reads a value of ``names`` bound once a kernel
    (``BindLoadedDivisors``)."""
    loaded_vars = [(bind.var, bind.value) for bind in find(func.body, tirx.Bind)
                   if isinstance(bind.value, LOAD) and loaded(bind.value).name in names]
    thread_attrs = find_attrs(func.body, "thread_extent")
    block_attrs = [attr for attr in thread_attrs if attr.node.thread_tag.startswith("blockIdx")]
    if not loaded_vars or not block_attrs:
        return func
    varying = _varying(func.body, thread_attrs, kept=[v for v, _ in loaded_vars])

    def wanted(division) -> bool:
        variables = _variables(division.b)
        return (not isinstance(division.b, tirx.IntImm)
                and any(v.same_as(w) for v in variables for w, _ in loaded_vars)
                and not any(v.same_as(w) for v in variables for w in varying))
    divisors = []
    for division in find(func.body, (tirx.FloorDiv, tirx.FloorMod), wanted):
        if not any(tvm_ffi.structural_equal(division.b, known) for known in divisors):
            divisors.append(division.b)
    if not divisors:
        return func
    # (var, value with the loads, what the divisions read: the var, under max(., 0) where the divisor is
    # never negative, so that the simplifiers and LowerIntrin still know it)
    bound = []
    for n, divisor in enumerate(divisors):
        var = tirx.Var(f"divisor_{n}", divisor.ty)
        bound.append((var, inlined(divisor, loaded_vars), tirx.Max(var, 0) if _non_negative(divisor) else var))

    def rewrite(division):
        for (_, _, read), divisor in zip(bound, divisors):
            if tvm_ffi.structural_equal(division.b, divisor):
                return type(division)(division.a, read)
        return None
    body = transform(func.body, (tirx.FloorDiv, tirx.FloorMod), rewrite)
    innermost = _innermost_block_attr(block_attrs, [value for _, value, _ in bound])

    def define(attr):
        if not (attr.attr_key == "thread_extent" and attr.node.same_as(innermost.node)):
            return None
        return tirx.AttrStmt(attr.node, attr.attr_key, attr.value,
                             tirx.SeqStmt([*(tirx.Bind(var, value) for var, value, _ in bound), attr.body]))
    return func.with_body(transform(body, tirx.AttrStmt, define))


def BindLoadedDivisors(names):  # noqa: N802
    """After ``BindBlockUniformLoads`` (``names``: its buffers): each divisor that reads a value it
    bound (a load of ``names``) and is otherwise block-uniform (no thread index, loop or other let
    variable) computed once a kernel, into a variable that the divisions read.

    The backward's dkdv runs its GQA group's query heads and Q blocks as one fused loop
    (``schedules.common.dkdv_grid``), so its query head and Q block are ``floordiv`` and ``floormod``
    of the step by the number of Q blocks; in varlen that count is an expression of the sequence's
    offsets (each a variable of ``BindBlockUniformLoads``: a let of a pure integer value, which
    StmtSimplify inlines, as it inlines CommonSubexprElim's). It was repeated in every score's mask
    and every ALiBi slope's index, and LowerIntrin rewrote each division by it into nested copies: the
    varlen backward with a window, softcap and ALiBi at d64 was 2.1 MB of CUDA, 31 s to source
    (LowerIntrin 10 s, StmtSimplify 9 s, RemoveNoOp 5 s) and 33 s of nvcc, its dkdv at 249 registers
    where the dense one takes 168. The variable's value keeps the loads, so that StmtSimplify leaves
    the let in place (as ``BindLoadedPipelineExtents``' tile count; the loads are of a few integers
    read just before, once a block); a divisor never negative by its form is read as ``max(var, 0)``,
    so that LowerIntrin's divisions by it stay truncated ones, as before. Same values: the variable
    holds the divisor's value, computed from the same loads."""
    return prim_func_pass(lambda func: _loaded_divisors_bound(func, set(names)), "tvmflash.BindLoadedDivisors")


# ---------------------------------------------------------------------------------- hoisting
def _block_uniform(value, varying: set) -> bool:
    """Is ``value`` the same for every thread of a block: it reads none of the ``varying`` variables
    (thread indices, loop variables, let variables of such values) and loads global memory only?"""
    return (not any(var in varying for var in find(value, tirx.Var))
            and all(loaded(load).scope() == "global" for load in find(value, LOAD)))


def _block_indices_aliased(func, aliases: dict, reads: dict):
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
    # And the let variables bound inside loops to such a value of the loops' variables (a BlockMask's
    # tile and counts of a step, ``BindStepLoads``): read as their alias plus (l - l) for each loop
    # variable l around the let, so that the condition still reads those loops and stays inside them,
    # where the let is bound (the pass moves a condition out of the loops whose variables it does not
    # read, and no further). Left as they were, the BlockMask's full-tile test was tested per score.
    loops = find(func.body, tirx.For)
    around = {}  # a let variable bound inside loops -> the variables of the loops around it
    for loop in loops:
        for bind in find(loop.body, tirx.Bind):
            around.setdefault(bind.var, []).append(loop.loop_var)
    threads = {attr.node.var for attr in thread_extents if not attr.node.thread_tag.startswith("blockIdx")}
    varying = threads | {loop.loop_var for loop in loops}
    for bind in find(func.body, tirx.Bind):  # in program order
        if bind.var not in around:
            if _block_uniform(bind.value, varying):
                aliases[bind.var] = tirx.Var(bind.var.name + "_alias", bind.var.ty)
            else:
                varying.add(bind.var)
        elif str(bind.var.ty).startswith("int") and _block_uniform(bind.value, varying - set(around[bind.var])):
            alias = aliases[bind.var] = tirx.Var(bind.var.name + "_alias", bind.var.ty)
            reads[bind.var] = functools.reduce(
                lambda value, l: value + tirx.Cast(str(bind.var.ty), l - l), around[bind.var], alias)
        else:
            varying.add(bind.var)

    def condition_aliased(loop):
        if not isinstance(loop.body, tirx.IfThenElse):
            return loop
        body = tirx.IfThenElse(substitute(loop.body.condition, [(v, reads.get(v, a)) for v, a in aliases.items()]),
                               loop.body.then_case, loop.body.else_case)
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
    outside every loop the pass can hoist out of) and restored after it. So are the lets of a
    block-uniform value (outside every loop) and, read with their loops' variables, those bound inside
    loops (a BlockMask's tile of a step: its full-tile test, ``program_block_sparse.BlockWalk.full``)."""
    aliases = {}  # block index -> its alias, per function
    reads = {}  # a let variable bound inside loops -> what the conditions read for it (its alias and loops)

    def restored(func):
        return func.with_body(substitute(func.body, [(a, v) for v, a in aliases.items()]))
    return tvm.transform.Sequential([
        prim_func_pass(lambda func: _block_indices_aliased(func, aliases, reads), "tvmflash.AliasBlockIndices"),
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
    # a persistent walk's step is the same for the whole thread block (every thread walks the same tiles)
    varying += [n.loop_var for n in find(func.body, tirx.For) if PERSISTENT_WALK not in n.annotations]
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
