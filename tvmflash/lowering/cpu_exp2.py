"""``PolynomialExp2OnCPU``: float32 ``exp2`` on the CPU (llvm) as a polynomial that vectorises."""

from __future__ import annotations

import tvm
from tvm import tirx

from tvmflash.lowering.ir import is_call, prim_func_pass, target_of, transform


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
    math library is linked), which took a large share of the CPU forward's time; the polynomial
    vectorises with the loop around it. CUDA keeps its ``ex2.approx``."""
    def rewrite(func):
        if target_of(func, "llvm") is None:
            return func
        return func.with_body(transform(func.body, tvm.ir.expr.Call, lambda call: polynomial_exp2(call.args[0])
                                        if is_call(call, "tirx.exp2") and str(call.ty) == "float32" else None))
    return prim_func_pass(rewrite, "tvmflash.PolynomialExp2OnCPU")
