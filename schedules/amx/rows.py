"""Row reductions in AVX-512 vectors: a row's max or sum over its columns as vector operations and one
tree of halvings across the lanes (``row_intrin``), where the block's scalar loop left LLVM a chain of
scalar max or add instructions (it may not reorder float additions, nor fold a max it cannot prove
NaN-free). The order of the sum's terms changes: float32 rounding, far below the bf16 products'."""

from __future__ import annotations

from tvmflash import tvmscript

from ..common import register_intrin

LANES = 16  # float32 in a 512-bit vector

_REGISTERED: set = set()
_OPS = ("max", "sum")


def _combine(op, a, b):
    from tvm import tirx

    return tirx.Max(a, b) if op == "max" else a + b


def _halved(op, vector, lanes):
    """``vector`` (``lanes`` wide) reduced across its lanes by halving: lanes // 2 operations a step,
    each step's vector bound once (a Let), so that the two halves read it rather than repeat it."""
    from tvm import tirx

    if lanes == 1:
        return vector
    half = lanes // 2
    bound = tirx.Var(f"row_{lanes}", f"float32x{lanes}" if lanes > 1 else "float32")
    low = tirx.Shuffle([bound], [tirx.const(i, "int32") for i in range(half)])
    high = tirx.Shuffle([bound], [tirx.const(i, "int32") for i in range(half, lanes)])
    return tirx.Let(bound, vector, _halved(op, _combine(op, low, high), half))


def row_intrin(op: str, columns: int) -> str:
    """Register (once) and name the intrinsic of one row's ``R[0] = R[0] op X[0, j]`` over ``columns``
    (a multiple of 16) float32 columns, ``op`` "max" or "sum": the columns in 16-lane vectors combined
    vector by vector, then across the lanes (``_halved``)."""
    if op not in _OPS or columns % LANES:
        raise ValueError(f"row_intrin: op max or sum, columns a multiple of {LANES}; got {op!r}, {columns}")
    name = f"tvmflash_row_{op}_f32x{columns}"
    if name in _REGISTERED:
        return name
    from tvm import s_tir, tirx
    from tvm.script import tirx as T

    N = columns

    @tvmscript.prim_func(s_tir=True)
    def desc(x: T.handle, r: T.handle) -> None:
        X = T.match_buffer(x, (1, N), "float32", offset_factor=1)
        R = T.match_buffer(r, (1,), "float32", offset_factor=1)
        with T.sblock("root"):
            T.reads(R[0:1], X[0:1, 0:N])
            T.writes(R[0:1])
            for j in range(N):
                with T.sblock("update"):
                    vj = T.axis.remap("R", [j])
                    R[0] = _combine(op, R[0], X[0, vj])

    @tvmscript.prim_func(s_tir=True)
    def impl(x: T.handle, r: T.handle) -> None:
        sx = T.int32()
        X = T.match_buffer(x, (1, N), "float32", offset_factor=1, strides=[sx, 1])
        R = T.match_buffer(r, (1,), "float32", offset_factor=1)
        with T.sblock("root"):
            T.reads(R[0:1], X[0:1, 0:N])
            T.writes(R[0:1])
            T.evaluate(0)  # replaced below

    root = impl.body.block
    buffers = {region.source.name: region.source for region in root.reads}
    X, R = buffers["X"], buffers["R"]
    vectors = [tirx.BufferLoad(X, [tirx.const(0, "int32"), tirx.Ramp(tirx.const(v * LANES, "int32"), 1, LANES)])
               for v in range(N // LANES)]
    while len(vectors) > 1:  # pairwise, so the vector steps are independent
        vectors = [_combine(op, a, b) for a, b in zip(vectors[::2], vectors[1::2])] + vectors[len(vectors) // 2 * 2:]
    total = _halved(op, vectors[0], LANES)
    zero = tirx.const(0, "int32")
    body = tirx.BufferStore(R, _combine(op, tirx.BufferLoad(R, [zero]), total), [zero])
    block = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, body)
    impl = impl.with_body(s_tir.SBlockRealize([], True, block))
    register_intrin(name, desc, impl)
    _REGISTERED.add(name)
    return name


def tensorize_row(sch, block_name: str, op: str) -> None:
    """A (rows, columns) reduction block as ``row_intrin`` a row, its init a block before each row."""
    j = sch.get_loops(block_name)[-1]
    sch.decompose_reduction(block_name, j)
    sch.tensorize(j, row_intrin(op, int(sch.get(j).extent)))
