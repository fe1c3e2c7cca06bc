"""``WidenGlobalIndices``: indices into global buffers computed in int64, for tensors of 2**31 elements
or more (``annotations.WIDE_INDICES_ATTR``)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from tvmflash.lowering.ir import prim_func_pass


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
