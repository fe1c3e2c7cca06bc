"""``LowerPhilox``: Philox4x32-10 (dropout's random bits, ``program_dropout``) as each target computes it.

The programs write one word of ``philox(counter, key)`` as one opaque call (``philox_call``): ten rounds
written out as an expression tree read each word many times, thousands of nodes a score that every pass
would walk and the simplifiers would expand. Lowered here, after the simplifiers and before
common-subexpression elimination: on CUDA as a call of an inline device function (``__umulhi`` and a
32-bit product a multiplication), so that nvcc shares one call among the entries a thread holds whose
counter is the same; on the CPU (llvm) as uint32 arithmetic in a local buffer, a 64-bit product a
multiplication (``philox_statements``).
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from tvmflash.lowering.ir import CALL, find, is_call, prim_func_pass, target_of, transform

PHILOX = "tvmflash_philox"
# Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC 2011), as Random123, curand, torch and
# flash-attn compute it: each round multiplies counter words 0 and 2, the key is bumped between rounds.
PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
PHILOX_WEYL = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
_CUDA_SOURCE = (
    f"__device__ __forceinline__ unsigned {PHILOX}(unsigned c0, unsigned c1, unsigned c2, unsigned c3,\n"
    f"                                                unsigned k0, unsigned k1, unsigned word) {{\n"
    f"#pragma unroll\n"
    f"  for (int round = 0; round < {PHILOX_ROUNDS}; ++round) {{\n"
    f"    unsigned hi0 = __umulhi({PHILOX_MULTIPLIERS[0]:#x}u, c0), lo0 = {PHILOX_MULTIPLIERS[0]:#x}u * c0;\n"
    f"    unsigned hi1 = __umulhi({PHILOX_MULTIPLIERS[1]:#x}u, c2), lo1 = {PHILOX_MULTIPLIERS[1]:#x}u * c2;\n"
    f"    c0 = hi1 ^ c1 ^ k0; c1 = lo1; c2 = hi0 ^ c3 ^ k1; c3 = lo0;\n"
    f"    k0 += {PHILOX_WEYL[0]:#x}u; k1 += {PHILOX_WEYL[1]:#x}u;\n"
    f"  }}\n"
    f"  return word == 0 ? c0 : word == 1 ? c1 : word == 2 ? c2 : c3;\n}}")


def philox_call(counter, key, word):
    """Word ``word`` (0-3) of Philox4x32-10 of the uint32 expressions ``counter`` (four) and ``key``
    (two), as one call until ``LowerPhilox``."""
    return T.call_pure_extern("uint32", PHILOX, *counter, *key, word)


def is_philox(node) -> bool:
    return is_call(node, "tirx.call_pure_extern") and str(node.args[0].value) == PHILOX


def philox_statements(expr) -> tuple[list, object]:
    """(statements, expr'): ``expr`` with each philox call replaced by a selection among the words of a
    local buffer that ``statements``, to run before it, compute in uint32 arithmetic (a 32x32->64 product
    in uint64). A buffer, not let-bound variables: the simplifier of LLVM's code generation substitutes a
    variable's value wherever it is read, and each round reads the last one's words twice."""
    statements = []

    def lower(call):
        if not is_philox(call):
            return None
        *inputs, word = call.args[1:]
        if tvm.DataType(str(word.ty)).lanes != 1:
            raise RuntimeError("LowerPhilox: a vectorised philox call on the CPU (the vectoriser scalarises its loop)")
        n = len(statements)
        state = tirx.decl_buffer((6,), "uint32", f"philox_{n}", scope="local")  # c0 c1 c2 c3 k0 k1
        product = tirx.decl_buffer((2,), "uint64", f"philox_product_{n}", scope="local")

        def s(i):
            return tirx.BufferLoad(state, [i])

        def wide(x, m):
            return tirx.Cast("uint64", x) * tirx.const(m, "uint64")

        def high(p):
            return tirx.Cast("uint32", tirx.shift_right(p, tirx.const(32, "uint64")))

        (m0, m1), (w0, w1) = PHILOX_MULTIPLIERS, PHILOX_WEYL
        p0, p1 = tirx.BufferLoad(product, [0]), tirx.BufferLoad(product, [1])
        statements.extend([tirx.AllocBuffer(state), tirx.AllocBuffer(product)])
        statements.extend(tirx.BufferStore(state, x, [i]) for i, x in enumerate(inputs))
        for _ in range(PHILOX_ROUNDS):
            statements.extend([tirx.BufferStore(product, wide(s(0), m0), [0]),
                               tirx.BufferStore(product, wide(s(2), m1), [1]),
                               tirx.BufferStore(state, tirx.bitwise_xor(tirx.bitwise_xor(high(p1), s(1)), s(4)), [0]),
                               tirx.BufferStore(state, tirx.Cast("uint32", p1), [1]),
                               tirx.BufferStore(state, tirx.bitwise_xor(tirx.bitwise_xor(high(p0), s(3)), s(5)), [2]),
                               tirx.BufferStore(state, tirx.Cast("uint32", p0), [3]),
                               tirx.BufferStore(state, s(4) + tirx.const(w0, "uint32"), [4]),
                               tirx.BufferStore(state, s(5) + tirx.const(w1, "uint32"), [5])])
        def is_word(i):
            return tirx.EQ(word, tirx.const(i, "uint32"))
        return tirx.Select(is_word(0), s(0), tirx.Select(is_word(1), s(1), tirx.Select(is_word(2), s(2), s(3))))
    lowered = transform(expr, tvm.ir.expr.Call, lower)
    return statements, lowered


def LowerPhilox():  # noqa: N802
    """Before CommonSubexprElim, after the simplifiers: each ``philox_call`` becomes a call of an inline
    CUDA function on CUDA (one helper a kernel, in the kernel's source), and on the CPU (llvm) uint32
    arithmetic in local buffers just before the store that reads it (``philox_statements``). The programs
    use it in the value of a store alone (the ``cast_p`` and ``ds`` blocks)."""
    def rewrite(func):
        if target_of(func, "cuda") is not None:
            return func.with_body(transform(func.body, tvm.ir.expr.Call, lambda call: T.cuda.func_call(
                PHILOX, *call.args[1:], source_code=_CUDA_SOURCE, return_type="uint32") if is_philox(call) else None))

        def lower_store(store):
            statements, value = philox_statements(store.value)
            if not statements:
                return None
            return tirx.SeqStmt([*statements, tirx.BufferStore(store.buffer, value, store.indices)])
        body = transform(func.body, tirx.BufferStore, lower_store)
        if find(body, CALL, is_philox):
            raise RuntimeError("LowerPhilox: a philox call outside the value of a store")
        return func.with_body(body)
    return prim_func_pass(rewrite, "tvmflash.LowerPhilox")
