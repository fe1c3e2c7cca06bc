"""Workarounds for TVM 0.27 bugs that tvmflash's builds hit, and one lowering change TVM has no knob for
(``one_barrier_per_pipelined_step``). Each says what it works around or changes."""

from __future__ import annotations

import contextlib
import functools
import itertools

import tvm
import tvm_ffi
from tvm.backend.cuda.codegen.registry import CODEGEN_REGISTRY
from tvm.backend.cuda.op import cuda_func_call


def _find(stmt, predicate):
    """The nodes under ``stmt`` (itself included) for which ``predicate`` holds, in walk order."""
    found = []

    def visit(node):
        if predicate(node):
            found.append(node)
    tvm_ffi.structural_walk(stmt, visit)
    return found


def _substitute(expr, values):
    """``expr`` with each variable of ``values`` ((var, value) pairs) replaced."""
    from tvm import tirx

    def apply(var):
        return next((value for v, value in values if v.same_as(var)), var)
    return tvm_ffi.structural_map(expr, (tirx.Var, apply))


def _is_load(node):
    return type(node).__name__ in ("BufferLoad", "TensorLoad")  # TensorLoad: a BufferLoad's class in TVM 0.27


def _loaded(load):
    """The buffer a load reads (``source`` on TVM 0.27's TensorLoad)."""
    return load.buffer if hasattr(load, "buffer") else load.source


def _loaded_buffers(stmt) -> dict:
    """The buffers that loads under ``stmt`` read, by name."""
    return {_loaded(load).name: _loaded(load) for load in _find(stmt, _is_load)}


def _every_element(buffer) -> list:
    """A load of each element of a (small, static) buffer, in row-major order."""
    from tvm import tirx

    return [tirx.BufferLoad(buffer, list(index)) for index in itertools.product(*(range(int(e)) for e in buffer.shape))]


@contextlib.contextmanager
def _replaced(namespace, name: str, replacement):
    """``namespace.name = replacement`` for the duration: TVM's build pipeline looks its passes up
    by attribute when it runs, so swapping a pass factory is enough to change one build."""
    original = getattr(namespace, name)
    setattr(namespace, name, replacement)
    try:
        yield
    finally:
        setattr(namespace, name, original)


@contextlib.contextmanager
def lower_every_warp_buffer():
    """Run LowerWarpMemory until it changes nothing.

    In TVM 0.27 one run of ``tirx.transform.LowerWarpMemory`` lowers only the first "warp"-scope
    allocation it meets; the others stay one full copy of the warp's tile per thread, and
    intrinsics that assume the lowered layout (mma fill) then write the wrong elements.
    """
    original = tvm.tirx.transform.LowerWarpMemory

    def to_fixpoint():
        one = original()

        @tvm.transform.module_pass(opt_level=0, name="tvmflash.LowerWarpMemoryToFixpoint")
        def run(mod, _ctx):
            for _ in range(64):
                lowered = one(mod)
                if tvm_ffi.structural_equal(lowered, mod):
                    break
                mod = lowered
            return mod

        return run

    with _replaced(tvm.tirx.transform, "LowerWarpMemory", to_fixpoint):
        yield


@contextlib.contextmanager
def no_warp_thread_sync():
    """Leave out ``s_tir.transform.ThreadSync("warp")``.

    The barriers it plans for "warp"-scope buffers are never emitted for CUDA (the generated source
    has no ``__syncwarp``: the "warp" buffers become registers), so it changes nothing in the
    output, but it aborts a build whose mma accumulator rescale sits under a block-uniform guard:
    "Check failed: condition_counter() == 0 (1 vs. 0) : Cannot insert syncs inside condition".
    InjectSoftwarePipeline writes such guards (``if 1 <= seqlen_k``) around the epilogue of a
    pipeline over the symbolic number of K/V tiles. The "shared" and "shared.dyn" syncs are kept.
    """
    original = tvm.s_tir.transform.ThreadSync

    def thread_sync(storage_scope):
        if storage_scope == "warp":
            return tvm.transform.Sequential([], name="tvmflash.NoWarpThreadSync")
        return original(storage_scope)

    with _replaced(tvm.s_tir.transform, "ThreadSync", thread_sync):
        yield


@contextlib.contextmanager
def compact_again_after_match_buffers():
    """Run ``s_tir.transform.CompactBufferAllocation`` a second time, right after
    ``LowerMatchBuffer`` (on the ``StmtSimplify`` that follows it).

    The pipeline compacts buffers once, before ``LowerMatchBuffer``: a tensorized block's
    ``match_buffer`` region then counts as accessed by every thread, so a "local" buffer that each
    lane touches at a lane-dependent index (the sm80 row_state "registers" per-row values: row
    8 k + lane // 4 of each warp, matched as the warp's whole (4, 8) tile by the quad intrinsics)
    keeps the whole warp's shape, indexed with ``threadIdx.x >> 2``, and nvcc puts it in local
    memory. Once the match buffers are lowered, the accesses are plain loads and stores at
    ``[k, threadIdx.x // 4]``, and the same pass (threadIdx is not relaxed for "local" scope)
    shrinks them to the 4 values each thread owns. On the other buffers it is a no-op (the sm80
    "shared" row state's CUDA is byte-identical with and without it).
    """
    original = tvm.s_tir.transform.StmtSimplify
    compact = tvm.s_tir.transform.CompactBufferAllocation

    def simplify_then_compact(*args, **kwargs):
        return tvm.transform.Sequential(
            [original(*args, **kwargs), compact(), original(*args, **kwargs)],
            name="tvmflash.StmtSimplifyThenCompactAgain")

    with _replaced(tvm.s_tir.transform, "StmtSimplify", simplify_then_compact):
        yield


# Function attributes that TVM's CUDA code generator turns into __launch_bounds__ / __maxnreg__.
LAUNCH_BOUNDS_ATTRS = ("tirx.launch_bounds_min_blocks_per_sm", "tirx.launch_bounds_max_blocks_per_cluster",
                       "tirx.max_registers")


@contextlib.contextmanager
def launch_bounds_reach_the_kernel():
    """Copy the launch-bounds attributes of a PrimFunc onto the device kernels that
    ``tirx.transform.SplitHostDevice`` makes of it.

    The CUDA code generator reads ``tirx.launch_bounds_min_blocks_per_sm`` (and the others above)
    from the device kernel, but SplitHostDevice leaves them on the host function, so
    ``__launch_bounds__(threads, min_blocks)`` is never emitted for a scheduled PrimFunc.
    """
    original = tvm.tirx.transform.SplitHostDevice

    def split_keeping_launch_bounds():
        split = original()

        @tvm.transform.module_pass(opt_level=0, name="tvmflash.SplitHostDeviceKeepingLaunchBounds")
        def run(mod, _ctx):
            attrs = {key: func.attrs[key] for func in mod.functions.values()
                     if func.attrs is not None for key in LAUNCH_BOUNDS_ATTRS if key in func.attrs}
            mod = split(mod)
            if not attrs:
                return mod
            kernel_launch = 2  # CallingConv::kDeviceKernelLaunch
            for gvar, func in list(mod.functions.items()):
                if func.attrs is not None and int(func.attrs.get("calling_conv", 0)) == kernel_launch:
                    for key, value in attrs.items():
                        func = func.with_attr(key, value)
                    mod[gvar] = func
            return mod

        return run

    with _replaced(tvm.tirx.transform, "SplitHostDevice", split_keeping_launch_bounds):
        yield


@contextlib.contextmanager
def _codegen_replaced(names, wrap):
    """``CODEGEN_REGISTRY[name] = wrap(original)`` for each name, for the duration: TVM's CUDA code
    generator looks its intrinsics' Python codegen up there when it runs (as ``_replaced`` swaps a
    pass factory)."""
    originals = {name: CODEGEN_REGISTRY[name] for name in names}
    for name, original in originals.items():
        CODEGEN_REGISTRY[name] = wrap(original)
    try:
        yield
    finally:
        CODEGEN_REGISTRY.update(originals)


def _zero_filling_cp_async(original):
    """The 16-byte predicated cp.async as one zero-filling instruction (else: ``original``)."""

    def codegen(args):
        if len(args) != 6 or int(args[4]) != 16:
            return original(args)
        dst, dst_offset, src, src_offset, _, predicate = args
        dst_bytes, src_bytes = (tvm.DataType(str(ptr.ty.element_type.dtype)).bits // 8 for ptr in (dst, src))
        name = f"tvmflash_cp_async_zfill_16_{dst_bytes}_{src_bytes}"
        source = (
            f"\n__forceinline__ __device__ void {name}(void* dst, int dst_off, void* src, int src_off, int predicate) {{\n"
            f"  unsigned int dst_addr = __cvta_generic_to_shared((uint8_t*)dst + dst_off * {dst_bytes});\n"
            f"  uint8_t* src_p = (uint8_t*)src + src_off * {src_bytes};\n"
            "  // src-size 0 reads nothing and fills the 16 bytes with zeros\n"
            '  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"\n'
            '               :: "r"(dst_addr), "l"(src_p), "r"(predicate ? 16 : 0));\n'
            "}\n"
        )
        return cuda_func_call(name, dst, dst_offset, src, src_offset, predicate, source_code=source), []

    return codegen


@contextlib.contextmanager
def zero_filling_cp_async():
    """Emit a bounds-checked 16-byte cp.async as ``cp.async ..., 16, src_size`` (src_size 16 or 0).

    TVM 0.27's codegen of InjectPTXAsyncCopy's predicated copy is ``@p cp.async`` then
    ``@!p st.shared.v4 0``: in SASS an LDGSTS, an STS and three never-executed LDS fillers per
    copy, 80 issue slots per K/V tile at head_dim 128. The zero-filling form is one LDGSTS with the
    same result, as CUTLASS's and Triton's masked copies.
    """
    with _codegen_replaced([name for name in CODEGEN_REGISTRY if name.endswith("cp_async_raw")],
                           _zero_filling_cp_async):
        yield


def _folded(expr):
    """``expr`` with constant boolean and ``if_then_else`` subexpressions folded (enough for the
    wait counts InjectSoftwarePipeline writes; TVM's simplifier leaves ``True & True`` alone)."""
    kind = type(expr).__name__
    if kind in ("BitwiseAnd", "BitwiseOr", "And", "Or"):
        a, b = _folded(expr.a), _folded(expr.b)
        if isinstance(a, tvm.tirx.IntImm) and isinstance(b, tvm.tirx.IntImm):
            value = (a.value and b.value) if kind in ("BitwiseAnd", "And") else (a.value or b.value)
            return tvm.tirx.const(bool(value), "bool")
        return expr
    if kind == "Call" and expr.op.name == "prim.if_then_else":
        condition = _folded(expr.args[0])
        if isinstance(condition, tvm.tirx.IntImm):
            return _folded(expr.args[1] if condition.value else expr.args[2])
    return expr


@contextlib.contextmanager
def constant_async_wait_counts(proxy_fence: bool = False):
    """Fold a cp.async.wait_group count such as ``if_then_else(True & True, 1, 0)`` to its constant.

    InjectSoftwarePipeline writes that form for a pipelined loop whose trip count depends on the
    thread block (causal attention with static shapes, as the tuner builds, and block_m 64), and
    the PTX code generator then rejects it: "cp_async_wait_group: immediate operands must become
    compile-time constants before CUDA codegen".

    proxy_fence: follow each wait with ``fence.proxy.async.shared::cta`` (sm90), for tiles that
    wgmma then reads through the async proxy. The pipeline puts the wait right before the first
    consumer, after the fence and barrier that ThreadSync placed, so without it a tile's
    cp.async writes would be fenced before they have landed.
    """
    def folding(original):
        def codegen(args):
            args = [_folded(arg) for arg in args]
            if not proxy_fence:
                return original(args)
            n = int(args[0])
            helper = f"tvmflash_cp_async_wait_group_{n}_proxy_fence"
            source = (f"\n__forceinline__ __device__ void {helper}() {{\n"
                      f'  asm volatile("cp.async.wait_group {n};\\n\\tfence.proxy.async.shared::cta;" ::: "memory");\n}}\n')
            return cuda_func_call(helper, source_code=source), []

        return codegen

    with _codegen_replaced(["tirx.ptx.cp_async_wait_group"], folding):
        yield


def _is_barrier(stmt) -> bool:
    value = getattr(stmt, "value", None) if type(stmt).__name__ == "Evaluate" else None
    return type(value).__name__ == "Call" and getattr(value.op, "name", "") == "tirx.tvm_storage_sync"


def _with_children(stmt, f):
    """``stmt`` rebuilt with ``f`` applied to each statement directly inside it: the kinds that the
    lowered kernels have around and inside their K/V loops (any other kind is returned as it is)."""
    from tvm import tirx

    kind = type(stmt).__name__
    if kind == "SeqStmt":
        return tirx.SeqStmt([f(s) for s in stmt.seq])
    if kind == "AttrStmt":
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, f(stmt.body))
    if kind == "LetStmt":
        return tirx.LetStmt(stmt.var, stmt.value, f(stmt.body))
    if kind == "IfThenElse":
        other = None if stmt.else_case is None else f(stmt.else_case)
        return tirx.IfThenElse(stmt.condition, f(stmt.then_case), other)
    if kind == "For":
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, f(stmt.body), stmt.thread_binding,
                        stmt.annotations)
    return stmt


def _without_leading_barrier(stmt):
    """``stmt`` with the barrier that opens it (through lets, attributes and sequences) dropped, and
    that barrier (None if there was none)."""
    from tvm import tirx

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
        return _with_children(stmt, lambda _: body), barrier
    return stmt, None


def _tile_wait_first(loop_body):
    """One K/V step of a cp.async pipeline (after ThreadSync) as: wait for the tile this step
    computes, barrier, issue the next tile's copies, compute; or None if it is not that loop.

    What InjectSoftwarePipeline and ThreadSync make is: barrier (the stage about to be refilled was
    read last step), issue the copies, wait, barrier (the tile just waited for), compute. Once the
    wait comes first, its barrier also orders last step's reads before the refill, so one barrier
    is enough. On sm90 the wait's ``fence.proxy.async`` (``constant_async_wait_counts``), a
    ``MEMBAR.ALL.CTA`` in SASS, then also stops waiting for the copies just issued. H200, d128
    bf16 non-causal: sm90 at block_m 256 325 -> 397 TFLOP/s, sm80 324 -> 343 (BENCHMARKS.md).
    """
    from tvm import tirx

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
    in_flight = _folded(count.value)  # static causal shapes: if_then_else(True & True, 1, 0)
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
        return stmt if type(stmt).__name__ == "For" else _with_children(stmt, rewrite)

    return rewrite(loop_body)


def _map_loops(stmt, rewrite_body):
    """``stmt`` with each For loop's body replaced by ``rewrite_body(body)`` where that is not None
    (outermost loops first; a rewritten loop's inner loops are left alone)."""
    if type(stmt).__name__ == "For":
        body = rewrite_body(stmt.body)
        if body is not None:
            return _with_children(stmt, lambda _: body)
    return _with_children(stmt, lambda s: _map_loops(s, rewrite_body))


@contextlib.contextmanager
def one_barrier_per_pipelined_step():
    """After ``ThreadSync("shared.dyn")``, rewrite each cp.async-pipelined loop so that its step
    waits for its tile first (``_tile_wait_first``): one barrier a step instead of two.

    Not a bug fix but a better schedule of the same pipeline, which TVM has no knob for: the
    pipeline's order puts a stage's wait right before its first consumer."""
    from tvm import tirx

    original = tvm.s_tir.transform.ThreadSync

    def thread_sync(storage_scope):
        sync = original(storage_scope)
        if storage_scope != "shared.dyn":
            return sync

        def rewrite_loops(func, _mod, _ctx):
            return func.with_body(_map_loops(func.body, _tile_wait_first))

        return tvm.transform.Sequential(
            [sync, tirx.transform.prim_func_pass(rewrite_loops, opt_level=0, name="tvmflash.OneBarrierPerStep")],
            name="tvmflash.ThreadSyncOneBarrierPerStep")

    with _replaced(tvm.s_tir.transform, "ThreadSync", thread_sync):
        yield


def reversed_loops(mod: tvm.IRModule) -> tvm.IRModule:
    """Each loop annotated ``schedules.common.REVERSED`` visits its iterations last to first: its
    variable i becomes min + extent - 1 - i in the body. The schedules use it on a loop bound to
    blockIdx, whose iterations are independent thread blocks, to choose the order the GPU starts
    them in. TensorIR's Schedule has no primitive that reverses a loop."""
    from tvm import tirx

    from tvmflash.schedules.common import REVERSED

    def reverse(loop):
        if REVERSED not in loop.annotations:
            return loop
        old = loop.loop_var
        new = type(old)(old.name, old.ty)
        flipped = loop.min + loop.extent - 1 - new
        body = _substitute(loop.body, [(old, flipped)])
        annotations = {key: value for key, value in loop.annotations.items() if key != REVERSED}
        return tirx.For(new, loop.min, loop.extent, loop.kind, body, loop.thread_binding, annotations)

    return tvm_ffi.structural_map(mod, (tirx.For, reverse))


def _wait_and_fence_accumulators(attr):
    """The statements for a ``WGMMA_WAIT_PRAGMA`` AttrStmt: ``wgmma.wait_group 0``, a register fence
    of each element of the accumulators its loop reads (local float32 buffers named ``acc``), then
    the loop."""
    from tvm import tirx
    from tvm.script import tirx as T

    from tvmflash.schedules.sm90 import _REG_FENCE

    accumulators = [buffer for name, buffer in _loaded_buffers(attr.body).items()
                    if name.startswith("acc") and buffer.scope() == "local" and str(buffer.dtype) == "float32"]
    fences = [tirx.Evaluate(T.cuda.func_call("tvmflash_wgmma_reg_fence", element, source_code=_REG_FENCE))
              for buffer in accumulators for element in _every_element(buffer)]
    wait = tirx.Evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
    return tirx.SeqStmt([wait, *fences, attr.body])


def _skipped_where_factors_are_one(attr):
    """The statement for a ``SKIP_UNIT_RESCALE_PRAGMA`` AttrStmt: its loop, ``x[i] = x[i] * f[...]``
    over the elements a thread holds, run only where some lane of the warp has a factor other than 1
    (``__any_sync`` over every element of the thread's factor buffers ``f``: a branch the whole warp
    takes or skips, which nvcc keeps as a branch; a per-thread test became a predicate on each
    multiply)."""
    from tvm import tirx

    scaled = {store.buffer.name for store in _find(attr.body, lambda n: type(n).__name__ == "BufferStore")}
    factors = {name: buffer for name, buffer in _loaded_buffers(attr.body).items() if name not in scaled}
    if len(scaled) != 1 or not factors or any(b.scope() != "local" for b in factors.values()):
        raise ValueError(f"{attr.attr_key}: expected a loop that scales one buffer by local factors, got "
                         f"stores to {sorted(scaled)} and factors {sorted(factors)}")
    not_one = [element != tirx.const(1, buffer.dtype) for buffer in factors.values() for element in _every_element(buffer)]
    some_lane = tirx.call_extern("bool", "__any_sync", tirx.const(0xFFFFFFFF, "uint32"), functools.reduce(tirx.Or, not_one))
    return tirx.IfThenElse(some_lane, attr.body, None)


@contextlib.contextmanager
def lowered_pragmas():
    """Turn each loop annotated with one of tvmflash's pragmas (an AttrStmt around it once
    LowerOpaqueBlock has run) into its statements: ``WGMMA_WAIT_PRAGMA``, the wait and fences of
    ``_wait_and_fence_accumulators``, then the loop; ``SKIP_UNIT_RESCALE_PRAGMA``, the loop under
    ``_skipped_where_factors_are_one``'s warp-wide test."""
    from tvm import tirx

    from tvmflash.schedules.common import SKIP_UNIT_RESCALE_PRAGMA, WGMMA_WAIT_PRAGMA

    original = tvm.s_tir.transform.LowerOpaqueBlock
    lowerings = {WGMMA_WAIT_PRAGMA: _wait_and_fence_accumulators, SKIP_UNIT_RESCALE_PRAGMA: _skipped_where_factors_are_one}

    def lower_then_rewrite():
        def rewrite(stmt):  # by hand: structural_map rejects the fences' loads of a buffer defined outside
            if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key in lowerings:
                return lowerings[stmt.attr_key](stmt)
            return _with_children(stmt, rewrite)

        def run(func, _mod, _ctx):
            return func.with_body(rewrite(func.body))
        return tvm.transform.Sequential([original(), tirx.transform.prim_func_pass(run, opt_level=0,
                                                                                   name="tvmflash.LoweredPragmas")])

    with _replaced(tvm.s_tir.transform, "LowerOpaqueBlock", lower_then_rewrite):
        yield


def _uniform_warpgroup_descriptors(func):
    """``func`` with threadIdx.y, in the offsets of its wgmma descriptors, read through a variable set
    once at the kernel's start to thread y of lane 0 (``__shfl_sync``), as CUTLASS's
    canonical_warp_group_idx does. threadIdx.y (the warpgroup) is the same across a warp where
    threadIdx.x spans whole warps, but nvcc does not know that: the Q tile's descriptors, which
    depend on it, then sit in ordinary registers and are moved to uniform ones before every wgmma
    (two R2UR and a constant move each, 16 of the 44 of a d128 K/V step's wgmma issue). After the
    shuffle they are uniform values."""
    from tvm import tirx

    extents = {attr.node.thread_tag: attr for attr in _find(func.body, lambda n: isinstance(n, tirx.AttrStmt)
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
        args[2] = _substitute(args[2], [(thread_y, warpgroup)])
        return tvm.ir.expr.Call(call.op, args, call.attrs, ty_args=call.ty_args, span=call.span, ret_ty=call.ty)

    body = tvm_ffi.structural_map(func.body, (tvm.ir.expr.Call, uniform))
    if not _find(body, lambda n: isinstance(n, tirx.Var) and n.same_as(warpgroup)):
        return func
    lane0 = tirx.call_extern("int32", "__shfl_sync", tirx.const(0xFFFFFFFF, "uint32"), thread_y, 0, 32)
    return func.with_body(_define_after(body, "threadIdx.y", warpgroup, lane0))


def _define_after(stmt, thread_tag, var, value):
    """``stmt`` with ``var = value`` bound first thing inside the thread_extent attribute of ``thread_tag``."""
    from tvm import tirx

    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "thread_extent" and stmt.node.thread_tag == thread_tag:
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, tirx.SeqStmt([tirx.Bind(var, value), stmt.body]))
    return _with_children(stmt, lambda s: _define_after(s, thread_tag, var, value))


@contextlib.contextmanager
def uniform_warpgroup_descriptors():
    """Run ``_uniform_warpgroup_descriptors`` right before CommonSubexprElim (which would move the
    descriptors' offsets into let variables that other statements share)."""
    from tvm import tirx

    original = tirx.transform.CommonSubexprElim

    def uniform_then_cse():
        def run(func, _mod, _ctx):
            return _uniform_warpgroup_descriptors(func)
        return tvm.transform.Sequential([tirx.transform.prim_func_pass(
            run, opt_level=0, name="tvmflash.UniformWarpgroupDescriptors"), original()])

    with _replaced(tirx.transform, "CommonSubexprElim", uniform_then_cse):
        yield


def _block_indices_aliased(func, aliases: dict):
    """``func`` with its blockIdx.* variables read through aliases (new variables, added to
    ``aliases``) in the condition of each IfThenElse that is a loop's whole body: what
    HoistIfThenElse would lift out of that loop."""
    from tvm import tirx

    for attr in _find(func.body, lambda n: isinstance(n, tirx.AttrStmt) and n.attr_key == "thread_extent"):
        if attr.node.thread_tag.startswith("blockIdx"):
            aliases[attr.node.var] = tirx.Var(attr.node.var.name + "_alias", attr.node.var.ty)

    def condition_aliased(loop):
        if not isinstance(loop.body, tirx.IfThenElse):
            return loop
        body = tirx.IfThenElse(_substitute(loop.body.condition, aliases.items()), loop.body.then_case,
                               loop.body.else_case)
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding, loop.annotations)
    return func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, condition_aliased))) if aliases else func


@contextlib.contextmanager
def hoisted_block_index_conditions():
    """TVM's HoistIfThenElse leaves a condition in its loop when the condition reads a thread index,
    blockIdx.* included, although a block index is the same for the whole kernel body. The causal
    tile test (``program.tile_visible``) reads the Q block, so on sm90 each of a causal K/V step's
    score elements kept its own branch on it (d128: 762 SASS instructions a step against 472; d64:
    1241 against 657), where the non-causal test is hoisted out of the element loops. The block
    indices are renamed in the conditions for the pass (a block index is bound around the whole
    kernel, outside every loop the pass can hoist out of) and restored after it."""
    from tvm import s_tir, tirx

    original = s_tir.transform.HoistIfThenElse

    def renamed_hoist_restored(*args):
        aliases = {}  # block index -> its alias, per function
        restored = lambda f, _m, _c: f.with_body(_substitute(f.body, [(a, v) for v, a in aliases.items()]))  # noqa: E731
        return tvm.transform.Sequential([
            tirx.transform.prim_func_pass(lambda f, _m, _c: _block_indices_aliased(f, aliases), opt_level=0,
                                          name="tvmflash.AliasBlockIndices"),
            original(*args),
            tirx.transform.prim_func_pass(restored, opt_level=0, name="tvmflash.RestoreBlockIndices")])

    with _replaced(s_tir.transform, "HoistIfThenElse", renamed_hoist_restored):
        yield


@contextlib.contextmanager
def applied(async_proxy_operands: bool = False, hoist_block_index_conditions: bool = False):
    """Every workaround above, for one build (``kernel.build_module``). async_proxy_operands: the
    schedule's tensor-core operands are read through the async proxy (wgmma).
    hoist_block_index_conditions: ``hoisted_block_index_conditions`` (sm90 only: on the H200 the sm80
    schedule's causal d64 kernel lost 10% with it, while d128 gained 6%; BENCHMARKS.md, session 14)."""
    with lower_every_warp_buffer(), no_warp_thread_sync(), compact_again_after_match_buffers(), \
            launch_bounds_reach_the_kernel(), zero_filling_cp_async(), lowered_pragmas(), \
            constant_async_wait_counts(proxy_fence=async_proxy_operands), one_barrier_per_pipelined_step(), \
            uniform_warpgroup_descriptors(), \
            hoisted_block_index_conditions() if hoist_block_index_conditions else contextlib.nullcontext():
        yield
