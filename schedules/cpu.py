"""CPU (llvm) schedule: one task per (batch, head, Q block); GEMMs as register tiles, the other loops
vectorised."""

from __future__ import annotations

import sys

import tvm

from . import common
from .common import has_block, read_index
from .contract import TILE, DecodeTasks, Fp8Forward, Knob, KnobSet, ProgramSchedule, Schedule

# ------------------------------------------------------------------------------------------------
# knobs: the forward's, the backward's and the decode's
# ------------------------------------------------------------------------------------------------
# 64x64 tiles with 16-wide vectors: measured the fastest at head_dim 64 and 128 on an AVX-512
# machine against block_n 128, block_m 32 and 8-wide vectors (BENCHMARKS.md, CPU). block_m / block_n
# are the program's tile sizes, one MetaSchedule task per pair; ``vector`` (the SIMD width of the
# inner loops, in elements) is sampled inside each task (it may be an ExprRV). float32 takes 128 x 32
# tiles, measured faster than 64 x 64 at every point of the forward's grid on an Intel AVX-512 machine
# (BENCHMARKS.md, CPU float32; not measured on an AMD one).
VECTORS = (4, 8, 16, 32)
SAMPLED_VECTORS = (8, 16)  # the tuning space's
# The tile sizes a caller may give: powers of two, which the register tiles (up to 4 rows by up to 4
# vectors) divide, up to where a task's float32 score tile (block_m x block_n, 128 KiB at the largest)
# still sits in a core's L2. Others (block_m=7, block_n=4096) ran, correctly and slowly: a typo, taken
# silently.
BLOCK_M = (8, 16, 32, 64, 128)
BLOCK_N = (16, 32, 64, 128, 256)
FORWARD = KnobSet("cpu", "forward", (
    Knob("block_m", 64, choices=BLOCK_M, space=(16, 32, 64, 128), role=TILE, by_dtype={"float32": 128}),
    Knob("block_n", 64, choices=BLOCK_N, space=(32, 64, 128), role=TILE, by_dtype={"float32": 32}),
    Knob("vector", 16, choices=VECTORS, space=SAMPLED_VECTORS),
))
# The backward (``schedule_backward``): its own knobs, as its tiles need not be the forward's.
# dq_atomic: dkdv also adds each K/V block's share of dq (ds k) into a float32 accumulator, five products
# instead of the dq program's seven. The CPU has no atomics and needs none: one task owns a whole (sequence,
# K/V head), walking its K/V blocks in turn, so every addition into its rows of dq is made by one thread in
# a fixed order (bitwise reproducible, ``Schedule.ordered_dq_accumulation``). Its tasks are batch x heads_kv
# alone, so where those leave threads idle the dq program (parallel over the blocks too) runs instead:
# ``BackwardKernel._for_tasks`` decides that per call. float32 takes 128 keys a tile with dq_atomic, measured
# faster than 64 on most of the float32 grid on an Intel AVX-512 machine (a task's steps read q and dout
# once for more keys), and 64 with the dq pass (``dq_pass_by_head_dim``), where 128 measured slower.
BACKWARD = KnobSet("cpu", "backward", (
    Knob("block_m", 64, choices=BLOCK_M, space=(16, 32, 64), role=TILE),
    Knob("block_n", 64, choices=BLOCK_N, space=(32, 64, 128), role=TILE, by_dtype={"float32": 128}),
    Knob("vector", 16, choices=VECTORS, space=SAMPLED_VECTORS),
    Knob("dq_atomic", True, space=(True, False)),
), dq_pass_by_head_dim={head_dim: {"block_n": 64} for head_dim in range(8, 257, 8)})
# The decode (``schedule_decode``). query_tokens: query tokens per task (its rows are those tokens
# times the GQA group's heads); block_n: keys per K/V tile. The CPU is not where decode speed is
# measured: small tiles keep the partial buffers small and the tasks many.
DECODE = KnobSet("cpu", "decode", (
    Knob("query_tokens", 1, space=(1, 2, 4)),
    Knob("block_n", 64, choices=BLOCK_N, space=(32, 64, 128)),
    Knob("vector", 16, choices=VECTORS, space=SAMPLED_VECTORS),
))


# ------------------------------------------------------------------------------------------------
# the forward (tvmflash.program)
# ------------------------------------------------------------------------------------------------
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
        vectorize_inner(sch, name, vector)

    # S[i, :] += Q[i, d] * Kᵀ[d, :]: keys innermost, vectorised.
    _gemm_register_tile(sch, "qk", vector)
    # acc[i, :] += P[i, j] * V[j, :]: head_dim innermost, vectorised.
    _gemm_register_tile(sch, "pv", vector)

    for name in ("score", "exp", "cast_p"):
        vectorize_inner(sch, name, vector)
    return sch


def _gemm_register_tile(sch, block_name, vector):
    """A (rows, cols, reduction) block as a register tile: up to 4 rows by up to 4 vectors of
    contiguous columns, updated along the whole reduction before the next tile (the rows and vectors
    unrolled, so LLVM keeps the 16 accumulators in registers; one broadcast of the left operand feeds
    a row's vectors). The init is its own block."""
    i, n, k = sch.get_loops(block_name)[-3:]
    rows_extent, cols_extent = (int(sch.get(loop).extent) for loop in (i, n))
    # A sampled vector (the tuner's ExprRV) is at most the space's widest, and divides it.
    width = vector if isinstance(vector, int) else max(SAMPLED_VECTORS)
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


def vectorize_inner(sch, block_name, vector):
    loop = sch.get_loops(block_name)[-1]
    _, inner = sch.split(loop, [None, vector])
    sch.vectorize(inner)


# ------------------------------------------------------------------------------------------------
# the backward (tvmflash.program_backward)
# ------------------------------------------------------------------------------------------------
def schedule_backward(sch: tvm.s_tir.Schedule, *, block_m: int, block_n: int, vector: int,
                      dq_atomic: bool = False) -> tvm.s_tir.Schedule:
    """Map the backward programs onto the CPU: parallel over their tiles, vectorised along
    contiguous rows. ``dq_atomic``: the program has no dq; dkdv adds dq's share (``BACKWARD``'s comment)
    and convert_dq rounds it."""
    schedule_delta(sch)
    for func in ("dkdv",) + (("convert_dq",) if dq_atomic else ("dq",)):
        sch.work_on(func)
        if func == "convert_dq":
            schedule_convert_dq(sch, vector)
            continue
        backward_tiles(sch, func)
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
        # ... and dv += pᵀ dout, dk += dsᵀ q, dq += ds k along head_dim (dkdv's dq: its share, ds k, whose
        # left operand dsᵀ is read a broadcast element at a time, so as it is stored).
        products = (("dv", "dk") + (("dq",) if dq_atomic else ())) if func == "dkdv" else ("dq",)
        for name in ("qk", "dp") + products:
            _gemm_register_tile(sch, name, vector)
        vectorize_backward_rows(sch, func, vector)
        if func == "dkdv" and dq_atomic:
            vectorize_inner(sch, "accumulate_dq", vector)
    return sch


def backward_tiles(sch: tvm.s_tir.Schedule, func: str) -> None:
    """The tiles of ``func`` (being worked on) as parallel tasks; dkdv's in turn where it adds a learned
    capture's gradient (``program_flex_gradient``): every tile adds into it, and TVM's LLVM code generation has no
    atomic addition ("CPU backend does not support atomic add yet"). Where dkdv adds dq's share
    (``accumulate_dq``), a task per (sequence, K/V head), which walks its K/V blocks in turn: the tiles of one
    K/V head add into the same rows of dq, those of another head or sequence never."""
    b, hk, kbc = sch.get_loops("tile")
    if func == "dkdv" and common.has_block(sch, "capture_gradient"):
        sch.fuse(b, hk, kbc)
    elif func == "dkdv" and common.has_block(sch, "accumulate_dq"):
        sch.parallel(sch.fuse(b, hk))
    else:
        sch.parallel(sch.fuse(b, hk, kbc))


def schedule_convert_dq(sch: tvm.s_tir.Schedule, vector) -> None:
    """convert_dq (being worked on): parallel over (batch, row), vectorised along head_dim."""
    b, i, _, _ = sch.get_loops("convert_dq")
    sch.parallel(sch.fuse(b, i))
    vectorize_inner(sch, "convert_dq", vector)


def schedule_delta(sch: tvm.s_tir.Schedule) -> None:
    """The backward's delta program: parallel over (batch, row), each row's sum in a register."""
    sch.work_on("delta")
    b, i, h, _ = sch.get_loops("delta")
    sch.reverse_compute_at("finish_rows", h)
    sch.set_scope("delta", 0, "local")
    sch.parallel(sch.fuse(b, i))


def vectorize_backward_rows(sch: tvm.s_tir.Schedule, func: str, vector) -> None:
    """The loads, the gradients' inits and stores, and the elementwise blocks (p, ds, pᵀ's cast) of
    ``func`` ("dkdv" or "dq", being worked on), vectorised along their contiguous rows."""
    loads = ("load_q", "load_do", "load_k", "load_v")
    inits = ("init_dk", "init_dv", "store_dk", "store_dv") if func == "dkdv" else ("init_dq", "store_dq")
    elementwise = ("exp", "ds") + (("cast_p",) if func == "dkdv" else ())
    for name in loads + inits + elementwise:
        vectorize_inner(sch, name, vector)


# ------------------------------------------------------------------------------------------------
# decode (tvmflash.program_decode): the split program and the merge program
# ------------------------------------------------------------------------------------------------
def schedule_decode(sch: tvm.s_tir.Schedule, *, query_tokens: int, block_n: int, vector: int) -> tvm.s_tir.Schedule:
    """Map the decode programs (functions ``split``, ``single`` and ``merge`` of the module) onto the
    CPU: the split tasks and the merge's rows run in parallel, inner loops as the forward's."""
    names = {gv.name_hint for gv in sch.mod.functions}
    for func in [name for name in ("split", "single") if name in names]:  # single: the split program, final
        sch.work_on(func)
        sch.parallel(sch.fuse(*sch.get_loops("tile")))
        # (an FP8 cache's byte_tiles form: the tiles the products read are dequant_k's and dequant_v's)
        byte_tiles = ("dequant_k", "dequant_v") if has_block(sch, "dequant_k") else ()
        sch.transform_layout(byte_tiles[0] if byte_tiles else "load_k", ("write", 0),
                             lambda j, d: (d, j))  # keys contiguous for the score loop
        for name in ("load_q", "load_k", "load_v", *byte_tiles, "init_acc", "store_o", "score", "exp"):
            vectorize_inner(sch, name, vector)
        _gemm_register_tile(sch, "qk", vector)
        _gemm_register_tile(sch, "pv", vector)

    sch.work_on("merge")
    sch.parallel(sch.fuse(*sch.get_loops("row")))
    d, s = sch.get_loops("merge_o")[-2:]
    sch.reorder(s, d)  # acc[:] += w_s * o_s[:], along contiguous head_dim
    _, inner = sch.split(d, [None, vector])
    sch.vectorize(inner)
    sch.decompose_reduction("merge_o", s)
    vectorize_inner(sch, "store_o", vector)
    return sch


# One split task a core (``DecodeTasks``' default): decode picks its split count from it.
SCHEDULE = Schedule(
    name="cpu", target_kind="llvm", dtypes=("float16", "bfloat16", "float32"),
    forward=ProgramSchedule(FORWARD, schedule),
    # the FP8 program on the CPU (LLVM converts e4m3 in software): a check of the program for the tests
    # (``kernels.fp8.Fp8Kernel``); the torch API runs FP8 on sm90 alone
    fp8_forward=Fp8Forward(FORWARD, schedule, tuple(range(16, 257, 16))),
    backward=ProgramSchedule(BACKWARD, schedule_backward),
    ordered_dq_accumulation=True,  # one task a (sequence, K/V head): ``backward_tiles``
    decode=ProgramSchedule(DECODE, schedule_decode, tasks=DecodeTasks(fp8_cache=True)),
    sources=(sys.modules[__name__], common),
)
