"""AMX's tensor intrinsic: a block of 32 rows of float32 C += A B over a whole reduction of bf16
operands, on the tile registers (``tdpbf16ps``).

TVM ships AMX int8 intrinsics alone; this is the bf16 one, written the same way: LLVM's x86 AMX
intrinsics with immediate tile registers (``llvm.x86.tileloadd64``, ``tdpbf16ps``,
``tilestored64``), called through ``tirx.call_llvm_intrin``. Each 32 x 32 block of C is held in
four 16 x 16 tiles (tmm4..7) for the whole reduction, and each step of 32 multiplies two 16 x 32 tiles
of A (tmm0, tmm1) by two of B (tmm2, tmm3): four products per four loads.

B is read in AMX's pair-interleaved ("VNNI") layout: B[k // 2, n, k % 2] is the operand's (k, n)
element, so a 64-byte tile row holds the pairs (k, k + 1) of 16 columns. The schedule stores its
right operands so (``packing.VNNI``).

The tile configuration (palette 1, eight tiles of 16 rows x 64 bytes) is per thread, and the
parallel loop runs its tasks on whichever thread of the pool: each call loads it first (ldtilecfg),
from a 64-byte buffer of its own, so that a call is right wherever it stands; where all of a task's
calls load the same one, the lowering loads it once at the start of the task instead
(``tvmflash.lowering.amx_config``).
"""

from __future__ import annotations

from tvmflash import tvmscript

from ..common import register_intrin

ROWS = 16  # a tile's rows (AMX's maximum)
STEP = 32  # bf16 elements of the reduction a tile row holds (64 bytes)
BLOCK = 32  # the intrinsic's C block: 2 x 2 tiles of 16 x 16 float32
_A, _B, _C = (0, 1), (2, 3), (4, 5, 6, 7)  # tile registers: A's rows, B's columns, C's 2 x 2

_REGISTERED: set = set()


def _call(name, *args):
    from tvm import tirx

    return tirx.call_llvm_intrin("void", f"llvm.x86.{name}", *args)


def _tile_config(cfg):
    """Statements that fill ``cfg`` (64 uint8) with palette 1, eight tiles of 16 rows x 64 bytes, and
    load it."""
    from tvm import tirx

    values = [0] * 64
    values[0] = 1  # palette 1
    for tile in range(8):
        values[16 + 2 * tile] = 4 * ROWS  # bytes a row (uint16, little-endian)
        values[48 + tile] = ROWS  # rows
    return [tirx.BufferStore(cfg, tirx.const(value, "uint8"), [i]) for i, value in enumerate(values)] + \
        [tirx.Evaluate(_call("ldtilecfg", cfg.access_ptr("w")))]


def _tile(name, reg, *args):
    """An AMX instruction on tile register ``reg`` (an immediate), as a statement."""
    from tvm import tirx

    return tirx.Evaluate(_call(name, tirx.const(reg, "uint8"), *args))


def dot_intrin(reduction: int, cols: int = BLOCK) -> str:
    """Register (once) and name the intrinsic of a 32 x ``cols`` float32 block (``cols`` a multiple of
    32) C += A B over ``reduction`` (a multiple of 32) bf16 elements: C[i, j] += A[i, k] * B[k // 2, j,
    k % 2], in 32 x 32 blocks one after the other under one tile configuration."""
    name = f"tvmflash_amx_bf16_32x{cols}x{reduction}"
    if name in _REGISTERED:
        return name
    if reduction % STEP or cols % BLOCK:
        raise ValueError(f"AMX block: a reduction and columns in multiples of {STEP}, got {reduction}, {cols}")
    from tvm import tirx
    from tvm.script import tirx as T

    K, M, N = reduction, BLOCK, cols

    @tvmscript.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (M, K), "bfloat16", offset_factor=1)
        B = T.match_buffer(b, (K // 2, N, 2), "bfloat16", offset_factor=1)
        C = T.match_buffer(c, (M, N), "float32", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:M, 0:N], A[0:M, 0:K], B[0:K // 2, 0:N, 0:2])
            T.writes(C[0:M, 0:N])
            for i, j, k in T.grid(M, N, K):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    C[vi, vj] = C[vi, vj] + T.cast(A[vi, vk], "float32") * T.cast(B[vk // 2, vj, vk % 2], "float32")

    def body(A, B, C):
        """The tile program: per 32 x 32 block of C, its four tiles loaded, the steps of 32, stored."""
        cfg = tirx.decl_buffer((64,), "uint8", name="amx_config", scope="local", data_alignment=64)

        def load_store(name, buf, reg, offset, mode="r"):  # a tile of rows at ``offset`` (elements)
            row_bytes = tirx.Cast("int64", buf.strides[0] * (buf.dtype.bits // 8))
            if buf.dtype == "bfloat16":
                # typed uint16: the bf16 legalisation makes a bf16 buffer's storage uint16 but turns
                # an access_ptr's bf16 element type into float32, which then fails to lower
                pointer = tirx.tvm_access_ptr("uint16", buf.data, buf.elem_offset + offset, ROWS * buf.strides[0],
                                              {"r": 1, "w": 2}[mode])
            else:
                pointer = buf.access_ptr(mode, offset=offset)
            return _tile(name, reg, pointer, row_bytes)

        stmts = _tile_config(cfg)
        for col in range(0, N, BLOCK):
            def c_offset(t):
                return (t // 2) * ROWS * C.strides[0] + col + (t % 2) * ROWS

            stmts += [load_store("tileloadd64", C, reg, c_offset(t)) for t, reg in enumerate(_C)]
            for step in range(K // STEP):
                stmts += [load_store("tileloadd64", A, reg, half * ROWS * A.strides[0] + step * STEP)
                          for half, reg in enumerate(_A)]
                stmts += [load_store("tileloadd64", B, reg,
                                     step * ROWS * B.strides[0] + (col + half * ROWS) * B.strides[1])
                          for half, reg in enumerate(_B)]
                stmts += [tirx.Evaluate(_call("tdpbf16ps", *(tirx.const(r, "uint8")
                                                              for r in (_C[t], _A[t // 2], _B[t % 2]))))
                          for t in range(4)]
            stmts += [load_store("tilestored64", C, reg, c_offset(t), "w") for t, reg in enumerate(_C)]
        return tirx.SeqStmt([tirx.AllocBuffer(cfg)] + stmts)

    @tvmscript.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        sa, sb0, sb1, sc = T.int32(), T.int32(), T.int32(), T.int32()
        A = T.match_buffer(a, (M, K), "bfloat16", offset_factor=1, strides=[sa, 1])
        B = T.match_buffer(b, (K // 2, N, 2), "bfloat16", offset_factor=1, strides=[sb0, sb1, 1])
        C = T.match_buffer(c, (M, N), "float32", offset_factor=1, strides=[sc, 1])
        with T.sblock("root"):
            T.reads(C[0:M, 0:N], A[0:M, 0:K], B[0:K // 2, 0:N, 0:2])
            T.writes(C[0:M, 0:N])
            T.evaluate(0)  # replaced by the tile program below

    impl = impl.with_body(_with_tile_program(impl, body))
    register_intrin(name, desc, impl)
    _REGISTERED.add(name)
    return name


def _with_tile_program(impl, body):
    """``impl``'s root block with ``body(A, B, C)`` of its buffers as its statement."""
    from tvm import s_tir

    root = impl.body.block
    buffers = {region.source.name: region.source for region in root.reads}
    A, B, C = (buffers[name] for name in "ABC")
    block = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, body(A, B, C))
    return s_tir.SBlockRealize([], True, block)
