"""The sm90 schedule's knobs, declared once (``schedules.contract``): the forward's and the backward's,
with the rules between them, the checks of what does not build or fit (registers, alignment, shared
memory), the kernel attributes they ask for, and the schedule's build flags."""

from __future__ import annotations

from tvmflash.lowering.annotations import (NARROW_SWIZZLE_COLUMNS, SWIZZLE_COLUMNS, TMA_BARRIER_BYTES,
                                           TMA_BARRIER_PADDINGS, TMA_PRODUCERS, swizzle_columns)
from tvmflash.lowering.tma_device_functions import CONSUMER_REGISTERS  # setmaxnreg's, with a producer warpgroup
from tvmflash.lowering.tma_reductions import ROW_COLUMNS as TMA_REDUCE_COLUMNS  # float32 rows of dq_reduce "tma"

from ..contract import DERIVED, PROGRAM, STRUCTURE, TILE, Knob, KnobSet
from ..sm80.knobs import DTYPES, STRIDE_ALIGNMENT  # noqa: F401 - the same fp16/bf16 pair, 16-byte copies
from .layouts import (CORE_MATRIX_ELEMENTS, FP8_CHUNK, FP8_CORE_MATRIX_ELEMENTS, PAD_ELEMENTS, SWIZZLE_ALIGNMENT,
                      WARPGROUP, WG_ROWS)

# Where the per-row running values (m, l, ...) live, as in sm80: "registers", on the quads that hold
# the rows; "shared", one thread per row in shared memory (about 5 more barriers a K/V step).
ROW_STATES = ("registers", "shared")
# How the K/V tiles sit in shared memory: wgmma's "interleaved" core matrices, padded
# (``layouts.pad_core_matrix_stride``), or the 128-byte swizzled layout (``layouts.swizzled_map``),
# which TMA can write.
KV_LAYOUTS = ("core_matrices", "swizzled")
# How the Q tile and the output's staging tile sit in shared memory: padded core matrices and padded
# rows, or both in the 128-byte swizzled layout, unpadded (1/8 less memory: d128, block_m 128, 32 KiB
# each instead of 36 and 34), so that the output tile fits in the Q tile's memory.
Q_LAYOUTS = KV_LAYOUTS
# How the Q tile is copied: by every thread's loads and stores, or (with q_layout "swizzled" and TMA
# K/V tiles) by one TMA copy that the producer issues first thing, on a barrier of its own, as FA3
# does: the consumers wait for it instead of loading it. Correct on the H200, no faster there.
Q_COPIES = ("threads", "tma")
# How the output reaches global memory: "staged" through a shared-memory tile (16-byte stores along
# its rows, ``forward.store_through_shared_memory``), or "direct" from the accumulator registers,
# two adjacent columns a store, with no barrier (FA3 without its TMA store). Staging measured faster at
# two blocks an SM; "direct" is for one block an SM, where nothing hides the staging's barriers.
# Correct on the H200, no faster there.
O_STORES = ("staged", "direct")
# How dkdv stores dk and dv (``backward._schedule_dkdv``): from the registers, or through a shared-memory tile each
DKDV_STORES = ("direct", "staged")
# Who copies dkdv's K and V tiles (``backward._schedule_dkdv``): the consumer threads, or TMA (in the swizzled layout)
DKDV_KV_COPIES = ("threads", "tma")
# overlap 1, FA3's intra-warpgroup order: the step of tile j issues PV of tile j - 1, then QK^T of tile
# j, and waits once for both; V keeps num_stages tiles and K one fewer (``common.pipeline_loads``'s
# ``lagged``). Needs TMA and 3 stages or more. Correct on the H200; with a producer warpgroup and 3
# stages of block_n 128 it measured a little faster than the default at d128 non-causal in one run,
# and slower at 1k tokens and causal.
OVERLAPS = (0, 1)
# How the pipelined K/V tiles are copied: every thread's cp.async, 16 bytes each, then a block-wide
# barrier a step; or TMA (``tvmflash.lowering.tma_copies``): one thread issues each tile, completing on the stage's
# mbarrier, and no block-wide barrier is left in the K/V loop. TMA needs the swizzled layout.
KV_COPIES = ("cp.async", "tma")
# Who issues the TMA copies (``annotations.TMA_PRODUCERS``, lowered by ``tvmflash.lowering.tma_copies``): thread 0 of the
# first warpgroup, between its own wgmma; or, as in FA3, a warpgroup of its own (threadIdx.y ==
# num_warpgroups), which gives its registers to the others (setmaxnreg: 240 a consumer thread), so one
# thread block fills the SM.
PRODUCERS = TMA_PRODUCERS
# Where dkdv's slices of the gradients' columns go (``program_backward.attention_backward``'s
# dkdv_slicing): "rows", a warpgroup a slice of the same keys, which share the tile's q, dout, K and V
# in shared memory; "grid", a thread block a slice, each loading them.
DKDV_SLICINGS = ("rows", "grid")
NUM_STAGES = (1, 2, 3)  # 1: plain loads; 2, 3: the K/V loads in a cp.async software pipeline (as sm80)
# min_blocks_per_sm > 1 asks ptxas (``__launch_bounds__``) for few enough registers that that many
# thread blocks share an SM: with 2 warpgroups, 128 registers a thread for 2 blocks. Without it the
# d128 build takes 137, which leaves one block (8 warps) per SM, and nothing runs while its
# warpgroups wait on wgmma, on loads or at the softmax's barriers.
REGISTERS_PER_SM = 65536
# Registers a thread needs at the least: d64's and d128's builds take 114-127 at 2 stages. With 64
# (block_m 256, 2 blocks an SM) ptxas fails at d128: "Insufficient registers (64) to compile
# instruction ... register target of 94 or higher" (the wgmma's accumulator operands). One wgmma of
# m64nN holds N/2 fp32 accumulators a thread and about 30 more registers: at d256 (P V, m64n256)
# ptxas wants 158 ("Insufficient registers (128) ... register target of 158 or higher").
MIN_REGISTERS = 128
WGMMA_OPERAND_REGISTERS = 30


def register_problem(head_dim: int, block_n: int, threads: int, min_blocks_per_sm: int) -> str | None:
    """Why ``min_blocks_per_sm`` blocks of ``threads`` leave a thread too few registers, or None."""
    left = min(255, REGISTERS_PER_SM // (threads * min_blocks_per_sm))
    need = max(MIN_REGISTERS, max(head_dim, block_n) // 2 + WGMMA_OPERAND_REGISTERS)
    if left >= need:
        return None
    return (f"{min_blocks_per_sm} blocks of {threads} threads an SM leave {left} registers a thread, and the "
            f"accumulators need {need} at head_dim {head_dim} and block_n {block_n}")


def tma_can_copy(kv_layout: str, num_stages: int) -> bool:
    """TMA copies only swizzled tiles, and only in a pipeline (``tvmflash.lowering.tma_copies`` lowers its stages)."""
    return kv_layout == "swizzled" and num_stages > 1


def producer_problem(producer: str, kv_copy: str, min_blocks_per_sm: int, num_warpgroups: int) -> str | None:
    """Why this producer does not go with these knobs, or None."""
    if producer == "warpgroup" and (kv_copy != "tma" or min_blocks_per_sm != 1 or num_warpgroups != 2):
        return (f"producer 'warpgroup' needs kv_copy 'tma', min_blocks_per_sm 1 and block_m 128 (two consumer "
                f"warpgroups take 240 registers a thread), got {kv_copy!r}, {min_blocks_per_sm} and "
                f"{WG_ROWS * num_warpgroups}")
    return None


def overlap_problem(overlap: int, kv_copy: str, num_stages: int) -> str | None:
    """Why this overlap does not go with these knobs, or None."""
    if overlap and (kv_copy != "tma" or num_stages < 3):
        return f"overlap 1 needs kv_copy 'tma' and num_stages >= 3, got {kv_copy!r} and {num_stages}"
    return None


def q_copy_problem(q_copy: str, q_layout: str, kv_copy: str) -> str | None:
    """Why this Q copy does not go with these knobs, or None."""
    if q_copy == "tma" and (q_layout != "swizzled" or kv_copy != "tma"):
        return f"q_copy 'tma' needs q_layout 'swizzled' and kv_copy 'tma', got {q_layout!r} and {kv_copy!r}"
    return None


def forward_rules(knobs: dict) -> str | None:
    """Why complete forward knobs do not go together, or None (``tune`` leaves such structures out)."""
    if knobs["kv_copy"] == "tma" and not tma_can_copy(knobs["kv_layout"], knobs["num_stages"]):
        return (f"kv_copy 'tma' needs kv_layout 'swizzled' and num_stages >= 2, got {knobs['kv_layout']!r} and "
                f"{knobs['num_stages']}")
    if knobs["num_warpgroups"] * WG_ROWS != knobs["block_m"]:
        return f"block_m ({knobs['block_m']}) must be 64 * num_warpgroups ({knobs['num_warpgroups']})"
    return (q_copy_problem(knobs["q_copy"], knobs["q_layout"], knobs["kv_copy"])
            or overlap_problem(knobs["overlap"], knobs["kv_copy"], knobs["num_stages"])
            or producer_problem(knobs["producer"], knobs["kv_copy"], knobs["min_blocks_per_sm"],
                                knobs["num_warpgroups"]))


def forward_build_problem(head_dim: int, dtype: str, knobs: dict) -> str | None:
    """Why a forward build with these complete knobs would fail, or None (shared memory is the
    ``shared_memory`` model's): the dtype, tile sizes wgmma cannot take, too few registers a thread, a
    swizzled layout at a head_dim that is no multiple of 32."""
    if dtype not in DTYPES:
        return f"the sm90 schedule takes {DTYPES}, got {dtype!r}"
    if knobs["block_n"] % 16 or knobs["block_n"] > 256 or head_dim % 16:
        return f"block_n and head_dim: expected multiples of 16 (block_n <= 256), got {knobs['block_n']} and {head_dim}"
    registers = register_problem(head_dim, knobs["block_n"], WARPGROUP * knobs["block_m"] // WG_ROWS,
                                 knobs["min_blocks_per_sm"])
    if registers is not None:
        return f"min_blocks_per_sm: {registers}"
    swizzled = [name for name in ("kv_layout", "q_layout") if knobs[name] == "swizzled"]
    if swizzled and swizzle_columns(head_dim) is None:
        return f"{' and '.join(swizzled)} 'swizzled' needs a head_dim that is a multiple of {NARROW_SWIZZLE_COLUMNS}"
    return None


def forward_precheck(head_dim: int, dtype: str, knobs: dict) -> str | None:
    """What the tuner leaves out before building: swizzled tiles without TMA that
    ``MergeSharedMemoryAllocations`` would place off the 1024-byte boundary the swizzle needs
    (``tvmflash.lowering.tile_alignment.MisalignedTiles``, which the build raises)."""
    swizzled = [name for name in ("kv_layout", "q_layout") if knobs[name] == "swizzled"]
    if swizzled and knobs["kv_copy"] != "tma":
        # Without TMA no barrier padding moves the tiles (``lowering.pipeline.build``): they sit where
        # MergeSharedMemoryAllocations puts them, after the per-row values, then the Q tile, then the
        # K/V tiles. Each must start on a 1024-byte boundary, so each size before one must be a multiple.
        padded = head_dim * (CORE_MATRIX_ELEMENTS + PAD_ELEMENTS) // CORE_MATRIX_ELEMENTS
        per_row = (5 if knobs["row_state"] == "shared" else 2) * 4 * knobs["block_m"]
        q_tile = 2 * knobs["block_m"] * (head_dim if knobs["q_layout"] == "swizzled" else padded)
        kv_tile = 2 * knobs["block_n"] * (head_dim if knobs["kv_layout"] == "swizzled" else padded)
        if any(size % SWIZZLE_ALIGNMENT for size in (per_row, q_tile, kv_tile)):
            return (f"swizzled tiles without TMA at block_m {knobs['block_m']}: the {per_row}-byte row values, "
                    f"{q_tile}-byte Q tile and {kv_tile}-byte K/V tiles put one off the {SWIZZLE_ALIGNMENT}-byte "
                    "boundary the swizzle needs")
    return None


PASS_CONFIG: dict = {"tirx.use_async_copy": True}  # cp.async for the pipelined loads
# wgmma reads its shared-memory operands through the async proxy: a cp.async tile needs
# fence.proxy.async after its wait (lowering.tvm_fixes.ConstantAsyncWaitCounts).
ASYNC_PROXY_OPERANDS = True
# The causal tile test reads the Q block (blockIdx.y), which TVM's HoistIfThenElse will not hoist out
# of the score's element loops (``lowering.uniformity.HoistBlockIndexConditions``): without it each
# score of a causal K/V step kept a branch of its own, which measured clearly slower on the H200 (causal,
# d64 and d128).
HOIST_BLOCK_INDEX_CONDITIONS = True


def min_kv_tiles(knobs: dict) -> int:
    """K/V tiles a Q block visits at the least (``schedules.program_for``): a TMA pipeline of s
    stages gets s - 1, so that the program's count is provably enough for the pipeline's epilogue
    to run unguarded (guarded, at 3 stages of block_n 128 its wgmma spilled at 255 registers and ran
    at less than half the speed). A cp.async pipeline keeps 1: unguarded, its epilogue's wait counts
    are not constants."""
    return knobs["num_stages"] - 1 if knobs["kv_copy"] == "tma" and knobs["num_stages"] > 2 else 1


def kernel_attrs(knobs: dict) -> dict:
    """Function attributes for these knobs (``schedules.with_kernel_attrs``): min_blocks_per_sm
    as ``__launch_bounds__(threads, min_blocks_per_sm)``."""
    blocks = knobs.get("min_blocks_per_sm", 1)
    return {"tirx.launch_bounds_min_blocks_per_sm": blocks} if blocks > 1 else {}


def shared_memory_bytes(head_dim: int, dtype: str, knobs: dict) -> int:
    """Shared memory a build with these knobs needs: the Q tile (``q_layout``: wgmma core matrices
    padded by 16 bytes each, ``layouts.pad_core_matrix_stride``, or swizzled, unpadded) and
    num_stages K/V tile pairs (``kv_layout``, the same choice), or the output's staging tile if that
    is larger (``forward.store_through_shared_memory``: it reuses their memory; with a producer
    warpgroup only the Q tile's, ``tvmflash.lowering.tma_producer_warpgroup.split_warpgroups``), plus the per-row values
    staged in shared memory (row_state "shared": m_tile, l_tile, m_new, alpha, inv_l; "registers": m
    and l, for store_lse), and the mbarriers of TMA copies with their largest padding."""
    padded = head_dim * (CORE_MATRIX_ELEMENTS + PAD_ELEMENTS) // CORE_MATRIX_ELEMENTS
    kv_row = head_dim if knobs["kv_layout"] == "swizzled" else padded
    q_swizzled = knobs["q_layout"] == "swizzled"
    q_tile = knobs["block_m"] * (head_dim if q_swizzled else padded)
    kv_tiles = knobs["block_n"] * (2 * knobs["num_stages"] - knobs["overlap"]) * kv_row  # overlap: K a stage fewer
    output_tile = knobs["block_m"] * (head_dim if q_swizzled else head_dim + PAD_ELEMENTS)
    if knobs["o_store"] == "direct":  # no staging tile
        output_tile = 0
    if knobs["producer"] == "warpgroup":
        staged = kv_tiles + max(q_tile, output_tile)
    else:
        staged = max(q_tile + kv_tiles, output_tile)
    per_row = (5 if knobs["row_state"] == "shared" else 2) * 4 * knobs["block_m"]
    barriers = TMA_BARRIER_BYTES[knobs["producer"]] + max(TMA_BARRIER_PADDINGS) if knobs["kv_copy"] == "tma" else 0
    return staged * 2 + per_row + barriers


# The H200's fastest (BENCHMARKS.md): 128-row blocks, two blocks an SM, the K/V tiles in the 128-byte
# swizzled layout loaded by TMA in two stages, ahead of the same pipeline on cp.async and of padded core
# matrices with plain loads. 256-row blocks (4 warpgroups, one block an SM) and 128-key tiles at one
# block an SM measured slower. d64 takes 128-key tiles. d96 (no multiple of 64) takes the same pipeline
# in the 64-byte swizzle, faster than its padded core matrices by cp.async. d32 keeps the padded core
# matrices.
# Tuning: the tiles and min_blocks_per_sm (``kernel_attrs``: __launch_bounds__, a function attribute
# of the program) are MetaSchedule tasks; the structure knobs change which schedule steps run (strings
# and a stage count: MetaSchedule samples only ints into a trace), so each valid combination is a
# design space of its own inside the task. block_m 256: four warpgroups (512 threads, at most 128
# registers each) share each K/V tile. q_copy "tma", o_store "direct" and overlap 1 (with 3 stages) are
# correct on the H200 but measured no faster over the grid: left out of the space to keep the design
# spaces few. varlen's packed sequences take the output straight from the registers, each row's store
# predicated on the sequence's rows (the staging tile's copy-out takes its rows from the store's
# region, which TensorIR cannot bound with the offsets read from cu_seqlens); the TMA copies read past
# a sequence's last key, which the mask hides. At d32 each wgmma does too little to pay off: sm_90a
# prefers the sm80 schedule there (``PREFERRED_HEAD_DIMS``), which measured faster.
FORWARD = KnobSet("sm90", "forward", (
    Knob("block_m", 128, space=(64, 128, 256), role=TILE),
    Knob("block_n", 64, space=(64, 128), by_head_dim={64: 128}, role=TILE),
    Knob("num_warpgroups", 2, space=lambda knobs: [knobs["block_m"] // WG_ROWS], role=DERIVED),
    Knob("num_stages", 2, choices=NUM_STAGES, space=(1, 2), by_head_dim={32: 1}, role=STRUCTURE),
    Knob("vec", 8),
    # d256's accumulators take 197 registers a thread: one block an SM; from d160 two blocks spill (696
    # bytes at d160) or leave too few registers (d224), one does not
    Knob("min_blocks_per_sm", 2, space=(1, 2), by_head_dim={160: 1, 192: 1, 224: 1, 256: 1}, role=PROGRAM),
    Knob("row_state", "registers", choices=ROW_STATES),
    Knob("kv_layout", "swizzled", choices=KV_LAYOUTS, space=("swizzled", "core_matrices"),
         by_head_dim={32: "core_matrices"}, role=STRUCTURE),
    Knob("kv_copy", "tma", choices=KV_COPIES, space=("tma", "cp.async"), by_head_dim={32: "cp.async"}, role=STRUCTURE),
    Knob("producer", "thread", choices=PRODUCERS, space=("thread", "warpgroup"), role=STRUCTURE),
    Knob("q_layout", "core_matrices", choices=Q_LAYOUTS, space=("core_matrices", "swizzled"), role=STRUCTURE),
    Knob("q_copy", "threads", choices=Q_COPIES, role=STRUCTURE),
    Knob("o_store", "staged", choices=O_STORES, varlen="direct", role=STRUCTURE),
    Knob("overlap", 0, choices=OVERLAPS, role=STRUCTURE),
), rules=forward_rules, build_problem=forward_build_problem, precheck=forward_precheck,
   shared_memory=shared_memory_bytes)
PREFERRED_HEAD_DIMS = (64, 96, 128, 256)
# The head_dims it builds at (cross-compiled and through nvcc at every multiple of 8 up to 256): the
# multiples of 32, where the defaults' swizzled K/V tiles fit (``swizzle_columns``; d32 takes padded core
# matrices). It serves 160, 192 and 224 when asked (TVMFLASH_SM90=1, ``schedule="sm90"``) but prefers
# them to the sm80 schedule only once measured; the other multiples of 16 go to sm80.
HEAD_DIMS = tuple(range(32, 257, 32))


# The backward's knobs (``backward.schedule_backward``). Each program's stream of tiles (dkdv: Q, dout
# and their rows' lse and delta; dq: K and V) is loaded in a pipeline of ``*_stages`` (1: plain loads),
# by cp.async or, dkdv's with ``dkdv_copy`` "tma" (the default), by TMA: one thread copies a Q block's
# q and dout (swizzled tiles) and its rows' lse and delta on the stage's mbarrier
# (``tvmflash.lowering.tma_copies``), so the other threads spend no registers or instructions on the copies
# and the loads need no block-wide barrier. With the epilogue's guards merged
# (``lowering.uniformity.MergeAdjacentGuards``: no spills at d128) it measured faster than the plain loads
# at d128 and the cp.async pipeline at d64 (BENCHMARKS.md). Dense only: varlen's rows past a
# sequence's end must read as zeros, not as the next sequence's, so varlen keeps cp.async (``BACKWARD``).
# dq_atomic (the default): no dq pass; dkdv adds each step's ds k into an fp32 accumulator
# (``backward._schedule_dq_share``), measured faster than the dq pass; deterministic=True turns it off
# (``tvmflash.choice.backward``). wgmma_overlap: dp's wgmma only
# committed, so that p's exponentials run while it does (ds waits for it), and dv's (and with dq_atomic
# dq's share's) too, so that dk's wait ends them; without it each product is waited for at once. With dq_atomic: ds_buffers, dsᵀ's
# shared-memory tile for dq's share in one buffer or two taken in turn (``lowering.double_buffers``: one
# block-wide barrier a step instead of two; varlen's steps have no second barrier to drop); dq_reduce,
# the share added by atomics from the accumulator registers (16 ``red.global.add.v2`` a thread a step at
# d128, each warp's touching 8 rows), by "vector" atomics from a shared-memory tile of it (8
# ``red.global.add.v4``, whole 128-byte lines a warp), by bulk reductions (a row a thread,
# ``cp.reduce.async.bulk``) or by one TMA reduction a warpgroup (``cp.reduce.async.bulk.tensor``, FA3's
# way; it needs dkdv_copy "tma", whose lowering encodes the tensor map).
# dkdv_producer: who issues dkdv's TMA copies, thread 0 between its own wgmma, or a warpgroup of its
# own (FA3's, ``lowering.tma_producer_warpgroup``): the default at d64 and d128, where it measured
# faster with causal masks and as fast without (BENCHMARKS.md).
# d96 (no multiple of 64): q and dout in the 64-byte swizzle, dq's share by "vector" atomics (TMA's
# reduction takes rows of 32 floats, and a warpgroup has 48 columns), thread 0 issuing the copies (a
# producer warpgroup spills there); the rest as at d128. Not measured: the defaults are the ones that
# build with no spill. d256: dk and dv of a warpgroup's 64 keys would take 256 registers a thread
# (``backward_register_problem``), so dkdv makes them in two slices of the columns (dkdv_slices 2), a
# warpgroup a slice of the same 64 keys (dkdv_slicing "rows": two warpgroups share the tile's q, dout, K and V
# in shared memory, each recomputing sᵀ and dpᵀ) or a thread block a slice ("grid"); block_n 64 (K and V of
# 128 keys do not fit next to two stages of q and dout), dsᵀ in one buffer, dq's share by atomics from the
# registers (no room for a float32 tile), thread 0 issuing the copies, the dq pass in 64-row blocks. Not
# measured: the defaults are the ones that build with no spill (250-255 registers a thread).
# dkdv_store: dk and dv stored from the accumulator registers ("direct", a 4-byte store a pair of adjacent
# columns, each warp's touching 8 rows) or, as the forward's output (o_store "staged"), through a padded tile
# in the K and V tiles' shared memory, dead by then, and out in 16-byte row pieces ("staged"): a quarter of
# the global stores, whole sectors. Not measured yet; varlen's row offsets fail TVM's lowering of the staged
# copy, so varlen stores directly. dkdv_kv_copy: the tile's K and V copied by the consumer threads at its start
# (16-byte loads, 16 a thread at d128: their only global loads) or by TMA, swizzled, on one barrier issued by
# thread 0 of the first warpgroup (as the forward's q_copy "tma"). Not measured yet; at d128 only with dq_atomic (d64's
# and d96's warpgroups take part of a swizzled group of dq's share's columns), and under a causal mask ptxas
# spills 4 bytes at d128.


def backward_shared_memory_bytes(head_dim: int, dtype: str, knobs: dict) -> int:
    """Dynamic shared memory of the larger of dkdv and dq: each program's tiles in padded core
    matrices (``layouts.pad_core_matrix_stride``), the streamed ones once a stage, and the rows' lse and
    delta; with dq_atomic, dkdv's dsᵀ tile (``dkdv_rows`` x block_m) and the float32 tile of dq's share
    (with dkdv_slicing "grid" its slice of the columns), and no dq."""
    def padded(cols):
        return cols * (CORE_MATRIX_ELEMENTS + PAD_ELEMENTS) // CORE_MATRIX_ELEMENTS

    tma = knobs.get("dkdv_copy") == "tma"  # swizzled q and dout (no padding), after the barriers, on 1 KiB
    stream = 2 * knobs["block_m"] * knobs["dkdv_stages"] * (head_dim if tma else padded(head_dim)) * 2
    dkdv = 2 * knobs["block_n"] * padded(head_dim) * 2 + stream + 8 * knobs["block_m"] * knobs["dkdv_stages"] \
        + (TMA_BARRIER_BYTES[knobs.get("dkdv_producer", "thread")] + SWIZZLE_ALIGNMENT if tma else 0)
    if knobs.get("dq_atomic"):
        reduce = knobs.get("dq_reduce", "atomic")  # the float32 tile of ds k: rows padded by 8, or TMA's swizzle
        # a dkdv tile's columns of dq's share: a slice with dkdv_slicing "grid"
        columns = head_dim // (knobs.get("dkdv_slices", 1) if knobs.get("dkdv_slicing", "rows") == "grid" else 1)
        tile = {"atomic": 0, "tma": knobs["block_m"] * columns * 4}.get(reduce, knobs["block_m"] * (columns + 8) * 4)
        return dkdv + knobs.get("ds_buffers", 1) * dkdv_rows(knobs) * padded(knobs["block_m"]) * 2 + tile
    dq = (2 * knobs["dq_block_m"] + 2 * knobs["dq_block_n"] * knobs["dq_stages"]) * padded(head_dim) * 2 \
        + 8 * knobs["dq_block_m"]
    return max(dkdv, dq)


def dq_share_problem(block_m: int, head_dim: int, groups: int) -> str | None:
    """Why dkdv cannot make dq's share (``dq_atomic``) with these tiles, or None."""
    if block_m != WG_ROWS or (head_dim // groups) % 8:
        return (f"the sm90 dq_atomic (the default) makes ds k in one wgmma of 64 query rows, each warpgroup "
                f"head_dim / warpgroups columns (a multiple of 8): it needs block_m 64 and head_dim a multiple of "
                f"{8 * groups}, got block_m {block_m} and head_dim {head_dim}; with other tiles pass dq_atomic False "
                f"(dq by a pass of its own)")
    return None


def _kv_copy_problem(head_dim: int, knobs: dict) -> str | None:
    """Why dkdv's K and V tiles cannot come by TMA (``dkdv_kv_copy`` "tma"), or None: the TMA lowering's one-off
    copy (the forward's Q tile's, ``tma_copies._one_off_copy``) waits on its barrier's first phase once a thread
    block, and its swizzled K is dq's share's B, each warpgroup whole swizzled groups of its columns."""
    if knobs.get("dkdv_kv_copy", "threads") != "tma":
        return None
    if knobs["dkdv_copy"] != "tma" or knobs.get("dkdv_persistent"):
        return ("dkdv_kv_copy 'tma' copies K and V once a thread block through the TMA lowering of dkdv's copies: it "
                f"needs dkdv_copy 'tma' and no dkdv_persistent, got {knobs['dkdv_copy']!r} and "
                f"{knobs.get('dkdv_persistent')}")
    slices = knobs["dkdv_slices"] if knobs["dkdv_slicing"] == "grid" else 1
    cols = head_dim // slices // max(1, dkdv_rows(knobs) // WG_ROWS)  # a warpgroup's columns of dq's share
    if knobs["dq_atomic"] and cols % swizzle_columns(head_dim):
        return (f"dkdv_kv_copy 'tma' swizzles K, which dq's share (dq_atomic) reads as B, {cols} columns a warpgroup "
                f"at head_dim {head_dim}: not whole groups of {swizzle_columns(head_dim)}; take 'threads' or dq_atomic "
                "False")
    return None


def dkdv_rows(knobs: dict) -> int:
    """The rows of a dkdv tile (64 a warpgroup): block_n keys, once a slice with dkdv_slicing "rows"."""
    rows = knobs.get("dkdv_slicing", "rows") == "rows"
    return knobs["block_n"] * (knobs.get("dkdv_slices", 1) if rows else 1)


def backward_register_problem(head_dim: int, knobs: dict) -> str | None:
    """Why a thread has too few registers for the backward's accumulators, or None. dkdv keeps dk and dv of
    its warpgroup's 64 keys across the Q blocks (head_dim / 2 registers a thread each) and makes s and dp a
    step (block_m / 2 each); the dq pass keeps dq (head_dim / 2) and makes s and dp (dq_block_n / 2 each).
    Each needs ``WGMMA_OPERAND_REGISTERS`` more. So dkdv fits no tile at d256: dk and dv alone take 256
    registers a thread, unless its tiles each make a slice of the columns (``dkdv_slices``: head_dim /
    dkdv_slices registers for dk and dv)."""
    threads = WARPGROUP * max(1, dkdv_rows(knobs) // WG_ROWS)
    left = min(255, REGISTERS_PER_SM // threads)
    if knobs["dkdv_producer"] == "warpgroup":
        left = CONSUMER_REGISTERS
    columns = head_dim // knobs.get("dkdv_slices", 1)  # a dkdv tile's slice of dk's and dv's columns
    need = columns + knobs["block_m"] + WGMMA_OPERAND_REGISTERS
    if need > left:
        return (f"the sm90 dkdv keeps dk and dv ({columns} registers a thread at head_dim {head_dim} in "
                f"{knobs.get('dkdv_slices', 1)} dkdv_slices) and s and dp ({knobs['block_m']} at block_m "
                f"{knobs['block_m']}) in registers: it needs {need}, a thread has {left}")
    need = head_dim // 2 + knobs["dq_block_n"] + WGMMA_OPERAND_REGISTERS
    if not knobs["dq_atomic"] and need > 255:
        return (f"the sm90 dq keeps dq ({head_dim // 2} registers a thread) and s and dp ({knobs['dq_block_n']} at "
                f"dq_block_n {knobs['dq_block_n']}) in registers: it needs {need}, a thread has 255")
    return None


def backward_build_problem(head_dim: int, dtype: str, knobs: dict) -> str | None:
    """Why these complete backward knobs cannot be scheduled, or None: checked when a backward kernel is
    made, before anything is built (the tuner leaves such configurations out)."""
    if knobs["dkdv_copy"] == "tma" and (knobs["dkdv_stages"] < 2 or swizzle_columns(head_dim) is None):
        return (f"dkdv_copy 'tma' copies into a pipeline's stages, in swizzled groups of {SWIZZLE_COLUMNS} or "
                f"{NARROW_SWIZZLE_COLUMNS} columns: it needs dkdv_stages >= 2 and a head_dim that is a multiple of "
                f"{NARROW_SWIZZLE_COLUMNS}, got {knobs['dkdv_stages']} and {head_dim}")
    if knobs["dkdv_producer"] != "thread" and knobs["dkdv_copy"] != "tma":
        return f"dkdv_producer {knobs['dkdv_producer']!r} issues TMA copies: it needs dkdv_copy 'tma'"
    if knobs["dkdv_producer"] == "warpgroup" and swizzle_columns(head_dim) != SWIZZLE_COLUMNS:
        # ptxas at d96: 168 registers, a 184-byte stack frame, 460 bytes of spill stores, its wgmma serialized
        # (d64 and d128 take none); thread 0's copies take none
        return (f"dkdv_producer 'warpgroup' spills at head_dim {head_dim} (q and dout in the 64-byte swizzle): "
                "take 'thread'")
    if knobs.get("dkdv_persistent") and knobs["dkdv_copy"] != "tma":
        return ("dkdv_persistent carries the TMA pipeline's barriers from one tile into the next: it needs "
                f"dkdv_copy 'tma', got {knobs['dkdv_copy']!r}")
    if knobs.get("dkdv_persistent") and knobs["dkdv_slices"] > 1:
        # ptxas at d256 (two slices, 255 registers a thread before the walk): 12 bytes of spill stores
        return "dkdv_persistent spills with dkdv_slices > 1 (d256's dk and dv in slices): take dkdv_persistent False"
    problem = _kv_copy_problem(head_dim, knobs)
    if problem:
        return problem
    if knobs.get("dkdv_store") == "staged" and knobs.get("dkdv_persistent"):
        # TVM's planner then finds the K and V tiles live (the walk's next tile) and puts the staging tiles
        # beside them: 236 KiB at d128
        return ("dkdv_store 'staged' puts dk and dv in the K and V tiles' shared memory, which dkdv_persistent keeps "
                "for the next tile: take dkdv_store 'direct'")
    if knobs["dq_reduce"] == "tma" and knobs["dkdv_copy"] != "tma":
        return "dq_reduce 'tma' adds dq's share by TMA, through the TMA lowering of dkdv's copies: it needs dkdv_copy 'tma'"
    slices = knobs["dkdv_slices"]
    columns = head_dim // slices  # a dkdv tile's slice of the gradients' columns
    if slices > 1 and columns % (swizzle_columns(head_dim) if knobs["dkdv_copy"] == "tma" else 8):
        # the slice's products read q and dout from its first column on: whole swizzled groups (a descriptor
        # cannot start inside one) or core matrices
        return (f"dkdv_slices {slices}: the sm90 dkdv reads q and dout of its slice of {columns} columns from whole "
                f"{'swizzled groups' if knobs['dkdv_copy'] == 'tma' else 'core matrices'}, got head_dim {head_dim}")
    if slices > 1 and knobs["dkdv_slicing"] == "grid" and knobs["dq_atomic"] and knobs["dq_reduce"] == "tma":
        return ("dkdv_slicing 'grid' adds a tile's slice of dq's share by atomics or from a shared-memory tile: take "
                "dq_reduce 'atomic' or 'vector'")
    registers = backward_register_problem(head_dim, knobs)
    if registers is not None:
        return registers
    if knobs["dq_atomic"]:
        groups = max(1, dkdv_rows(knobs) // WG_ROWS)
        share = head_dim if knobs["dkdv_slicing"] == "rows" else columns  # dq's share's columns in a tile
        if knobs["dq_reduce"] == "tma" and share // groups % TMA_REDUCE_COLUMNS:
            return (f"dq_reduce 'tma' adds each warpgroup's head_dim / warpgroups columns of dq's share in rows of "
                    f"{TMA_REDUCE_COLUMNS} float32 (TMA's 128-byte swizzle): it needs a multiple of "
                    f"{TMA_REDUCE_COLUMNS}, got {head_dim // groups}")
        return dq_share_problem(knobs["block_m"], share, groups)
    return None


# dkdv_persistent: PERSISTENT_BLOCKS thread blocks walk dkdv's tiles (``common.persistent_walk``), the TMA
# pipeline carried from one tile into the next (``annotations.PERSISTENT_WALK``), as cuDNN's backward runs
# one thread block an SM: a tile's dk and dv stores and the next tile's K and V loads are no thread
# block's exit and launch, and the producer loads the next tile's first Q blocks while the consumers
# finish a tile. Off until measured. TMA copies only (the lowering carries their barriers' phases); not
# with varlen (cp.async, and a sequence's tiles past its end) nor a BlockMask (its lists' lengths are read
# before the producer's and consumers' branches, once a thread block).
# The H100 SXM's and the H200's SMs, one thread block each (dkdv takes a whole SM at d64 and d128); on a
# GPU with fewer the blocks past its SMs wait for a second wave.
PERSISTENT_BLOCKS = 132
# d64: the dq pass in 32-key steps measured faster than in 64 (at d128 slower), and wgmma_overlap off a
# little faster than on (at d128 it gains). varlen by cp.async (TMA would read the next sequence's rows
# past a sequence's end, where the program needs zeros): at d128 by plain loads, faster than two
# stages (which spill there), at d64 in two stages, faster than one. dkdv_copy "tma" fills a
# pipeline's stages: with one stage, cp.async alone. ds_buffers 2 measured 5-7% faster than 1 (d128
# causal, d64), as fast at d128 non-causal; a producer warpgroup 3-7% faster than thread 0 at d64 (and
# with ds_buffers 2), 3% slower at d128; dq_reduce: at d128 "vector" 9-10% faster than the atomics and
# "tma" 1-2% faster than "vector"; at d64 "vector" 3-5% faster than the atomics and "tma" (varlen keeps
# the atomics, not measured there); bulk reductions 6-42% slower than the atomics (one operation a row:
# the copy engine's cost is per operation), so they are left out of the tuner's space (BENCHMARKS.md).
BACKWARD = KnobSet("sm90", "backward", (
    Knob("block_m", 64, space=(32, 64), role=TILE),
    Knob("block_n", 128, space=(64, 128), by_head_dim={256: 64}, role=TILE),
    Knob("dq_block_m", 128, space=(64, 128), by_head_dim={256: 64}, role=TILE),
    Knob("dq_block_n", 64, space=(32, 64), by_head_dim={64: 32}, role=TILE),
    Knob("dkdv_stages", 2, space=(1, 2)),
    Knob("dq_stages", 2, space=(1, 2)),
    Knob("vec", 8),
    Knob("dq_atomic", True, space=(True, False)),
    Knob("dkdv_copy", "tma", choices=KV_COPIES, varlen="cp.async", role=DERIVED,
         space=lambda knobs: list(KV_COPIES) if knobs["dkdv_stages"] > 1 else ["cp.async"]),
    Knob("wgmma_overlap", True, space=(True, False), by_head_dim={64: False}),
    Knob("ds_buffers", 2, choices=(1, 2), varlen=1, role=DERIVED, by_head_dim={256: 1},
         space=lambda knobs: [1, 2] if knobs["dq_atomic"] else [1]),
    Knob("dq_reduce", "atomic", choices=("atomic", "bulk", "vector", "tma"),
         by_head_dim={64: "vector", 96: "vector", 128: "tma"},
         varlen="atomic", role=DERIVED,
         space=lambda knobs: ["atomic", "vector", *(["tma"] if knobs["dkdv_copy"] == "tma" else [])]
         if knobs["dq_atomic"] else ["atomic"]),
    Knob("dkdv_slices", 1, choices=(1, 2), by_head_dim={256: 2}, role=TILE),
    Knob("dkdv_slicing", "rows", choices=DKDV_SLICINGS, role=TILE),
    Knob("dkdv_producer", "thread", choices=PRODUCERS, varlen="thread", role=DERIVED,
         by_head_dim={64: "warpgroup", 128: "warpgroup"},
         space=lambda knobs: list(PRODUCERS) if knobs["dkdv_copy"] == "tma" else ["thread"]),
    Knob("dkdv_persistent", False, varlen=False, role=STRUCTURE),
    Knob("dkdv_store", "direct", choices=DKDV_STORES, varlen="direct", role=STRUCTURE),
    Knob("dkdv_kv_copy", "threads", choices=DKDV_KV_COPIES, varlen="threads", role=STRUCTURE),
), build_problem=backward_build_problem, shared_memory=backward_shared_memory_bytes,
   varlen_by_head_dim={128: {"dkdv_stages": 1}, 256: {"dkdv_stages": 1}},
   # d256's dkdv without dq's share in two warpgroups spills 4 bytes at 255 registers under a softcap; a
   # thread block a slice does not
   dq_pass_by_head_dim={256: {"dkdv_slicing": "grid"}})
BACKWARD_HEAD_DIMS = (64, 96, 128, 256)
# head_dims whose backward has run on the CPU alone (its program against float64, nvcc without spills):
# served only where TVMFLASH_GPU_UNCHECKED=1 asks until their GPU tests pass; none today
BACKWARD_UNCHECKED_HEAD_DIMS = ()


# The FP8 forward's knobs (``forward_fp8.schedule_fp8``), declared once as the other programs' are: the defaults
# by head_dim, and a small space that ``tvmflash tune --dtype float8_e4m3fn`` measures whole (``tune.measured``).
# Each K/V step's S takes block_n / 2 registers a thread and the output head_dim / 2 (float32); P in e4m3
# block_n / 8.
FP8_HEAD_DIMS = (64, 128, 256)
# built and checked on the CPU alone (the program against float64 through LLVM, nvcc without spills): served
# where TVMFLASH_GPU_UNCHECKED=1 asks until the GPU tests pass (tests/test_fp8.py)
FP8_UNCHECKED_HEAD_DIMS = FP8_HEAD_DIMS
FP8_DTYPE = "float8_e4m3fn"
FP8_BLOCK_NS = (32, 64, 96, 128, 160, 192, 224, 256)  # e4m3 wgmma's N: multiples of 32 (``fp8_problem``)


def fp8_rules(knobs: dict) -> str | None:
    """Why complete FP8 knobs do not go together, at any head_dim."""
    if knobs["num_warpgroups"] * WG_ROWS != knobs["block_m"]:
        return f"block_m ({knobs['block_m']}) must be 64 * num_warpgroups ({knobs['num_warpgroups']})"
    return None


def fp8_problem(head_dim: int, dtype: str, knobs: dict) -> str | None:
    """Why the FP8 forward does not build with these knobs, or None."""
    if dtype != FP8_DTYPE:
        return f"the sm90 FP8 forward takes {FP8_DTYPE}, got {dtype!r}"
    problem = fp8_rules(knobs)
    if problem:
        return problem
    if knobs["block_n"] % 32 or head_dim % 32:
        return f"e4m3 wgmma sums over 32 at a time: block_n and head_dim must be multiples of 32, got " \
               f"{knobs['block_n']} and {head_dim}"
    if knobs["kv_copy"] != "cp.async":
        return f"the sm90 FP8 forward copies its tiles by cp.async (no TMA yet), got kv_copy {knobs['kv_copy']!r}"
    if knobs["num_stages"] not in (1, 2, 3):
        return f"num_stages: expected 1, 2 or 3, got {knobs['num_stages']}"
    return register_problem(head_dim, knobs["block_n"], WARPGROUP * knobs["num_warpgroups"],
                            knobs["min_blocks_per_sm"])


def fp8_shared_memory_bytes(head_dim: int, dtype: str, knobs: dict) -> int:
    """The FP8 forward's shared memory: the Q tile and ``num_stages`` K and V tiles, one byte an element, each
    in core matrices of 128 bytes padded to 144 (``layouts.fp8_tile_in_shared_memory``)."""
    elements = (knobs["block_m"] + 2 * knobs["num_stages"] * knobs["block_n"]) * head_dim
    return elements * (FP8_CORE_MATRIX_ELEMENTS + FP8_CHUNK) // FP8_CORE_MATRIX_ELEMENTS


FP8_FORWARD = KnobSet("sm90", "FP8 forward", (
    Knob("block_m", 128, choices=(64, 128), space=(64, 128), role=TILE),
    Knob("num_warpgroups", 2, choices=(1, 2), space=lambda knobs: [knobs["block_m"] // WG_ROWS], role=DERIVED),
    Knob("block_n", 128, choices=FP8_BLOCK_NS, space=(64, 128), by_head_dim={256: 64}, role=TILE),
    # 3 stages spill at d64 and d128 (ptxas): the tuner builds them and counts the spill's time
    Knob("num_stages", 2, choices=(1, 2, 3), space=(2, 3), role=STRUCTURE),
    Knob("min_blocks_per_sm", 1, space=(1, 2, 3), by_head_dim={64: 2}, role=PROGRAM),
    Knob("kv_copy", "cp.async", choices=("cp.async",), role=STRUCTURE),
), rules=fp8_rules, build_problem=fp8_problem, shared_memory=fp8_shared_memory_bytes)

# Other FP8 knobs that ptxas builds without spills (3 stages spill at d64 and d128), for measuring against
# the defaults (benchmarks/fp8_bench.py) and checked on the GPU with them (tests/test_fp8.py).
FP8_VARIANTS = {
    64: {},
    # one block an SM at d128 (the default) runs its two warpgroups in step, a barrier a K/V step (cp.async): two
    # or three blocks of one or two warpgroups let one block's softmax run under another's wgmma
    128: {"bn64_mb2": {"block_n": 64, "min_blocks_per_sm": 2},
          "bm64_mb2": {"block_m": 64, "num_warpgroups": 1, "min_blocks_per_sm": 2},
          "bm64_bn64_mb3": {"block_m": 64, "num_warpgroups": 1, "block_n": 64, "min_blocks_per_sm": 3}},
    256: {"bn128": {"block_n": 128},
          "bm64_mb2": {"block_m": 64, "num_warpgroups": 1, "min_blocks_per_sm": 2}},
}
