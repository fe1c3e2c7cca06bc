"""CPU (llvm) schedule: one task per (batch, head, Q block); GEMMs as register tiles, the other loops
vectorised."""

from __future__ import annotations

import tvm

from .common import read_index

# 64x64 tiles with 16-wide vectors: the fastest at d64 and d128 (bf16, s1024) on a 2-core AVX-512
# machine against block_n 128, block_m 32 and 8-wide vectors (BENCHMARKS.md, CPU).
KNOBS = {"block_m": 64, "block_n": 64, "vector": 16}
# Tuning space (``tvmflash tune``): block_m / block_n are the program's tile sizes, one
# MetaSchedule task per pair; ``vector`` is sampled inside each task (it may be an ExprRV).
SPACE = {"block_m": [16, 32, 64], "block_n": [32, 64, 128], "vector": [8, 16]}


def schedule(sch: tvm.s_tir.Schedule, *, block_m: int, block_n: int, vector: int) -> tvm.s_tir.Schedule:
    """Map the attention program onto the CPU.

    block_m / block_n are the program's tile sizes (rows of Q per task, K/V rows per step); the
    schedule only reads them to size its loops. ``vector`` is the SIMD width of the inner loops: an
    int, or a ``sample_categorical`` ExprRV when the tuner samples it.
    """
    tile = sch.get_sblock("tile")
    sch.parallel(sch.fuse(*sch.get_loops(tile)))

    # Store K transposed (head_dim, block_n), so the score loop runs along contiguous keys.
    sch.transform_layout("load_k", ("write", 0), lambda j, d: (d, j))
    for name in ("load_q", "load_k", "load_v", "init_acc", "store_o"):
        _vectorize_inner(sch, name, vector)

    # S[i, :] += Q[i, d] * Kᵀ[d, :]: keys innermost, vectorised.
    _gemm_register_tile(sch, "qk", vector)
    # acc[i, :] += P[i, j] * V[j, :]: head_dim innermost, vectorised.
    _gemm_register_tile(sch, "pv", vector)

    for name in ("score", "exp", "cast_p"):
        _vectorize_inner(sch, name, vector)
    return sch


def _gemm_register_tile(sch, block_name, vector):
    """A (rows, cols, reduction) block as a register tile: up to 4 rows by up to 4 vectors of
    contiguous columns, updated along the whole reduction before the next tile (the rows and vectors
    unrolled, so LLVM keeps the 16 accumulators in registers; one broadcast of the left operand feeds
    a row's vectors). The init is its own block."""
    i, n, k = sch.get_loops(block_name)[-3:]
    rows_extent, cols_extent = (int(sch.get(loop).extent) for loop in (i, n))
    # A sampled vector (the tuner's ExprRV) is at most SPACE's widest, and divides it.
    width = vector if isinstance(vector, int) else max(SPACE["vector"])
    rows = next(r for r in (4, 2, 1) if rows_extent % r == 0)
    vectors = next((v for v in (4, 3, 2, 1) if cols_extent % (v * width) == 0), None)
    io, ii = sch.split(i, [None, rows])
    if vectors is None:  # columns no multiple of a vector: one vector at a time, the last predicated
        no, nv = sch.split(n, [None, vector])
        sch.reorder(io, no, k, ii, nv)
    else:
        no, nr, nv = sch.split(n, [None, vectors, vector])
        sch.reorder(io, no, k, ii, nr, nv)
        sch.unroll(nr)
    sch.vectorize(nv)
    sch.unroll(ii)
    sch.decompose_reduction(block_name, k)


def _vectorize_inner(sch, block_name, vector):
    loop = sch.get_loops(block_name)[-1]
    _, inner = sch.split(loop, [None, vector])
    sch.vectorize(inner)


# The backward (``tvmflash.program_backward``): its own knobs, as its tiles need not be the forward's.
BACKWARD_KNOBS = {"block_m": 64, "block_n": 64, "vector": 16}
BACKWARD_SPACE = {"block_m": [16, 32, 64], "block_n": [32, 64, 128], "vector": [8, 16]}


def schedule_backward(sch: tvm.s_tir.Schedule, *, block_m: int, block_n: int, vector: int) -> tvm.s_tir.Schedule:
    """Map the backward programs onto the CPU: parallel over their tiles, vectorised along
    contiguous rows. The knobs are the forward's."""
    sch.work_on("delta")
    b, i, h, _ = sch.get_loops("delta")
    sch.reverse_compute_at("finish_rows", h)  # each row's sum in a register
    sch.set_scope("delta", 0, "local")
    sch.parallel(sch.fuse(b, i))

    for func in ("dkdv", "dq"):
        sch.work_on(func)
        sch.parallel(sch.fuse(*sch.get_loops("tile")))
        # q kᵀ and dout vᵀ (dkdv: k qᵀ and v doutᵀ) along the tile's contiguous columns: their
        # right operands transposed, (head_dim, columns). Those that also feed a product along
        # head_dim (dq: K in ds k; dkdv: q and dout in dsᵀ q and pᵀ dout) as a transposed copy.
        # Each entry: the product, its right operand, and the operand's load block where nothing
        # else reads it.
        columns = {"dkdv": (("qk", "Qt", None), ("dp", "dOt", None)),
                   "dq": (("qk", "Kt", None), ("dp", "Vt", "load_v"))}[func]
        for name, operand, load in columns:
            block = load or sch.cache_read(name, read_index(sch, name, operand), "global", consumer_blocks=[name])
            sch.transform_layout(block, ("write", 0), lambda r, d: (d, r))
        # ... and dv += pᵀ dout, dk += dsᵀ q, dq += ds k along head_dim.
        for name in ("qk", "dp") + (("dv", "dk") if func == "dkdv" else ("dq",)):
            _gemm_register_tile(sch, name, vector)
        loads = ("load_q", "load_do", "load_k", "load_v")
        inits = ("init_dk", "init_dv", "store_dk", "store_dv") if func == "dkdv" else ("init_dq", "store_dq")
        elementwise = ("exp", "ds") + (("cast_p",) if func == "dkdv" else ())
        for name in loads + inits + elementwise:
            _vectorize_inner(sch, name, vector)
    return sch


# ------------------------------------------------------------------------------------------------
# decode (tvmflash.program_decode): the split program and the merge program
# ------------------------------------------------------------------------------------------------
# query_tokens: query tokens per task (its rows are those tokens times the GQA group's heads);
# block_n: keys per K/V tile. The CPU is not where decode speed is measured: small tiles keep the
# partial buffers small and the tasks many.
DECODE_KNOBS = {"query_tokens": 1, "block_n": 64, "vector": 16}
DECODE_SPACE = {"query_tokens": [1, 2, 4], "block_n": [32, 64, 128], "vector": [8, 16]}


def decode_tasks_per_core(knobs: dict) -> int:
    """Split tasks a core should have to run (``tvmflash.kernels.decode`` picks the split count from it)."""
    return 1


def schedule_decode(sch: tvm.s_tir.Schedule, *, query_tokens: int, block_n: int, vector: int) -> tvm.s_tir.Schedule:
    """Map the decode programs (functions ``split``, ``single`` and ``merge`` of the module) onto the
    CPU: the split tasks and the merge's rows run in parallel, inner loops as the forward's."""
    names = {gv.name_hint for gv in sch.mod.functions}
    for func in [name for name in ("split", "single") if name in names]:  # single: the split program, final
        sch.work_on(func)
        sch.parallel(sch.fuse(*sch.get_loops("tile")))
        sch.transform_layout("load_k", ("write", 0), lambda j, d: (d, j))  # keys contiguous for the score loop
        for name in ("load_q", "load_k", "load_v", "init_acc", "store_o", "score", "exp"):
            _vectorize_inner(sch, name, vector)
        _gemm_register_tile(sch, "qk", vector)
        _gemm_register_tile(sch, "pv", vector)

    sch.work_on("merge")
    sch.parallel(sch.fuse(*sch.get_loops("row")))
    d, s = sch.get_loops("merge_o")[-2:]
    sch.reorder(s, d)  # acc[:] += w_s * o_s[:], along contiguous head_dim
    _, inner = sch.split(d, [None, vector])
    sch.vectorize(inner)
    sch.decompose_reduction("merge_o", s)
    _vectorize_inner(sch, "store_o", vector)
    return sch
