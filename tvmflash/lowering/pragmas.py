"""``LowerPragmas``: the loops that schedules annotate with one of tvmflash's pragmas
(``annotations.WGMMA_WAIT_PRAGMA``, ``SKIP_UNIT_RESCALE_PRAGMA``, ``ATOMIC_ADD_PRAGMA``) become the
statements each asks for; a schedule has no primitive that inserts a statement."""

from __future__ import annotations

import functools
import math

import tvm
import tvm_ffi
from tvm import tirx
from tvm.script import tirx as T

from tvmflash.lowering.annotations import (ATOMIC_ADD_PRAGMA, BULK_REDUCE_BARRIER, BULK_REDUCE_PRAGMA,
                                           BULK_REDUCE_WAIT_PRAGMA, MERGED_ATOMIC_ADD_PRAGMA, REG_FENCE, REG_FENCE_PAIR,
                                           SKIP_UNIT_RESCALE_PRAGMA, VECTOR_REDUCE_PRAGMA, WGMMA_WAIT_PRAGMA)
from tvmflash.lowering.ir import (every_element, find, is_load, loaded, loaded_buffers, prim_func_pass, substitute,
                                  target_of, transform, with_children)
from tvmflash.lowering.tma_device_functions import device_statement, untracked_pointer


def _wait_and_fence_accumulators(attr, func=None):
    """The statements for a ``WGMMA_WAIT_PRAGMA`` AttrStmt: ``wgmma.wait_group 0``, a register fence
    of each element of the accumulators its loop reads (local float32 buffers whose names start with
    the pragma's value where it is a string, else with ``acc``), then the loop. A value
    "accumulators+operands" also fences, as 32-bit pairs, the 16-bit local buffers of ``func`` whose
    names start with "operands": the A registers of an "rs" wgmma that was only committed, which
    the compiler would otherwise reuse while the wgmma still reads them."""
    value = attr.value.value if isinstance(attr.value, tvm.ir.StringImm) else "acc"
    prefix, _, operands = value.partition("+")
    accumulators = [buffer for name, buffer in loaded_buffers(attr.body).items()
                    if name.startswith(prefix) and buffer.scope() == "local" and str(buffer.dtype) == "float32"]
    fences = [tirx.Evaluate(T.cuda.func_call("tvmflash_wgmma_reg_fence", element, source_code=REG_FENCE))
              for buffer in accumulators for element in every_element(buffer)]
    if operands:
        stored = {store.buffer.name: store.buffer for store in find(func.body, tirx.BufferStore)}
        pairs = [element for name, b in stored.items() if name.startswith(operands) and b.scope() == "local"
                 and tvm.DataType(b.dtype).bits == 16 for element in every_element(b)[::2]]
        if not pairs:
            raise ValueError(f"{WGMMA_WAIT_PRAGMA}: no 16-bit local buffer named {operands}* to fence")
        fences += [tirx.Evaluate(T.cuda.func_call("tvmflash_wgmma_reg_fence_pair", element,
                                                  source_code=REG_FENCE_PAIR)) for element in pairs]
    wait = tirx.Evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
    return tirx.SeqStmt([wait, *fences, attr.body])


def _skipped_where_factors_are_one(attr):
    """The statement for a ``SKIP_UNIT_RESCALE_PRAGMA`` AttrStmt: its loop, ``x[i] = x[i] * f[...]``
    over the elements a thread holds, run only where some lane of the warp has a factor other than 1
    (``__any_sync`` over every element of the thread's factor buffers ``f``: a branch the whole warp
    takes or skips, which nvcc keeps as a branch; a per-thread test became a predicate on each
    multiply)."""
    scaled = {store.buffer.name for store in find(attr.body, tirx.BufferStore)}
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
    return _pointer(tirx.BufferLoad(store.buffer, store.indices))


def _pointer(load):
    return tirx.call_intrin("handle", "tirx.address_of", load)


RED_ADD_V2 = ("__device__ __forceinline__ void tvmflash_red_add_v2(float* address, float a, float b) "
              '{ asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(address), "f"(a), "f"(b) : "memory"); }')


def _adjacent_pair(loop):
    """(first, second): the two stores of a loop of two float32 stores to provably adjacent elements, else
    None."""
    store = loop.body
    if not (int(loop.extent) == 2 and isinstance(store, tirx.BufferStore) and str(store.buffer.dtype) == "float32"):
        return None
    first, second = (substitute(store, [(loop.loop_var, loop.min + e)]) for e in range(2))
    offsets = [_flat_offset(tirx.BufferLoad(s.buffer, s.indices)) for s in (first, second)]
    return (first, second) if _provably_one(offsets[1] - offsets[0]) else None


def _paired_atomic_add(loop):
    """A loop of two float32 additions to adjacent elements (x[i + e] = x[i + e] + y[e], e = 0, 1, i
    even) as one vector reduction (``red.global.add.v2.f32``, sm_90): half the atomic operations."""
    pair = _adjacent_pair(loop)
    if pair is None:
        return None
    first, second = pair
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


WARP_MERGED_ADD = (
    "template <typename I> __device__ __forceinline__ void tvmflash_warp_merged_add(float* base, I offset, float value) "
    "{ I first = __shfl_sync(0xffffffffu, offset, 0); "
    "if (__all_sync(0xffffffffu, offset == first)) { if (first < 0) return; "
    "for (int d = 16; d > 0; d >>= 1) value += __shfl_xor_sync(0xffffffffu, value, d); "
    "if ((threadIdx.x & 31) == 0) atomicAdd(base + first, value); } "
    "else if (offset >= 0) { atomicAdd(base + offset, value); } }")


def _merged_atomic_adds(attr):
    """The statement for a ``MERGED_ATOMIC_ADD_PRAGMA`` AttrStmt: its loop, each store ``x[i] = x[i] + y``
    summed into a run of this thread's (a local index and sum a buffer x) that is added atomically where the
    index changes, and once more after the loop; there, with the pragma's value 2 (whole warps, converged
    after the loop), a warp whose runs all end on one element adds their sum once (``WARP_MERGED_ADD``)."""
    runs = {}  # buffer -> (its run's index, its run's sum): local buffers

    def run_element(buffer):
        index = runs[buffer][0]
        return tirx.BufferLoad(buffer, [tirx.BufferLoad(index, [d]) for d in range(len(buffer.shape))])

    def flush(buffer):
        index, total = runs[buffer]
        add = tirx.Evaluate(T.cuda.atomic_add(_pointer(run_element(buffer)), tirx.BufferLoad(total, [0])))
        return tirx.IfThenElse(tirx.BufferLoad(index, [0]) >= 0, add, None)  # -1: no run yet

    def warp_flush(buffer):
        index, total = runs[buffer]
        offset = tirx.Select(tirx.BufferLoad(index, [0]) >= 0, _flat_offset(run_element(buffer)),
                             tirx.const(-1, str(index.dtype)))
        base = _pointer(tirx.BufferLoad(buffer, [tirx.const(0, str(index.dtype))] * len(buffer.shape)))
        return tirx.Evaluate(T.cuda.func_call("tvmflash_warp_merged_add", base, offset, tirx.BufferLoad(total, [0]),
                                              source_code=WARP_MERGED_ADD))

    def merged(store):
        buffer, indices, value = store.buffer, list(store.indices), _addend(store)
        if buffer not in runs:
            runs[buffer] = (tirx.decl_buffer((len(indices),), str(indices[0].ty), f"{buffer.name}_run", scope="local"),
                            tirx.decl_buffer((1,), "float32", f"{buffer.name}_run_sum", scope="local"))
        index, total = runs[buffer]
        names = [tirx.Var(f"{buffer.name}_i{d}", str(index.ty)) for d, index in enumerate(indices)]
        addend = tirx.Var(f"{buffer.name}_addend", str(value.ty))
        changed = functools.reduce(tirx.Or, [n != tirx.BufferLoad(index, [d]) for d, n in enumerate(names)])
        restart = tirx.SeqStmt([flush(buffer), *(tirx.BufferStore(index, n, [d]) for d, n in enumerate(names)),
                                tirx.BufferStore(total, tirx.const(0, "float32"), [0])])
        return tirx.SeqStmt([*(tirx.Bind(var, bound) for var, bound in [*zip(names, indices), (addend, value)]),
                             tirx.IfThenElse(changed, restart, None),
                             tirx.BufferStore(total, tirx.BufferLoad(total, [0]) + addend, [0])])

    if any(str(store.buffer.dtype) != "float32" for store in find(attr.body, tirx.BufferStore)):
        raise ValueError(f"{MERGED_ATOMIC_ADD_PRAGMA}: expected float32 additions, got {attr.body}")
    body = transform(attr.body, tirx.BufferStore, merged)
    start = []
    for index, total in runs.values():
        start += [tirx.AllocBuffer(index), tirx.AllocBuffer(total), tirx.BufferStore(index, tirx.const(-1, str(index.dtype)), [0]),
                  tirx.BufferStore(total, tirx.const(0, "float32"), [0])]
    last = warp_flush if int(attr.value) == 2 else flush
    return tirx.SeqStmt([*start, body, *(last(buffer) for buffer in runs)])


def _has_vector_reductions(func) -> bool:
    """Does the function's target have ``red.global.add.v2.f32`` (CUDA sm_90 and newer)?"""
    target = target_of(func, "cuda")
    arch = str(target.attrs.get("arch", "")) if target is not None else ""
    return arch.startswith("sm_") and int("".join(c for c in arch[3:] if c.isdigit()) or 0) >= 90


def _thread_index(func, tag: str):
    """The variable of ``func``'s thread index ``tag`` ("threadIdx.x")."""
    found = find(func.body, tirx.AttrStmt, lambda n: n.attr_key == "thread_extent" and n.node.thread_tag == tag)
    if not found:
        raise ValueError(f"the kernel binds no {tag}")
    return found[0].node.var


def _flat_offset(load):
    """The element offset of a load of a (shared-memory) buffer, from its strides or shape."""
    buffer = loaded(load)
    strides = list(buffer.strides)
    if not strides:
        strides, stride = [], tirx.const(1, "int32")
        for extent in reversed(list(buffer.shape)):
            strides.insert(0, stride)
            stride = stride * extent
    return functools.reduce(lambda a, b: a + b, [i * s for i, s in zip(load.indices, strides)])


def _row_additions(attr):
    """(rows, columns, store) of a ``BULK_REDUCE_PRAGMA`` or ``VECTOR_REDUCE_PRAGMA`` AttrStmt: a loop over
    rows, in it one over a row's columns, in it one float32 store ``x[...] = x[...] + y[...]`` (y a
    load); None if its loops are not that."""
    rows = attr.body
    columns = getattr(rows, "body", None)
    store = getattr(columns, "body", None)
    if (isinstance(rows, tirx.For) and isinstance(columns, tirx.For) and isinstance(store, tirx.BufferStore)
            and str(store.buffer.dtype) == "float32" and is_load(_addend(store))):
        return rows, columns, store
    return None


def _refused_rows(attr, expected: str = "") -> ValueError:
    return ValueError(f"{attr.attr_key}: expected rows of float32 stores x[...] = x[...] + y[...]{expected}, "
                      f"got {attr.body}")


def _bulk_reductions(attr, func):
    """The statements for a ``BULK_REDUCE_PRAGMA`` AttrStmt (``annotations``): a fence and the
    warpgroup's named barrier, then thread i of the warpgroup adds row i by one bulk reduction."""
    found = _row_additions(attr)
    if found is None:
        raise _refused_rows(attr)
    rows, columns, store = found
    x, y = _thread_index(func, "threadIdx.x"), _thread_index(func, "threadIdx.y")
    first = substitute(store, [(rows.loop_var, rows.min + x), (columns.loop_var, columns.min)])
    last = substitute(store, [(rows.loop_var, rows.min + x), (columns.loop_var, columns.min + columns.extent - 1)])
    analyzer = tvm.sym.Analyzer()
    for a, b in ((tirx.BufferLoad(first.buffer, first.indices), tirx.BufferLoad(last.buffer, last.indices)),
                 (_addend(first), _addend(last))):  # each row contiguous in both buffers
        if not analyzer.can_prove_equal(_flat_offset(b) - _flat_offset(a), columns.extent - 1):
            raise ValueError(f"{BULK_REDUCE_PRAGMA}: a row's columns are not contiguous in {loaded(a).name}")
    bytes_ = int(columns.extent) * 4
    if bytes_ % 16:
        raise ValueError(f"{BULK_REDUCE_PRAGMA}: a bulk reduction moves multiples of 16 bytes, got rows of {bytes_}")
    source = _addend(first)
    issue = tirx.SeqStmt([
        device_statement("tvmflash_bulk_reduce_add_f32", _address(first),
                         untracked_pointer(loaded(source), _flat_offset(source)), bytes_),
        device_statement("tvmflash_bulk_commit")])
    return tirx.SeqStmt([device_statement("tvmflash_fence_proxy_async"),
                         device_statement("tvmflash_named_barrier", BULK_REDUCE_BARRIER + y, attr.value),
                         tirx.IfThenElse(x < rows.extent, issue, None)])


def _vector_reductions(attr, func):
    """The statements for a ``VECTOR_REDUCE_PRAGMA`` AttrStmt (``annotations``): the warpgroup's named
    barrier, then its threads add the rows four columns at a time, consecutive threads consecutive
    columns (a warp's reductions cover whole 128-byte lines), reading them from shared memory."""
    threads = int(attr.value)
    found = _row_additions(attr)
    if found is None or int(found[1].extent) % 4 or int(found[0].extent) * int(found[1].extent) % (4 * threads):
        raise _refused_rows(attr, f", their columns a multiple of 4 and their elements of 4 x {threads}")
    rows, columns, store = found
    x, y = _thread_index(func, "threadIdx.x"), _thread_index(func, "threadIdx.y")
    quads = int(columns.extent) // 4  # a row's groups of four columns
    adds = []
    for n in range(int(rows.extent) * quads // threads):
        k = x + n * threads
        element = substitute(store, [(rows.loop_var, rows.min + k // quads),
                                     (columns.loop_var, columns.min + k % quads * 4)])
        source = _addend(element)
        adds.append(device_statement("tvmflash_red_add_v4_shared", _address(element),
                                     untracked_pointer(loaded(source), _flat_offset(source))))
    return tirx.SeqStmt([device_statement("tvmflash_named_barrier", BULK_REDUCE_BARRIER + y, threads), *adds])


def _provably_one(difference, depth: int = 2) -> bool:
    """Whether ``difference`` is 1 for every value of its variables. Where the analyzer cannot prove it
    at once, case by case over the residues of a variable v that it takes modulo a constant m (v ->
    m v + k, k < m), ``depth`` variables deep: a swizzled layout's XOR of bits, ((8 a + 2 (t % 4) + 1)
    % 32 // 16, is beyond its rewrite rules, but not once t % 4 is a constant."""
    analyzer = tvm.sym.Analyzer()
    if analyzer.can_prove_equal(difference, 1):
        return True
    residues = find(difference, tirx.FloorMod, lambda n: isinstance(n.a, tirx.Var)
                    and isinstance(n.b, tirx.IntImm) and 1 < n.b.value <= 8)
    if depth == 0 or not residues:
        return False
    var, m = residues[0].a, residues[0].b.value
    return all(_provably_one(substitute(difference, [(var, var * m + k)]), depth - 1) for k in range(m))


def _untracked_pair(loop):
    """A loop of two float32 stores to adjacent shared-memory elements as one ``st.shared.v2.f32``
    through a pointer that ThreadSync does not count (None if it is not that loop)."""
    pair = _adjacent_pair(loop)
    if pair is None:
        return None
    first, second = pair
    return device_statement("tvmflash_store_shared_v2",
                            untracked_pointer(first.buffer, _flat_offset(tirx.BufferLoad(first.buffer, first.indices))),
                            first.value, second.value)


def _bulk_reductions_read(attr, func):
    """The statements for a ``BULK_REDUCE_WAIT_PRAGMA`` AttrStmt (``annotations``). The loop's stores
    of adjacent pairs go through pointers that ThreadSync does not count: the barriers here order them
    (ThreadSync, which runs after common subexpressions became let variables, cannot see that each
    thread rewrites its own elements, and would add two block-wide barriers a step)."""
    if int(attr.value) == 0:
        return tirx.SeqStmt([device_statement("tvmflash_bulk_wait"), attr.body])
    y = _thread_index(func, "threadIdx.y")
    stores = transform(attr.body, tirx.For, _untracked_pair)
    if find(stores, tirx.BufferStore):
        raise ValueError(f"{BULK_REDUCE_WAIT_PRAGMA}: expected stores of adjacent float32 pairs")
    return tirx.SeqStmt([device_statement("tvmflash_bulk_wait_read"),
                         device_statement("tvmflash_named_barrier", BULK_REDUCE_BARRIER + y, attr.value), stores])


def _pragma_lowerings(func) -> dict:
    """Each of tvmflash's pragmas and the function that lowers its AttrStmt, for ``func``'s target."""
    return {WGMMA_WAIT_PRAGMA: functools.partial(_wait_and_fence_accumulators, func=func),
            SKIP_UNIT_RESCALE_PRAGMA: _skipped_where_factors_are_one,
            ATOMIC_ADD_PRAGMA: functools.partial(_atomic_adds, vector=_has_vector_reductions(func)),
            MERGED_ATOMIC_ADD_PRAGMA: _merged_atomic_adds,
            BULK_REDUCE_PRAGMA: functools.partial(_bulk_reductions, func=func),
            VECTOR_REDUCE_PRAGMA: functools.partial(_vector_reductions, func=func),
            BULK_REDUCE_WAIT_PRAGMA: functools.partial(_bulk_reductions_read, func=func)}


def _lowered_pragmas(stmt, lowerings: dict):  # by hand: structural_map rejects the fences' loads
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key in lowerings:  # a loop's inner pragmas first
        inner = _lowered_pragmas(stmt.body, lowerings)
        return lowerings[stmt.attr_key](tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, inner))
    return with_children(stmt, lambda child: _lowered_pragmas(child, lowerings))


def LowerPragmas():  # noqa: N802
    """After ``LowerOpaqueBlock`` (which turns a loop's pragma annotation into an AttrStmt around it):
    each loop annotated with one of tvmflash's pragmas becomes its statements. ``WGMMA_WAIT_PRAGMA``:
    the wait and fences of ``_wait_and_fence_accumulators``, then the loop;
    ``SKIP_UNIT_RESCALE_PRAGMA``: the loop under ``_skipped_where_factors_are_one``'s warp-wide test;
    ``ATOMIC_ADD_PRAGMA``: the loop with its additions atomic (``_atomic_adds``)."""
    return prim_func_pass(lambda func: func.with_body(_lowered_pragmas(func.body, _pragma_lowerings(func))),
                          "tvmflash.LowerPragmas")
