"""sm80's tensor intrinsics: ldmatrix.x4, mma.sync m16n8k16 and the zero fill of a tile of
fragments, for fp16 and bf16 operands, and the fragment layout they share (``ldmatrix_layout``).

Our own rather than tvm.s_tir.tensor_intrin.cuda's: importing that module parses some 500 TVMScript
functions for every target, which makes a process's first build slow, and it has no bf16 ones. These
are its get_ldmatrix_intrin, get_mma_intrin and get_mma_fill_intrin for 16 x 16 x 16 tiles, so the
code generated is the same.
"""

from __future__ import annotations

from tvmflash import tvmscript

from ..common import register_intrin
from .knobs import DTYPES, WARP

_PTX_TYPE = {"float16": "fp16", "bfloat16": "bf16"}


def ldmatrix_layout(i, j):
    """(row, col) of a 16 x 16 tile -> (lane, register) of its mma fragment (ldmatrix's, mma.sync's):
    lane 4 r + q holds rows r and r + 8 of columns 2 q, 2 q + 1, 2 q + 8 and 2 q + 9."""
    return 4 * (i % 8) + (j % 8) // 2, 4 * (j // 8) + (i // 8) * 2 + (j % 2)


def ldmatrix_row_offset(tx, stride, transposed):
    """The address lane tx gives ldmatrix.x4 (as an offset into the 16 x 16 tile of row ``stride``): one
    8-element row of the four 8 x 8 matrices; ``transposed`` as ``_ldmatrix_intrin``'s."""
    if transposed:
        return stride * 8 * (tx // 16) + stride * (tx % 8) + 8 * ((tx % 16) // 8)
    return stride * (tx % 16) + 8 * (tx // 16)


def b_fragment_element(lane, reg, transposed):
    """(row, col) of a 16 x 16 tile in shared memory that register ``reg`` of ``lane`` holds in mma.sync's B
    fragment (m16n8k16: lane 4 n8 + q holds k = 2 q + e (+ 8) of column n8 (+ 8); a register pair per n
    half), as ldmatrix leaves it (not ``ldmatrix_layout``, the intrinsics' description of it); ``transposed``:
    the tile is stored (n, k) (K's for S = Q Kᵀ: ``ld_b_trans``), else (k, n) (V's for P V: ``ld_b``)."""
    k = 2 * (lane % 4) + 8 * (reg // 2 % 2) + reg % 2
    n = lane // 4 + 8 * (reg // 4)
    return (n, k) if transposed else (k, n)


def _fragment_desc(dtype, shared_dtype, align):
    """The description of a 16 x 16 tile in shared.dyn (of ``shared_dtype``, ``align`` bytes aligned) loaded into
    its mma fragment of ``dtype`` (``ldmatrix_layout``): ldmatrix's, and the e4m3 tiles' converted as they load
    (``_e4m3_fragment_intrin``), where the types differ."""
    from tvm.script import tirx as T

    def value(x):  # (a cast only between types)
        return x if shared_dtype == dtype else T.Cast(dtype, x)

    @tvmscript.prim_func(s_tir=True)
    def desc(warp_handle: T.handle, shared_handle: T.handle) -> None:
        shared = T.match_buffer(shared_handle, (16, 16), shared_dtype, align=align, offset_factor=16,
                                scope="shared.dyn")
        warp = T.match_buffer(warp_handle, (WARP, 8), dtype, align=64, offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:16, 0:16])
            T.writes(warp[0:WARP, 0:8])
            for ax0, ax1 in T.grid(16, 16):
                with T.sblock("shared_warp"):
                    v0, v1 = T.axis.remap("SS", [ax0, ax1])
                    T.reads(shared[v0, v1])
                    lane, reg = T.meta_var(ldmatrix_layout(v0, v1))
                    T.writes(warp[lane, reg])
                    warp[lane, reg] = value(shared[v0, v1])

    return desc


def _ldmatrix_intrin(dtype, operand, transposed):
    """ldmatrix.x4 of a 16 x 16 tile in shared.dyn into its mma fragment (``ldmatrix_layout``),
    as operand "A" (rows x k) or "B" (k x cols); ``transposed``: the tile in shared memory is the
    operand transposed."""
    from tvm.script import tirx as T

    # ldmatrix's .trans: mma.sync takes A row-major and B column-major, so B's tile as stored needs
    # it and A's does not; a transposed tile the other way round.
    trans = transposed if operand == "A" else not transposed

    def row_offset(tx, stride):
        return ldmatrix_row_offset(tx, stride, transposed)

    desc = _fragment_desc(dtype, dtype, 64)

    @tvmscript.prim_func(s_tir=True)
    def impl(warp_handle: T.handle, shared_handle: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        shared = T.match_buffer(shared_handle, (16, 16), dtype, align=64, offset_factor=16, scope="shared.dyn",
                                strides=[s0, s1])
        warp = T.match_buffer(warp_handle, (WARP, 8), dtype, align=64, offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:16, 0:16])
            T.writes(warp[0:WARP, 0:8])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(T.ptx_legacy.ldmatrix(trans, 4, ".b16", warp.data, warp.elem_offset + 8 * tx,
                                                 shared.access_ptr("r"), row_offset(tx, s0), dtype=dtype))

    return desc, impl


def _mma_intrin(dtype, a_transposed, b_transposed):
    """C += A B on fragments (float32 C): two mma.sync m16n8k16, one per 8-column half of C;
    ``a_transposed``/``b_transposed``: the fragment holds the operand transposed."""
    from tvm.script import tirx as T

    ptx = _PTX_TYPE[dtype]

    def fragment(buffer, row, col, transposed):
        return buffer[ldmatrix_layout(col, row) if transposed else ldmatrix_layout(row, col)]

    def mma_half(A, B, C, tx, half):  # C's columns 8 half .. 8 half + 7: B's and C's registers 4 half ..
        return T.ptx_legacy.mma("m16n8k16", "row", "col", ptx, ptx, "fp32", A.data, A.elem_offset + tx * 8,
                                B.data, B.elem_offset + tx * 8 + 4 * half, C.data, C.elem_offset + tx * 8 + 4 * half,
                                False, dtype="float32")

    @tvmscript.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, 8), dtype, align=64, offset_factor=16, scope="warp")
        B = T.match_buffer(b, (WARP, 8), dtype, align=64, offset_factor=16, scope="warp")
        C = T.match_buffer(c, (WARP, 8), "float32", align=64, offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:8], A[0:WARP, 0:8], B[0:WARP, 0:8])
            T.writes(C[0:WARP, 0:8])
            for i, j, k in T.grid(16, 16, 16):
                with T.sblock("C"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    lane, reg = T.meta_var(ldmatrix_layout(vi, vj))
                    T.reads(C[lane, reg], fragment(A, vi, vk, a_transposed), fragment(B, vk, vj, b_transposed))
                    T.writes(C[lane, reg])
                    C[lane, reg] += T.Cast("float32", fragment(A, vi, vk, a_transposed)) * T.Cast(
                        "float32", fragment(B, vk, vj, b_transposed))

    @tvmscript.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, 8), dtype, align=64, offset_factor=16, scope="warp")
        B = T.match_buffer(b, (WARP, 8), dtype, align=64, offset_factor=16, scope="warp")
        C = T.match_buffer(c, (WARP, 8), "float32", align=64, offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:8], A[0:WARP, 0:8], B[0:WARP, 0:8])
            T.writes(C[0:WARP, 0:8])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(mma_half(A, B, C, tx, 0))
                T.evaluate(mma_half(A, B, C, tx, 1))

    return desc, impl


# Two e4m3 elements in shared memory in q's dtype, packed in 32 bits (the first low): two adjacent bytes at
# ``p`` (one 16-bit load), or with ``_rows`` bytes ``p[0]`` and ``p[stride]``, then one pair conversion.
# fp16: cvt.rn.f16x2.e4m3x2 (exact). bf16 (no e4m3 conversion to it): that, then each fp16 moved into
# bf16's fields, sign and magnitude (exponent and mantissa shifted right by 3), is the value times 2^-112
# (the exponent biases differ by 112; every e4m3 value is an fp16 normal, and 2^-121 at least a bf16
# normal), then one bf16x2 multiply by 2^112: exact for every non-NaN byte, with no subnormal operand.
_E4M3_PAIR_CONVERT = {
    "float16": """  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)x, __NV_E4M3);
  return (unsigned int)h.x | ((unsigned int)h.y << 16);""",
    "bfloat16": """  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)x, __NV_E4M3);
  unsigned int f16 = (unsigned int)h.x | ((unsigned int)h.y << 16);
  unsigned int bits = ((f16 >> 3) & 0x0fff0fffu) | (f16 & 0x80008000u);
  __nv_bfloat162 v = __hmul2(*(__nv_bfloat162*)&bits, __float2bfloat162_rn(0x1p112f));
  return *(unsigned int*)&v;""",
}


def _e4m3_pair(dtype, rows):
    """(name, CUDA source) of the helper that converts an e4m3 pair (``_E4M3_PAIR_CONVERT``)."""
    suffix = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    if rows:
        name = f"tvmflash_e4m3_rows_{suffix}"
        load = ("__device__ __forceinline__ unsigned int " + name + "(const void* p, int stride) {\n"
                "  const unsigned char* b = (const unsigned char*)p;\n"
                "  unsigned int x = (unsigned int)b[0] | ((unsigned int)b[stride] << 8);\n")
    else:
        name = f"tvmflash_e4m3_pair_{suffix}"
        load = ("__device__ __forceinline__ unsigned int " + name + "(const void* p) {\n"
                "  unsigned int x = *(const unsigned short*)p;\n")
    return name, "\n" + load + _E4M3_PAIR_CONVERT[dtype] + "\n}\n"


def _e4m3_fragment_intrin(dtype, transposed):
    """A 16 x 16 tile of e4m3 bytes in shared.dyn converted into q's dtype as mma.sync's B fragment: what
    ``ld_b_trans`` (``transposed``: the tile stored (n, k), K's) or ``ld_b`` (V's) loads from a tile of q's
    dtype, described as theirs (``ldmatrix_layout``) and holding what their ldmatrix leaves in each register
    (``b_fragment_element``). A register pair is two adjacent k: two adjacent bytes of a row of K's tile
    (one 16-bit load), of two rows of V's. Decode's FP8_FRAGMENTS."""
    from tvm.script import tirx as T

    name, source = _e4m3_pair(dtype, rows=not transposed)

    def pair(shared, s0, tx, p):  # registers 2 p, 2 p + 1 of lane tx, converted
        row, col = b_fragment_element(tx, 2 * p, transposed)
        where = shared.access_ptr("r", offset=s0 * row + col)
        if transposed:
            return T.cuda.func_call(name, where, source_code=source, return_type="uint32")
        return T.cuda.func_call(name, where, s0, source_code=source, return_type="uint32")

    desc = _fragment_desc(dtype, "float8_e4m3fn", 16)

    @tvmscript.prim_func(s_tir=True)
    def impl(warp_handle: T.handle, shared_handle: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        shared = T.match_buffer(shared_handle, (16, 16), "float8_e4m3fn", align=16, offset_factor=16,
                                scope="shared.dyn", strides=[s0, s1])
        warp = T.match_buffer(warp_handle, (WARP, 8), dtype, align=64, offset_factor=16, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:16, 0:16])
            T.writes(warp[0:WARP, 0:8])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for p in T.unroll(4):
                    converted: T.uint32 = pair(shared, s0, tx, p)
                    warp[tx, 2 * p] = T.reinterpret(dtype, T.Cast("uint16", converted & T.uint32(0xFFFF)))
                    warp[tx, 2 * p + 1] = T.reinterpret(dtype, T.Cast("uint16", converted >> T.uint32(16)))

    return desc, impl


def _fill_intrin():
    """Zero a 16 x 16 float32 tile of fragments."""
    from tvm.script import tirx as T

    @tvmscript.prim_func(s_tir=True)
    def desc(a: T.handle) -> None:
        C = T.match_buffer(a, [WARP, 8], dtype="float32", scope="warp")
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:8])
            for i0, i1 in T.grid(16, 16):
                with T.sblock("C_warp"):
                    i, j = T.axis.remap("SS", [i0, i1])
                    lane, reg = T.meta_var(ldmatrix_layout(i, j))
                    T.reads()
                    T.writes(C[lane, reg])
                    C[lane, reg] = T.float32(0)

    @tvmscript.prim_func(s_tir=True)
    def impl(a: T.handle) -> None:
        C = T.match_buffer(a, [WARP, 8], dtype="float32", scope="warp", offset_factor=1)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:8])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(T.cuda.mma_fill_legacy(8, C.data, C.elem_offset, dtype="float32"))

    return desc, impl


_ROLES = {  # role: the intrinsic's generator and its arguments after the dtype
    "ld_a": (_ldmatrix_intrin, "A", False),
    "ld_a_trans": (_ldmatrix_intrin, "A", True),
    "ld_b": (_ldmatrix_intrin, "B", False),
    "ld_b_trans": (_ldmatrix_intrin, "B", True),
    # B from a tile of e4m3 bytes (decode's FP8_FRAGMENTS)
    "ld_b_e4m3": (_e4m3_fragment_intrin, False),
    "ld_b_trans_e4m3": (_e4m3_fragment_intrin, True),
    "mma_nn": (_mma_intrin, False, False),
    "mma_nt": (_mma_intrin, False, True),
    "mma_tn": (_mma_intrin, True, False),
}
_FILL = "tvmflash_mma_fill_f32"
_REGISTERED: set[str] = set()


def intrin_names(dtype):
    """Tensor intrinsic names by role (``_ROLES`` and "fill"), for fp16 or bf16 operands; registers
    them on first use."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: the sm80 schedule takes {DTYPES}, got {dtype!r}")
    names = {role: f"tvmflash_{role}_{_PTX_TYPE[dtype]}" for role in _ROLES}
    for role, name in names.items():
        if name not in _REGISTERED:
            make, *args = _ROLES[role]
            register_intrin(name, *make(dtype, *args))
            _REGISTERED.add(name)
    if _FILL not in _REGISTERED:
        register_intrin(_FILL, *_fill_intrin())
        _REGISTERED.add(_FILL)
    return {**names, "fill": _FILL}

