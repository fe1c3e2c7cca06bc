"""Exact e4m3 (float8_e4m3fn) conversions by integer operations on the bits, for the programs on targets
that have no FP8 conversion of their own (the CPU, sm_80, sm_86: ``target.converts_fp8``), where TVM's
legalized one is wrong at zero and the subnormals: e4m3 -> float32 (``e4m3_bits_to_float32``: an FP8 cache's
and the FP8 forward's K/V bytes) and float32 -> e4m3's value (``float32_to_e4m3_value``: the FP8 forward's P),
so that a CPU check of an FP8 program quantises where, and as, the GPU's cvt and wgmma do."""

from __future__ import annotations

from tvm.script import tirx as T

E4M3_MAX = 448.0  # S.1111.110; S.1111.111 is NaN (fn: no infinity)


def e4m3_bits_to_float32(x):
    """The e4m3 (fn: no infinity; S.1111.111 NaN) value of the bits x (uint8) as float32: exact, zero and
    the subnormals included, by integer operations (for the targets where TVM's legalized conversion is wrong
    there: ``target.converts_fp8``)."""
    bits = T.cast(x, "uint32")
    sign = (bits >> T.uint32(7)) << T.uint32(31)
    exponent = (bits >> T.uint32(3)) & T.uint32(15)
    mantissa = bits & T.uint32(7)
    # a normal value: exponent bias 7 -> float32's 127, mantissa's 3 bits on top of float32's 23
    normal = T.reinterpret("float32", sign | ((exponent + T.uint32(120)) << T.uint32(23)) | (mantissa << T.uint32(20)))
    # a subnormal: mantissa * 2^-9 (0 included), with the sign
    subnormal = T.reinterpret("float32", sign | T.reinterpret("uint32", T.cast(mantissa, "float32") * T.float32(2.0 ** -9)))
    nan = T.reinterpret("float32", T.uint32(0x7FC00000))
    return T.if_then_else((bits & T.uint32(127)) == T.uint32(127), nan,
                          T.if_then_else(exponent == T.uint32(0), subnormal, normal))


def float32_to_e4m3_value(x):
    """x (float32) rounded to e4m3 as cvt.rn.satfinite.e4m3x2.f32 does, as a float32: to nearest, ties to even,
    the subnormals (multiples of 2^-9 below 2^-6) included, finite values past 448 saturating to +-448,
    NaN kept. By integer operations on x's bits, so that no step is a floating-point one a compiler may
    reassociate."""
    bits = T.reinterpret("uint32", x)
    sign = bits & T.uint32(0x80000000)
    magnitude = bits & T.uint32(0x7FFFFFFF)
    # a normal e4m3 (|x| >= 2^-6): float32's 23 mantissa bits to 3, to nearest even (a carry moves the exponent)
    kept = (magnitude >> T.uint32(20)) & T.uint32(1)
    normal = (magnitude + T.uint32(0x7FFFF) + kept) & T.uint32(0xFFF00000)
    normal = T.min(normal, T.uint32(0x43E00000))  # 448's bits: satfinite
    # a subnormal e4m3: |x| / 2^-9 = m * 2^(E - 141) (m with float32's implicit bit) to the nearest even integer
    exponent = magnitude >> T.uint32(23)
    m = (magnitude & T.uint32(0x7FFFFF)) | T.if_then_else(exponent > T.uint32(0), T.uint32(0x800000), T.uint32(0))
    shift = T.min(T.uint32(141) - T.min(exponent, T.uint32(120)), T.uint32(31))  # >= 21: E <= 120 here
    whole = m >> shift
    rest = m & ((T.uint32(1) << shift) - T.uint32(1))
    half = T.uint32(1) << (shift - T.uint32(1))
    up = T.Or(rest > half, T.And(rest == half, (whole & T.uint32(1)) == T.uint32(1)))
    steps = whole + T.if_then_else(up, T.uint32(1), T.uint32(0))  # 0 .. 8 (8: the smallest normal, 2^-6)
    subnormal = T.reinterpret("uint32", T.cast(steps, "float32") * T.float32(2.0 ** -9))
    rounded = T.if_then_else(magnitude >= T.uint32(0x3C800000), normal, subnormal)  # 2^-6's bits
    return T.if_then_else(magnitude > T.uint32(0x7F800000), x, T.reinterpret("float32", sign | rounded))
