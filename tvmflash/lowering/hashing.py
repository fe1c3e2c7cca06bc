"""``LowerMix32``: the programs' integer hash (``mix32``, dropout's random bits) as each target computes it.

The programs write ``mix32(x)`` as one opaque call (``mix32_call``): each of its steps reads its input
twice, so written out as an expression tree four nested hashes hold thousands of nodes per score, which
every pass would walk, and the simplifiers expand let-bound arithmetic back into that tree. Lowered here,
after the simplifiers and before common-subexpression elimination: on the CPU (llvm) as arithmetic in
local buffers (``mix32_statements``), on CUDA as an inline device function.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from tvmflash.lowering.ir import CALL, find, is_call, prim_func_pass, target_of, transform

MIX32 = "tvmflash_mix32"
# Wellons' lowbias32, a bijection of uint32 whose every input bit flips each output bit with probability
# close to 1/2: (x ^ x >> 16) * M1, (x ^ x >> 15) * M2, x ^ x >> 16, modulo 2^32.
MIX32_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
MIX32_SHIFTS = (16, 15, 16)
_CUDA_SOURCE = (
    f"__device__ __forceinline__ unsigned {MIX32}(unsigned x) {{\n"
    f"  x ^= x >> {MIX32_SHIFTS[0]}; x *= {MIX32_MULTIPLIERS[0]:#x}u;\n"
    f"  x ^= x >> {MIX32_SHIFTS[1]}; x *= {MIX32_MULTIPLIERS[1]:#x}u;\n"
    f"  return x ^ (x >> {MIX32_SHIFTS[2]});\n}}")


def mix32_call(x):
    """lowbias32 of the uint32 expression ``x``, as one call until ``LowerMix32``."""
    return T.call_pure_extern("uint32", MIX32, x)


def is_mix32(node) -> bool:
    return is_call(node, "tirx.call_pure_extern") and str(node.args[0].value) == MIX32


def mix32_statements(expr) -> tuple[list, object]:
    """(statements, expr'): ``expr`` with each mix32 call (inner ones first) replaced by a load of a
    one-element local buffer that ``statements``, to run before it, compute in uint32 arithmetic. A
    buffer, not let-bound variables: the simplifier of LLVM's code generation substitutes a variable's
    value wherever it is read, so a chain of bindings that each read the last one twice grew back into
    the whole tree (minutes a kernel); a buffer's contents it does not track."""
    statements = []

    def lower(call):
        if not is_mix32(call):
            return None
        x = call.args[1]
        if tvm.DataType(str(x.ty)).lanes != 1:
            raise RuntimeError("LowerMix32: a vectorised mix32 call on the CPU (the vectoriser scalarises its loop)")
        state = tirx.decl_buffer((1,), "uint32", f"mix32_{len(statements)}", scope="local")
        value = tirx.BufferLoad(state, [0])
        def xorshift(shift):
            return tirx.bitwise_xor(value, tirx.shift_right(value, tirx.const(shift, "uint32")))

        (m1, m2), (s1, s2, s3) = MIX32_MULTIPLIERS, MIX32_SHIFTS
        steps = (x, xorshift(s1) * tirx.const(m1, "uint32"), xorshift(s2) * tirx.const(m2, "uint32"), xorshift(s3))
        statements.append(tirx.AllocBuffer(state))
        statements.extend(tirx.BufferStore(state, step, [0]) for step in steps)
        return value
    lowered = transform(expr, tvm.ir.expr.Call, lower)
    return statements, lowered


def LowerMix32():  # noqa: N802
    """Before CommonSubexprElim, after the simplifiers: each ``mix32_call`` becomes a call of an inline
    CUDA function on CUDA (one helper a kernel, in the kernel's source), and on the CPU (llvm) uint32
    arithmetic in local buffers just before the store that reads it (``mix32_statements``). The programs
    use it in the value of a store alone (the ``cast_p`` and ``ds`` blocks)."""
    def rewrite(func):
        if target_of(func, "cuda") is not None:
            return func.with_body(transform(func.body, tvm.ir.expr.Call, lambda call: T.cuda.func_call(
                MIX32, call.args[1], source_code=_CUDA_SOURCE, return_type="uint32") if is_mix32(call) else None))

        def lower_store(store):
            statements, value = mix32_statements(store.value)
            if not statements:
                return None
            return tirx.SeqStmt([*statements, tirx.BufferStore(store.buffer, value, store.indices)])
        body = transform(func.body, tirx.BufferStore, lower_store)
        if find(body, CALL, is_mix32):
            raise RuntimeError("LowerMix32: a mix32 call outside the value of a store")
        return func.with_body(body)
    return prim_func_pass(rewrite, "tvmflash.LowerMix32")
