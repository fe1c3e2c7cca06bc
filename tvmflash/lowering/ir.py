"""Small helpers over TIR that the lowering passes share: finding, substituting and rebuilding nodes."""

from __future__ import annotations

import itertools

import tvm
import tvm_ffi
from tvm import tirx


# The classes of a load and a call node (TVM 0.27's ``tirx.BufferLoad`` is a function that makes a TensorLoad).
LOAD = tvm.ir.expr.TensorLoad
CALL = tvm.ir.expr.Call


def find(stmt, kind, where=None) -> list:
    """The nodes of ``kind`` (a class or a tuple of classes) under ``stmt`` (itself included) for which
    ``where`` holds (default: all), in walk order.

    The walk matches ``kind`` itself, in C++: a lowered backward has some 10^5 nodes, and a Python call
    for each of them in each search made the searches half of a module's build time."""
    found = []
    tvm_ffi.structural_walk(stmt, (kind, found.append if where is None else
                                   lambda node: found.append(node) if where(node) else None))
    return found


def find_attrs(stmt, key) -> list:
    """The AttrStmts of ``key`` under ``stmt``, in walk order."""
    return find(stmt, tirx.AttrStmt, lambda n: n.attr_key == key)


def substitute(expr, values):
    """``expr`` with each variable of ``values`` ((var, value) pairs) replaced."""
    def apply(var):
        return next((value for v, value in values if v.same_as(var)), var)
    return tvm_ffi.structural_map(expr, (tirx.Var, apply))


def let_values(stmt) -> list:
    """(variable, value) of each let binding under ``stmt`` (``Bind`` statements; TVM 0.27's LetStmt is one)."""
    return [(node.var, node.value) for node in find(stmt, tirx.Bind)]


def inlined(expr, lets: list):
    """``expr`` with the let variables of ``lets`` ((var, value) pairs) replaced by their values,
    until none is left (a value may read other let variables)."""
    for _ in range(len(lets) + 1):
        replaced = substitute(expr, lets)
        if tvm_ffi.structural_equal(replaced, expr):
            return expr
        expr = replaced
    return expr


def transform(stmt, kind, rewrite):
    """``stmt`` with each node of ``kind`` replaced by ``rewrite(node)`` where that is not None
    (post order: a node's children are rewritten first)."""
    def apply(node):
        new = rewrite(node)
        return node if new is None else new
    return tvm_ffi.structural_map(stmt, (kind, apply))


def is_attr(node, key) -> bool:
    return isinstance(node, tirx.AttrStmt) and node.attr_key == key


def unmarked(stmt, key):
    """``stmt`` with each ``key`` mark (an AttrStmt that a pass put there) replaced by what it marks."""
    return transform(stmt, tirx.AttrStmt, lambda n: n.body if is_attr(n, key) else None)


def is_load(node) -> bool:
    return isinstance(node, LOAD)


def loaded(load):
    """The buffer a load reads (``source`` on TVM 0.27's TensorLoad)."""
    return load.buffer if hasattr(load, "buffer") else load.source


def loaded_buffers(stmt) -> dict:
    """The buffers that loads under ``stmt`` read, by name."""
    return {loaded(load).name: loaded(load) for load in find(stmt, LOAD)}


def every_element(buffer) -> list:
    """A load of each element of a (small, static) buffer, in row-major order."""
    return [tirx.BufferLoad(buffer, list(index)) for index in itertools.product(*(range(int(e)) for e in buffer.shape))]


def is_call(node, op_name: str) -> bool:
    return isinstance(node, tvm.ir.expr.Call) and getattr(node.op, "name", "") == op_name


def is_barrier(stmt) -> bool:
    """Is ``stmt`` a block-wide barrier (ThreadSync's ``tvm_storage_sync``)?"""
    return isinstance(stmt, tirx.Evaluate) and is_call(stmt.value, "tirx.tvm_storage_sync")


def with_children(stmt, f):
    """``stmt`` rebuilt with ``f`` applied to each statement directly inside it: the kinds that the
    lowered kernels have around and inside their K/V loops (any other kind is returned as it is)."""
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


def map_loops(stmt, rewrite_body):
    """``stmt`` with each For loop's body replaced by ``rewrite_body(body)`` where that is not None
    (outermost loops first; a rewritten loop's inner loops are left alone)."""
    if type(stmt).__name__ == "For":
        body = rewrite_body(stmt.body)
        if body is not None:
            return with_children(stmt, lambda _: body)
    return with_children(stmt, lambda s: map_loops(s, rewrite_body))


def folded(expr):
    """``expr`` with constant boolean and ``if_then_else`` subexpressions folded (enough for the
    wait counts InjectSoftwarePipeline writes; TVM's simplifier leaves ``True & True`` alone)."""
    kind = type(expr).__name__
    if kind in ("BitwiseAnd", "BitwiseOr", "And", "Or"):
        a, b = folded(expr.a), folded(expr.b)
        if isinstance(a, tirx.IntImm) and isinstance(b, tirx.IntImm):
            value = (a.value and b.value) if kind in ("BitwiseAnd", "And") else (a.value or b.value)
            return tirx.const(bool(value), "bool")
        return expr
    if kind == "Call" and expr.op.name == "prim.if_then_else":
        condition = folded(expr.args[0])
        if isinstance(condition, tirx.IntImm):
            return folded(expr.args[1] if condition.value else expr.args[2])
    return expr


def target_of(func, kind: str):
    """The target ``tvm.compile`` bound to ``func`` where it is of ``kind`` ("cuda", "llvm"), else None."""
    target = func.attrs.get("target") if func.attrs is not None else None
    return target if target is not None and target.kind.name == kind else None


def prim_func_pass(function, name: str):
    """A pass that maps each PrimFunc of a module through ``function(func) -> func``."""
    return tirx.transform.prim_func_pass(lambda func, _mod, _ctx: function(func), opt_level=0, name=name)
