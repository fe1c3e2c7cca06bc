"""The right operands of the tile products (Kᵀ for QKᵀ, V for PV; the backward's qᵀ, doutᵀ, Kᵀ, Vᵀ and q,
dout, K: ``pack_transposed``, ``pack_rows``) in AMX's pair-interleaved layout, (k // 2, n, k % 2) (``VNNI``).

V's (``pack_v``): two rows interleaved, in runs that LLVM's SLP vectorizer packs. K's (``pack_k``), by
16 x 16 transposes of 32-bit pairs in vector registers. QKᵀ's right operand is Kᵀ in pairs: Kv[d // 2, j, d % 2] = K[j, d], so that a tile row holds the pairs
(d, d + 1) of 16 keys. Read as 32-bit words, that is the transpose of the (keys, pairs) matrix: the
tile is first copied as it is (vectorised rows, zero-padded past the keys), then each block of 16 keys
by 16 pairs goes through ``transpose_intrin``: 16 rows loaded, 4 rounds of two-vector shuffles, 16
rows stored. Element by element, the transposed copy was 16-bit moves that LLVM assembled into vectors
one insert at a time."""

from __future__ import annotations

from tvmflash import tvmscript

from ..common import read_index, register_intrin

VNNI = {"load_k": lambda j, d: (d // 2, j, d % 2), "load_v": lambda j, d: (j // 2, d, j % 2)}
WORDS = 16  # 32-bit words a 512-bit vector holds
NAME = "tvmflash_amx_transpose_pairs_16x16"

_REGISTERED: set = set()


def _transposed(rows, bindings: list):
    """The 16 vectors of 16 lanes ``rows`` transposed (lane c of vector r becomes lane r of vector c):
    for h = 8, 4, 2, 1, rows i and i + h (bit h of i clear) swap the off-diagonal h x h blocks of each
    2h x 2h block, one two-vector shuffle a row. Each round's vectors are bound to variables, appended
    to ``bindings`` as (var, value), so that the next round reads them rather than repeat them."""
    from tvm import tirx

    def shuffle(a, b, lanes):
        return tirx.Shuffle([a, b], [tirx.const(lane, "int32") for lane in lanes])

    rows = list(rows)
    h = WORDS // 2
    while h:
        new = list(rows)
        for i in [i for i in range(WORDS) if not i & h]:
            a, b = rows[i], rows[i + h]
            new[i] = shuffle(a, b, [c if not c & h else WORDS + c - h for c in range(WORDS)])
            new[i + h] = shuffle(a, b, [c + h if not c & h else WORDS + c for c in range(WORDS)])
        rows = []
        for i, value in enumerate(new):
            var = tirx.Var(f"t{h}_{i}", f"uint32x{WORDS}")
            bindings.append((var, value))
            rows.append(var)
        h //= 2
    return rows


def transpose_intrin() -> str:
    """Register (once) and name the intrinsic of B[d // 2, j, d % 2] = A[j, d] over 16 rows j by 32
    bf16 columns d (16 pairs), through 32-bit views of both."""
    if NAME in _REGISTERED:
        return NAME
    from tvm import s_tir, tirx
    from tvm.script import tirx as T

    @tvmscript.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle) -> None:
        A = T.match_buffer(a, (WORDS, 2 * WORDS), "bfloat16", offset_factor=1)
        B = T.match_buffer(b, (WORDS, WORDS, 2), "bfloat16", offset_factor=1)
        with T.sblock("root"):
            T.reads(A[0:WORDS, 0:2 * WORDS])
            T.writes(B[0:WORDS, 0:WORDS, 0:2])
            for j, d in T.grid(WORDS, 2 * WORDS):
                with T.sblock("pack"):
                    vj, vd = T.axis.remap("SS", [j, d])
                    B[vd // 2, vj, vd % 2] = A[vj, vd]

    @tvmscript.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle) -> None:
        sa, sb = T.int32(), T.int32()
        A = T.match_buffer(a, (WORDS, 2 * WORDS), "bfloat16", offset_factor=2, strides=[sa, 1])
        B = T.match_buffer(b, (WORDS, WORDS, 2), "bfloat16", offset_factor=2, strides=[sb, 2, 1])
        with T.sblock("root"):
            T.reads(A[0:WORDS, 0:2 * WORDS])
            T.writes(B[0:WORDS, 0:WORDS, 0:2])
            T.evaluate(0)  # replaced below

    root = impl.body.block
    A = next(r.source for r in root.reads if r.source.name == "A")
    B = next(r.source for r in root.writes if r.source.name == "B")
    # 32-bit views of the two tiles (offsets and strides even: whole pairs)
    a32 = tirx.decl_buffer((1,), "uint32", name="A32", data=A.data, elem_offset=A.elem_offset // 2)
    b32 = tirx.decl_buffer((1,), "uint32", name="B32", data=B.data, elem_offset=B.elem_offset // 2)
    rows = [tirx.BufferLoad(a32, [tirx.Ramp(j * (A.strides[0] // 2), 1, WORDS)]) for j in range(WORDS)]
    bindings = []
    columns = _transposed(rows, bindings)
    stores = [tirx.BufferStore(b32, column, [tirx.Ramp(p * (B.strides[0] // 2), 1, WORDS)])
              for p, column in enumerate(columns)]
    body = tirx.SeqStmt([tirx.DeclBuffer(a32, data=A.data), tirx.DeclBuffer(b32, data=B.data),
                         *(tirx.LetStmt(var, value) for var, value in bindings), *stores])
    block = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, body)
    register_intrin(NAME, desc, impl.with_body(s_tir.SBlockRealize([], True, block)))
    _REGISTERED.add(NAME)
    return NAME


TRANSPOSE = "tvmflash_amx_transpose_32x32"


def transpose_elements_intrin() -> str:
    """Register (once) and name the intrinsic of B[i, j] = A[j, i] over 32 x 32 bf16: through 32-bit views,
    each half of A's rows (16 rows of 16 pairs) transposed as words (``_transposed``), which gives for each
    pair of columns (2p, 2p + 1) the 32 rows' pairs interleaved; then one shuffle of the two halves' vectors
    takes the even elements (B's row 2p) and one the odd ones (row 2p + 1)."""
    if TRANSPOSE in _REGISTERED:
        return TRANSPOSE
    from tvm import s_tir, tirx
    from tvm.script import tirx as T

    n = 2 * WORDS

    @tvmscript.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle) -> None:
        A = T.match_buffer(a, (n, n), "bfloat16", offset_factor=1)
        B = T.match_buffer(b, (n, n), "bfloat16", offset_factor=1)
        with T.sblock("root"):
            T.reads(A[0:n, 0:n])
            T.writes(B[0:n, 0:n])
            for j, i in T.grid(n, n):
                with T.sblock("transpose"):
                    vj, vi = T.axis.remap("SS", [j, i])
                    B[vi, vj] = A[vj, vi]

    @tvmscript.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle) -> None:
        sa, sb = T.int32(), T.int32()
        A = T.match_buffer(a, (n, n), "bfloat16", offset_factor=2, strides=[sa, 1])
        B = T.match_buffer(b, (n, n), "bfloat16", offset_factor=2, strides=[sb, 1])
        with T.sblock("root"):
            T.reads(A[0:n, 0:n])
            T.writes(B[0:n, 0:n])
            T.evaluate(0)  # replaced below

    root = impl.body.block
    A = next(r.source for r in root.reads if r.source.name == "A")
    B = next(r.source for r in root.writes if r.source.name == "B")
    a32 = tirx.decl_buffer((1,), "uint32", name="A32", data=A.data, elem_offset=A.elem_offset // 2)
    b16 = tirx.decl_buffer((1,), "uint16", name="B16", data=B.data, elem_offset=B.elem_offset)
    bindings = []
    halves = [_transposed([tirx.BufferLoad(a32, [tirx.Ramp((h * WORDS + j) * (A.strides[0] // 2), 1, WORDS)])
                           for j in range(WORDS)], bindings) for h in range(2)]
    stores = []
    for p in range(WORDS):
        low, high = (tirx.reinterpret(f"uint16x{n}", half[p]) for half in halves)  # rows' pairs of columns 2p, 2p + 1
        for parity in range(2):
            lanes = [tirx.const(2 * e + parity, "int32") for e in range(n)]
            stores.append(tirx.BufferStore(b16, tirx.Shuffle([low, high], lanes),
                                           [tirx.Ramp((2 * p + parity) * B.strides[0], 1, n)]))
    body = tirx.SeqStmt([tirx.DeclBuffer(a32, data=A.data), tirx.DeclBuffer(b16, data=B.data),
                         *(tirx.LetStmt(var, value) for var, value in bindings), *stores])
    block = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, body)
    register_intrin(TRANSPOSE, desc, impl.with_body(s_tir.SBlockRealize([], True, block)))
    _REGISTERED.add(TRANSPOSE)
    return TRANSPOSE


def copy_transposed(sch, product: str, operand: str):
    """A copy of ``product``'s left operand ``operand`` (bf16 (rows, columns), both multiples of 32), read by
    it alone, transposed, (columns, rows): ``transpose_elements_intrin`` a block of 32 x 32 (dkdv's dsᵀ, for
    ds k). Returns the copy's block."""
    copy = sch.cache_read(product, read_index(sch, product, operand), "global", consumer_blocks=[product])
    sch.transform_layout(copy, ("write", 0), lambda r, c: (c, r))
    r, c = sch.get_loops(copy)[-2:]
    ro, ri = sch.split(r, [None, 2 * WORDS])
    co, ci = sch.split(c, [None, 2 * WORDS])
    sch.reorder(ro, co, ri, ci)
    sch.tensorize(ri, transpose_elements_intrin())
    return copy


def pack_transposed(sch, product: str, operand: str):
    """A copy of ``product``'s right operand ``operand`` (rows, head_dim), read by it alone, in the pair
    layout of its transpose, (d // 2, row, d % 2): ``transpose_intrin`` a block of 16 rows by 32 columns
    (QKᵀ's Kᵀ; the backward's Kᵀ, Vᵀ, Qᵀ and doutᵀ). Returns the copy's block."""
    pack = sch.cache_read(product, read_index(sch, product, operand), "global", consumer_blocks=[product])
    sch.transform_layout(pack, ("write", 0), VNNI["load_k"])
    j, d = sch.get_loops(pack)[-2:]
    jo, ji = sch.split(j, [None, WORDS])
    do, di = sch.split(d, [None, 2 * WORDS])
    sch.reorder(jo, do, ji, di)
    sch.tensorize(ji, transpose_intrin())
    return pack


def interleave_rows(sch, block) -> None:
    """``block``'s (rows, head_dim) output in the pair-interleaved layout, out[j // 2, d, j % 2], in runs
    of 16 unrolled pairs of stores to consecutive addresses (two rows interleaved), which LLVM's SLP
    vectorizer packs."""
    sch.transform_layout(block, ("write", 0), VNNI["load_v"])
    j, d = sch.get_loops(block)[-2:]
    pairs, pair = sch.split(j, [None, 2])
    outer, run = sch.split(d, [None, 16])
    sch.reorder(pairs, outer, run, pair)
    sch.unroll(run)
    sch.unroll(pair)


def pack_rows(sch, product: str, operand: str):
    """A copy of ``product``'s right operand ``operand`` (rows, head_dim), read by it alone, with its rows
    interleaved in pairs (``interleave_rows``): the backward's V-like operands (q, dout, K). Returns the
    copy's block."""
    pack = sch.cache_read(product, read_index(sch, product, operand), "global", consumer_blocks=[product])
    interleave_rows(sch, pack)
    return pack


def pack_k(sch, vector: int) -> None:
    """``load_k`` a vectorised copy of the tile as it is; a copy of it in the pair-interleaved layout
    before QKᵀ (``pack_transposed``)."""
    _, inner = sch.split(sch.get_loops("load_k")[-1], [None, vector])
    sch.vectorize(inner)
    pack_transposed(sch, "qk", "Kt")


def pack_v(sch) -> None:
    """``load_v`` into the pair-interleaved layout, Vt[j // 2, d, j % 2] (``interleave_rows``)."""
    interleave_rows(sch, "load_v")
