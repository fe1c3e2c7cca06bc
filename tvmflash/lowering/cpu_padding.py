"""``VersionPaddedLoads``: on the CPU (llvm), a loop nest that loads a tile zero-padded past the end of
its rows (``program``'s ``load_q``, ``load_k``, ``load_v``: ``T.if_then_else(row < seqlen, X[...], 0)``)
runs a second copy without the test wherever the whole nest's rows are inside.

The test guards a load that may not be made past the end of the tensor, so LLVM keeps a branch around
each element's load and store, and neither vectorises nor merges them; inside, the copy is plain loads
and stores. Only a tile at the end of the sequence pays for the padding, as the score's mask is paid
only on the tiles that straddle it (``program.tile_visible``)."""

from __future__ import annotations

import tvm
from tvm import tirx

from tvmflash.lowering.ir import find, is_call, prim_func_pass, target_of, transform, with_children

_BOUNDS = {"LT": (False, True), "LE": (False, False), "GT": (True, True), "GE": (True, False)}


def _all_true(cond, ranges: dict, analyzer):
    """A condition under which ``cond`` holds for every value of the loop variables in ``ranges``
    (a comparison, or an ``and`` of them, bounded over the loops), or None where there is none."""
    kind = type(cond).__name__
    if kind == "And":
        a, b = (_all_true(c, ranges, analyzer) for c in (cond.a, cond.b))
        return None if a is None or b is None else tirx.And(a, b)
    if kind not in _BOUNDS:
        return None
    flipped, strict = _BOUNDS[kind]
    difference = cond.b - cond.a if flipped else cond.a - cond.b  # cond: difference < 0 (<= 0)
    if not str(difference.ty).startswith("int") or find(difference, tvm.ir.expr.TensorLoad):
        return None  # a bound on integer positions alone, never on loaded values
    highest = analyzer.int_set(difference, ranges).max_value
    if find(highest, tirx.Var, lambda v: v.name == "pos_inf" or any(v.same_as(loop) for loop in ranges)):
        return None  # unbounded, or not free of the loops
    zero = tirx.const(0, str(highest.ty))
    return highest < zero if strict else highest <= zero


def _padded_loads(store):
    """The ``if_then_else(cond, value with a load, constant)`` of a store's value."""
    return find(store.value, tvm.ir.expr.Call, lambda c: is_call(c, "prim.if_then_else")
                and find(c.args[1], tvm.ir.expr.TensorLoad) and isinstance(c.args[2], (tirx.IntImm, tirx.FloatImm)))


def _nest(stmt):
    """(loops, store) of a perfect nest of serial, vectorised or unrolled loops around one store, else None."""
    loops = []
    while isinstance(stmt, tirx.For) and stmt.kind != tirx.ForKind.PARALLEL:
        loops.append(stmt)
        stmt = stmt.body
    return (loops, stmt) if loops and isinstance(stmt, tirx.BufferStore) else None


def _versioned(stmt, analyzer):
    nest = _nest(stmt) if isinstance(stmt, tirx.For) else None
    if nest is None:
        return with_children(stmt, lambda child: _versioned(child, analyzer))
    loops, store = nest
    padded = _padded_loads(store)
    if not padded:
        return stmt
    ranges = {loop.loop_var: tvm.sym.IntervalSet(loop.min, loop.min + loop.extent - 1) for loop in loops}
    inside = [_all_true(call.args[0], ranges, analyzer) for call in padded]
    if any(condition is None for condition in inside):
        return stmt
    unpadded = transform(stmt, tvm.ir.expr.Call, lambda c: c.args[1] if any(c.same_as(p) for p in padded) else None)
    condition = inside[0]
    for other in inside[1:]:
        condition = tirx.And(condition, other)
    return tirx.IfThenElse(analyzer.simplify(condition), unpadded, stmt)


def VersionPaddedLoads():  # noqa: N802
    """After ``FlattenBuffer``, before the bf16 legalisation and ``VectorizeLoop``, in the functions built for
    the CPU (llvm): each perfect loop nest around a store of a zero-padded load (``if_then_else(row <
    seqlen, X[...], 0)``, a comparison or an ``and`` of them) becomes ``if`` every row of the nest is
    inside: the nest with the plain load, ``else`` the nest as it was. CUDA's loads are predicated
    copies, and stay as they are."""
    def rewrite(func):
        if target_of(func, "llvm") is None:
            return func
        return func.with_body(_versioned(func.body, tvm.sym.Analyzer()))
    return prim_func_pass(rewrite, "tvmflash.VersionPaddedLoads")
