"""sm90 (Hopper, sm_90a) schedule: QK^T and PV on ``wgmma.mma_async``.

On sm_90a it is the default, unless the tuning records say the sm80 schedule is faster for a
workload (``tvmflash.choice.choose_schedule``; ``TVMFLASH_SM90=1`` forces it, 0 turns it off).
Correct on the H200 (the GPU tests pass with it). BENCHMARKS.md has its H200 grids.

Mapping:
  * tile (b, h, qb) -> blockIdx.(z, y, x); ``num_warpgroups`` warpgroups (threadIdx.y) of 128
    threads (threadIdx.x). Warpgroup g owns rows [64 g, 64 g + 64) of the Q block, so
    block_m == 64 * num_warpgroups.
  * Q, K, V tiles live in dynamic shared memory, read by wgmma through matrix descriptors. Q is
    in the "interleaved" (no-swizzle) core-matrix layout (``_core_matrix_map``), core matrices
    16 bytes apart along a row (``_pad_core_matrix_stride``), or (``q_layout`` "swizzled") in the
    128-byte swizzled layout, as is the output's staging tile then; a swizzled Q tile may be
    copied by TMA (``q_copy``). K and V (``kv_layout``, default
    "swizzled") are in the 128-byte swizzled layout (``_swizzled_map``: 64-column halves of
    128-byte rows, 16-byte chunks permuted by row; at a head_dim that is no multiple of 64, d96, the
    64-byte swizzle: 32-column groups of 64-byte rows), or padded core matrices like Q. All are
    copied along the rows, 16 bytes a thread. The K/V tiles are loaded in a software pipeline
    (num_stages 2, the default, or 3), by TMA (``kv_copy`` "tma", the default: ``tvmflash.lowering.tma``
    turns the pipeline's copies into one thread's ``cp.async.bulk.tensor`` on the stage's
    mbarriers, and the K/V loop keeps no __syncthreads) or by every thread's cp.async ("cp.async":
    each step waits for its tile and syncs once, ``lowering.passes.OneBarrierPerPipelinedStep``),
    or plainly (num_stages 1). QK^T
    reads both operands through descriptors ("ss" form), K K-major; PV takes P from registers
    ("rs" form) and V through a descriptor, N-major (``imm-trans-b`` = 1), so V is never
    transposed.
  * qk: S = Q K^T: one tensor intrinsic per warpgroup and K/V tile covers the whole 64 x block_n
    x head_dim product: head_dim/16 ``wgmma.mma_async.m64n{block_n}k16`` in one commit group.
    S stays in the wgmma accumulator registers (``_acc_layout``).
  * The online softmax runs on the accumulator registers, all 128 threads of each warpgroup:
    the masked score, P and its fp16/bf16 cast keep the accumulator layout. Row max and row sum
    are quad-shuffle reductions (``common.row_reduce_intrin`` with ``acc_rows``, the same
    intrinsic the sm80 schedule uses on mma.sync fragments). With row_state "registers" (the
    default) the per-row values live in the registers of the quads that hold the rows, and the
    K/V step has only the barriers of the K/V tiles; "shared" keeps them in shared memory, one
    thread per row (about 5 more __syncthreads per tile).
  * producer (default "thread"): who issues the TMA copies, thread 0 of the first warpgroup or, as
    in FA3, a warpgroup of its own that gives its registers to the two consumer warpgroups
    (``tvmflash.lowering.tma``; one block an SM, 240 registers a consumer thread, room for block_n 128 at
    d128). Correct on the H200 but slower than the default there so far (H200, 2026-11-30, commit b2194be:
    0.93-0.95x at d128 non-causal, 0.83x causal; 2fccb1c, with q_layout "swizzled" and three
    stages of block_n 128: 0.86-0.92x non-causal, 0.75-0.82x causal); it is in the tuning space.
  * min_blocks_per_sm (default 2): ``__launch_bounds__(256, 2)``, so that two blocks share an SM
    (128 registers a thread; unbounded, d128 takes 137 and one block fills the SM). block_m 256
    (four warpgroups a K/V tile, one block an SM) is in the tuning space.
  * pv: acc += P V (``m64n{head_dim}k16``, block_n/16 of them). The accumulator layout of S is,
    per 16 columns, the A-register layout of the "rs" form, so the cast P is the A operand as it
    is (no shared memory round trip). The output accumulator stays in registers across all K/V
    tiles and is rescaled and stored from them. The rescale by alpha (pv's init) runs under a
    warp-wide test (``annotations.SKIP_UNIT_RESCALE_PRAGMA``), skipped where every row of the warp keeps
    its max: with the program's ``RESCALE_THRESHOLD`` that is most tiles after the first few (64 of a
    d128 K/V step's ~400 instructions; H200, 2026-12-01, commit 29a3231: +2-6% against cuDNN).

The backward (``schedule_backward``, the last section): dkdv and dq mapped as the forward, each
warpgroup 64 rows (keys in dkdv, queries in dq), s and dp in the "ss" form, the gradients' products in
the "rs" form from p or ds in the accumulator registers; by default (``dq_atomic``) dkdv also makes dq's
share on wgmma from dsᵀ staged in shared memory and adds it by vector atomics. The default backward on
sm_90a at head_dim 64 and 128 (``schedules.backward_for_target``).

Accumulator registers in TensorIR: a ``local`` buffer is per thread, and CompactBufferAllocation
only drops a thread dimension from it when each access names that thread; a tensorized block's
match_buffer covers all 128 threads, so the thread dimension would stay (a 128x larger array in
local memory). The accumulators are therefore laid out *per thread*: (row, col) -> (warpgroup,
register), dropping the thread index (``_acc_index_map``). That map is not injective, which is
sound only because every block that touches an accumulator is bound so that thread t touches
exactly its own elements (``_bind_acc_threads``), and the wgmma is warpgroup-collective.
"""

from __future__ import annotations

import tvm
from tvm.s_tir import TensorIntrin

from tvmflash.lowering.annotations import (ATOMIC_ADD_PRAGMA, NARROW_SWIZZLE_COLUMNS, REG_FENCE,
                                           SKIP_UNIT_RESCALE_PRAGMA, SWIZZLE_COLUMNS, TMA_BARRIER_BYTES,
                                           TMA_BARRIER_PADDINGS, TMA_LOAD, TMA_PRODUCERS, WGMMA_SWIZZLE_LAYOUTS,
                                           WGMMA_WAIT_PRAGMA, swizzle_columns)

from .common import (QuadRowLayout, bind_grid, buffer_info, dkdv_grid, hide_init_reads, pipeline_loads,
                     quad_row_block, quad_row_init, row_quad_map, row_reduce_intrin, staged_row_block,
                     tensorize_row_reduce)
from .sm80 import DTYPES, STRIDE_ALIGNMENT  # noqa: F401 - the same fp16/bf16 pair, 16-byte copies

WARPGROUP = 128
CORE_MATRIX_ELEMENTS = 64  # 8 rows x 16 bytes of 16-bit elements
PAD_ELEMENTS = 8  # 16 bytes after each core matrix along a row (``_pad_core_matrix_stride``)
WG_ROWS = 64  # rows of one wgmma (the M of m64nNk16)
WARPS_PER_WARPGROUP = 4
SWIZZLE_ALIGNMENT = 1024  # bytes: where a 128-byte-swizzled tile must start (``lowering.tma.check_tile_alignment``)

# The H200's fastest: 128-row blocks, two blocks an SM, the K/V tiles in the 128-byte swizzled layout
# loaded by TMA in two stages. d128 bf16 b4 s4096 (2026-11-30, commit fc1cf0d, one run): 586 TFLOP/s non-causal and
# 472 causal, against 553 and 447 with the same pipeline on cp.async (the default at 4f59a48), and 439
# and 378 with padded core matrices and plain loads (the default at cb572b6). 256-row blocks (4 warpgroups, one
# block an SM) and 128-key tiles at one block an SM measured slower. d64 takes 128-key tiles. With
# the rescale skip (29a3231) and hoisted causal test: 650 and 618 TFLOP/s (0.96x and 1.05x cuDNN).
# d96 (no multiple of 64) takes the same pipeline in the 64-byte swizzle: 1.37-1.45x its padded core
# matrices by cp.async (the default before f24148f), 1.02-1.04x cuDNN non-causal and 1.09-1.24x causal at
# 1k-8k tokens (H200, bf16, 2026-12-03, benchmarks/sm90_knobs.py 96). d32 keeps the padded core matrices.
KNOBS = {"block_m": 128, "block_n": 64, "num_warpgroups": 2, "num_stages": 2, "vec": 8, "min_blocks_per_sm": 2,
         "row_state": "registers", "kv_layout": "swizzled", "kv_copy": "tma", "producer": "thread",
         "q_layout": "core_matrices", "q_copy": "threads", "o_store": "staged", "overlap": 0}
KNOBS_FOR_HEAD_DIM = {64: {"block_n": 128}, 256: {"min_blocks_per_sm": 1},  # d256: 197 registers a thread
                      32: {"kv_layout": "core_matrices", "num_stages": 1, "kv_copy": "cp.async"}}
# head_dims that sm_90a serves with the sm80 schedule by default (tvmflash.choice.choose_schedule):
# at d32 each wgmma does too little to pay off. H200, bf16 (2026-11-30, commit fc1cf0d): sm80
# 214/228 TFLOP/s non-causal at 1k/4k tokens, 150/214 causal; sm90 168/190 and 114/148.
SM80_HEAD_DIMS = (32,)
# Where the per-row running values (m, l, ...) live, as in sm80: "registers", on the quads that hold
# the rows; "shared", one thread per row in shared memory (about 5 more barriers a K/V step).
ROW_STATES = ("registers", "shared")
# How the K/V tiles sit in shared memory: wgmma's "interleaved" core matrices, padded
# (``_pad_core_matrix_stride``), or the 128-byte swizzled layout (``_swizzled_map``), which TMA
# can write.
KV_LAYOUTS = ("core_matrices", "swizzled")
# How the Q tile and the output's staging tile sit in shared memory: padded core matrices and padded
# rows, or both in the 128-byte swizzled layout, unpadded (1/8 less memory: d128, block_m 128, 32 KiB
# each instead of 36 and 34), so that the output tile fits in the Q tile's memory.
Q_LAYOUTS = KV_LAYOUTS
# How the Q tile is copied: by every thread's loads and stores, or (with q_layout "swizzled" and TMA
# K/V tiles) by one TMA copy that the producer issues first thing, on a barrier of its own, as FA3
# does: the consumers wait for it instead of loading it. Correct on the H200, no faster (H200,
# commits cfedb6e and 0e948a5).
Q_COPIES = ("threads", "tma")
# How the output reaches global memory: "staged" through a shared-memory tile (16-byte stores along
# its rows, ``_store_o_through_shared_memory``), or "direct" from the accumulator registers, two
# adjacent columns a store, with no barrier (FA3 without its TMA store). Staging measured faster at
# two blocks an SM (2026-11-30, commit 4f59a48); "direct" is for one block an SM, where nothing hides the staging's
# barriers. Correct on the H200, no faster there (2026-11-30, commit cfedb6e).
O_STORES = ("staged", "direct")
# The knobs varlen (packed sequences, ``program.varlen_arguments``) takes: the output straight from the
# registers, each row's store predicated on the sequence's rows (the staging tile's copy-out takes its
# rows from the store's region, which TensorIR cannot bound with the offsets read from cu_seqlens:
# CompactBufferAllocation rejects it). The TMA copies read past a sequence's last key, which the mask
# hides (``tvmflash.lowering.tma``).
VARLEN_KNOBS = {"o_store": "direct"}
# overlap 1, FA3's intra-warpgroup order: the step of tile j issues PV of tile j - 1, then QK^T of tile
# j, and waits once for both; V keeps num_stages tiles and K one fewer (``common.pipeline_loads``'s
# ``lagged``). Needs TMA and 3 stages or more. Correct on the H200; with a producer warpgroup and 3
# stages of block_n 128, 0.84-0.91x cuDNN at d128 non-causal against the default's 0.81-0.90x in one
# run, slower at 1k tokens and causal (H200, 2026-12-01, commit 0e948a5).
OVERLAPS = (0, 1)
# How the pipelined K/V tiles are copied: every thread's cp.async, 16 bytes each, then a block-wide
# barrier a step; or TMA (``tvmflash.lowering.tma``): one thread issues each tile, completing on the stage's
# mbarrier, and no block-wide barrier is left in the K/V loop. TMA needs the swizzled layout.
KV_COPIES = ("cp.async", "tma")
# Who issues the TMA copies (``annotations.TMA_PRODUCERS``, lowered by ``tvmflash.lowering.tma``): thread 0 of the
# first warpgroup, between its own wgmma; or, as in FA3, a warpgroup of its own (threadIdx.y ==
# num_warpgroups), which gives its registers to the others (setmaxnreg: 240 a consumer thread), so one
# thread block fills the SM.
PRODUCERS = TMA_PRODUCERS
NUM_STAGES = (1, 2, 3)  # 1: plain loads; 2, 3: the K/V loads in a cp.async software pipeline (as sm80)
# min_blocks_per_sm > 1 asks ptxas (``__launch_bounds__``) for few enough registers that that many
# thread blocks share an SM: with 2 warpgroups, 128 registers a thread for 2 blocks. Without it the
# d128 build takes 137, which leaves one block (8 warps) per SM, and nothing runs while its
# warpgroups wait on wgmma, on loads or at the softmax's barriers.
# Tuning (``tvmflash tune``): min_blocks_per_sm is a function attribute of the program (``kernel_attrs``,
# __launch_bounds__), so each value is a task of its own, as each tile pair is. The structure knobs
# change which schedule steps run (strings and a stage count: MetaSchedule samples only ints into a
# trace), so each valid combination is a design space of its own inside the task (``valid_knobs``).
PROGRAM_KNOBS = ("min_blocks_per_sm",)
STRUCTURE_KNOBS = ("num_stages", "kv_layout", "kv_copy", "producer", "q_layout", "q_copy", "o_store", "overlap")
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
SPACE = {
    # block_m 256: four warpgroups (512 threads, at most 128 registers each) share each K/V tile
    # (the default, see KNOBS).
    "block_m": [64, 128, 256],
    "block_n": [64, 128],
    "num_warpgroups": lambda knobs: [knobs["block_m"] // WG_ROWS],
    "num_stages": [1, 2],
    "vec": [8],
    "min_blocks_per_sm": [1, 2],
    "row_state": ["registers"],
    "kv_layout": ["swizzled", "core_matrices"],
    "kv_copy": ["tma", "cp.async"],
    "producer": ["thread", "warpgroup"],
    "q_layout": ["core_matrices", "swizzled"],
    # q_copy "tma", o_store "direct" and overlap 1 (with 3 stages) are correct on the H200 but measured
    # no faster over the grid (H200, commits cfedb6e and 0e948a5); left out to keep the design spaces few
    "q_copy": ["threads"],
    "o_store": ["staged"],
    "overlap": [0],
}
# The values a knob may take, where not any positive int (``schedules.knob_problem``).
CHOICES = {"num_stages": NUM_STAGES, "row_state": ROW_STATES, "kv_layout": KV_LAYOUTS, "kv_copy": KV_COPIES,
           "producer": PRODUCERS, "q_layout": Q_LAYOUTS, "q_copy": Q_COPIES, "o_store": O_STORES, "overlap": OVERLAPS}


def _tma_can_copy(kv_layout: str, num_stages: int) -> bool:
    """TMA copies only swizzled tiles, and only in a pipeline (``tvmflash.lowering.tma`` lowers its stages)."""
    return kv_layout == "swizzled" and num_stages > 1


def _producer_problem(producer: str, kv_copy: str, min_blocks_per_sm: int, num_warpgroups: int) -> str | None:
    """Why this producer does not go with these knobs, or None."""
    if producer not in PRODUCERS:
        return f"producer: the sm90 schedule takes one of {PRODUCERS}, got {producer!r}"
    if producer == "warpgroup" and (kv_copy != "tma" or min_blocks_per_sm != 1 or num_warpgroups != 2):
        return (f"producer 'warpgroup' needs kv_copy 'tma', min_blocks_per_sm 1 and block_m 128 (two consumer "
                f"warpgroups take 240 registers a thread), got {kv_copy!r}, {min_blocks_per_sm} and "
                f"{WG_ROWS * num_warpgroups}")
    return None


def _overlap_problem(overlap: int, kv_copy: str, num_stages: int) -> str | None:
    """Why this overlap does not go with these knobs, or None."""
    if overlap not in OVERLAPS:
        return f"overlap: the sm90 schedule takes one of {OVERLAPS}, got {overlap!r}"
    if overlap and (kv_copy != "tma" or num_stages < 3):
        return f"overlap 1 needs kv_copy 'tma' and num_stages >= 3, got {kv_copy!r} and {num_stages}"
    return None


def _q_copy_problem(q_copy: str, q_layout: str, kv_copy: str) -> str | None:
    """Why this Q copy does not go with these knobs, or None."""
    if q_copy not in Q_COPIES:
        return f"q_copy: the sm90 schedule takes one of {Q_COPIES}, got {q_copy!r}"
    if q_copy == "tma" and (q_layout != "swizzled" or kv_copy != "tma"):
        return f"q_copy 'tma' needs q_layout 'swizzled' and kv_copy 'tma', got {q_layout!r} and {kv_copy!r}"
    return None


def valid_knobs(point: dict) -> bool:
    """Whether knobs go together (``tune.structures`` drops the other combinations)."""
    knobs = {**KNOBS, **point}
    if knobs["kv_copy"] == "tma" and not _tma_can_copy(knobs["kv_layout"], knobs["num_stages"]):
        return False
    if _q_copy_problem(knobs["q_copy"], knobs["q_layout"], knobs["kv_copy"]) or _overlap_problem(
            knobs["overlap"], knobs["kv_copy"], knobs["num_stages"]):
        return False
    return _producer_problem(knobs["producer"], knobs["kv_copy"], knobs["min_blocks_per_sm"],
                             knobs["block_m"] // WG_ROWS) is None


def knobs_problem(head_dim: int, dtype: str, knobs: dict) -> str | None:
    """Why a build with these knobs would fail, or None (the tuner's pre-check, ``tune.candidate_problem``;
    shared memory is checked there): knobs that do not go together, too few registers a thread, a
    swizzled layout at a head_dim that is no multiple of 32, and swizzled tiles off the 1024-byte
    boundary the swizzle needs (``tvmflash.lowering.tma.MisalignedTiles``)."""
    knobs = {**KNOBS, **knobs}
    if not valid_knobs(knobs):
        return "these knobs do not go together (sm90.valid_knobs)"
    registers = register_problem(head_dim, knobs["block_n"], WARPGROUP * knobs["block_m"] // WG_ROWS,
                                 knobs["min_blocks_per_sm"])
    if registers is not None:
        return registers
    swizzled = [name for name in ("kv_layout", "q_layout") if knobs[name] == "swizzled"]
    if swizzled and swizzle_columns(head_dim) is None:
        return f"{' and '.join(swizzled)} 'swizzled' needs a head_dim that is a multiple of {NARROW_SWIZZLE_COLUMNS}"
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
# of the score's element loops (``lowering.passes.HoistBlockIndexConditions``): without it each
# score of a causal K/V step kept a branch of its own. H200, causal, vs cuDNN: d128 0.87/0.94/0.94 ->
# 0.98/1.05/1.05 at 1k/4k/8k, d64 0.82/0.85/0.85 -> 1.05/1.13/1.13 (H200, 2026-12-01, commit 29a3231).
HOIST_BLOCK_INDEX_CONDITIONS = True


def min_kv_tiles(knobs: dict) -> int:
    """K/V tiles a Q block visits at the least (``schedules.program_for``): a TMA pipeline of s
    stages gets s - 1, so that the program's count is provably enough for the pipeline's epilogue
    to run unguarded (guarded, at 3 stages of block_n 128 its wgmma spilled: 255 registers, 0.45x
    the speed). A cp.async pipeline keeps 1: unguarded, its epilogue's wait counts are not constants."""
    return knobs["num_stages"] - 1 if knobs["kv_copy"] == "tma" and knobs["num_stages"] > 2 else 1


def kernel_attrs(knobs: dict) -> dict:
    """Function attributes for these knobs (``schedules.with_kernel_attrs``): min_blocks_per_sm
    as ``__launch_bounds__(threads, min_blocks_per_sm)``."""
    blocks = knobs.get("min_blocks_per_sm", 1)
    return {"tirx.launch_bounds_min_blocks_per_sm": blocks} if blocks > 1 else {}


def shared_memory_bytes(head_dim: int, dtype: str, knobs: dict) -> int:
    """Shared memory a build with these knobs needs: the Q tile (``q_layout``: wgmma core matrices
    padded by 16 bytes each, ``_pad_core_matrix_stride``, or swizzled, unpadded) and num_stages K/V
    tile pairs (``kv_layout``, the same choice), or the output's staging tile if that is larger
    (``_store_o_through_shared_memory``: it reuses their memory; with a producer warpgroup only the
    Q tile's, ``tvmflash.lowering.tma._split_warpgroups``), plus the per-row values staged in shared memory
    (row_state "shared": m_tile, l_tile, m_new, alpha, inv_l; "registers": m and l, for store_lse),
    and the mbarriers of TMA copies with their largest padding."""
    knobs = {**KNOBS, **knobs}  # a knob not given is the schedule's default
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


# --------------------------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------------------------
def _acc_layout(i, j):
    """(row, col) of a 64 x N wgmma accumulator -> (thread of the warpgroup, register).

    PTX ISA 9.7.15.5.1.1.1 (Figure "WGMMA .m64nNk16 register fragment layout for accumulator
    matrix D"; the same as CUTLASS's SM90 CLayout_64xN): warp w = t // 32 holds rows
    [16 w, 16 w + 16); within the warp the layout is mma.sync's m16n8 C fragment repeated
    along N every 8 columns:
        lane = t % 32, row = 16 w + lane // 4 + 8 * ((reg // 2) % 2),
        col = 8 * (reg // 4) + 2 * (lane % 4) + reg % 2.
    Registers d0..d{N/2-1}; d0, d1 are (row, 2q), (row, 2q+1); d2, d3 the same 8 rows lower.
    """
    thread = (i // 16) * 32 + (i % 8) * 4 + (j % 8) // 2
    reg = (j // 8) * 4 + ((i % 16) // 8) * 2 + j % 2
    return thread, reg


def _acc_matrix(thread, reg):
    """The inverse of _acc_layout: (thread, register) -> (row, col)."""
    row = (thread // 32) * 16 + ((reg // 2) % 2) * 8 + (thread % 32) // 4
    col = (reg // 4) * 8 + (thread % 4) * 2 + reg % 2
    return row, col


def _acc_index_map(i, j):
    """Accumulator buffer (rows, cols) -> per-thread registers (warpgroup, register).

    Not injective on purpose: see the module docstring."""
    return (i // WG_ROWS, _acc_layout(i % WG_ROWS, j)[1])


def acc_rows(n: int) -> QuadRowLayout:
    """One warpgroup's 64 x n accumulator, per thread (``_acc_index_map``: register r of the
    thread), for ``common.row_reduce_intrin``: mma.sync's m16n8 C fragment, warp w = t // 32 on
    rows [16 w, 16 w + 16), repeated along N. Thread t holds rows 16 (t // 32) + (t % 32) // 4
    (h = 0) and that + 8 (h = 1): one 16-row tile; of each 16 columns ct, its registers
    8 ct + 4 half + 2 h + e (columns 16 ct + 8 half + 2 (t % 4) + e)."""
    return QuadRowLayout(
        key=f"wgmma_acc_64x{n}", shape=(n // 2,), scope="local", n_rows=WG_ROWS, n_cols=n,
        threads=WARPGROUP, element=lambda i, j: (_acc_layout(i, j)[1],),
        row_tiles=1, col_tiles=n // 16,
        row=lambda t, k: 16 * (t // 32) + 8 * k + (t % 32) // 4,
        row_slot=lambda t, k: (2 * (t // 32) + k, (t % 32) // 4),
        held=lambda t, rt, h, ct, half, e: (8 * ct + 4 * half + 2 * h + e,),
        spread_stores=True,
    )


def _core_matrix_map(r, c):
    """Row-major (rows, cols) tile -> "interleaved" wgmma core matrices (r//8, c//8, r%8, c%8).

    A core matrix is 8 rows x 16 bytes, stored as 128 contiguous bytes. In PTX's canonical
    layouts (ISA 9.7.15.5.1.2.1.3, T = 8 elements of 16 bits):
      * K-major, no swizzle ((8,m),(T,2k)):((1T,SBO),(1,LBO)): rows are M/N, cols are K;
        SBO = stride of r//8, LBO = stride of c//8.
      * MN-major, no swizzle ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)): rows are K, cols are N;
        SBO = stride of c//8, LBO = stride of r//8.
    """
    return (r // 8, c // 8, r % 8, c % 8)


# --------------------------------------------------------------------------------------------
# wgmma tensor intrinsics
# --------------------------------------------------------------------------------------------
_PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}
# An empty asm that claims to modify a register: the compiler may not move reads of the
# accumulator across it (CUTLASS's warpgroup_fence_operand). TVM's own noop_barrier helper takes
# its operand by value, which fences a copy.
_REG_FENCE_U32 = (  # the same for the A registers of the "rs" form (bf16/fp16 pairs)
    "__device__ __forceinline__ void tvmflash_wgmma_reg_fence_u32(unsigned int& r) "
    '{ asm volatile("" : "+r"(r) :: "memory"); }'
)
# A wgmma matrix descriptor, as a value (PTX ISA "Matrix Descriptor Format"): start address, leading
# and stride byte offsets, each in 16-byte units, and the layout type in bits 62-63 (``NO_SWIZZLE``
# or a swizzle's, ``WGMMA_SWIZZLE_LAYOUTS``). TVM's encoder writes through a pointer into a local buffer, and
# InjectSoftwarePipeline (static shapes) splits such a buffer's allocation from its uses ("Buffer
# access occurs outside a statement scope"). The start comes as the buffer's own start (the same for
# every wgmma of a loop) plus the operand's offset in 16-byte units, which TIR folds to a constant and
# the stage's term: one uniform add a wgmma in the SASS. (A whole address shifted by 4 cost four:
# add, mask, shift, or; 18% of the K/V loop's instructions went to the uniform pipe.) Shared-window
# addresses are below 2^18, so the 14-bit start field needs no mask, and adding the fields is or-ing.
_DESCRIPTOR = (
    "__device__ __forceinline__ unsigned long long tvmflash_wgmma_descriptor(const void* buffer, int offset, int lbo,"
    " int sbo, int layout) {\n"
    "  unsigned start = ((unsigned)__cvta_generic_to_shared(buffer) >> 4) + (unsigned)offset;\n"
    "  return (unsigned long long)(start + ((unsigned)lbo << 16))"
    " | ((unsigned long long)((unsigned)sbo + ((unsigned)layout << 30)) << 32);\n"
    "}"
)
# The 128-byte swizzled layout (PTX's canonical K-major / MN-major "128B swizzle" layouts, and what
# TMA writes with CU_TENSOR_MAP_SWIZZLE_128B): a tile is cut into halves of 64 columns (128 bytes of
# 16-bit elements); each half is row-major, a row 128 bytes, and the 16-byte chunk c of row r sits at
# chunk c ^ (r % 8). The descriptor says so with layout type 1; the tile must start on a 1024-byte
# boundary (8 rows, where the pattern repeats).
# The 64-byte swizzle (a head_dim that is no multiple of 64: ``annotations.swizzle_columns``) is the
# same with groups of 32 columns, a row 64 bytes, chunk c of row r at c ^ (r // 2 % 4), layout type 2,
# the pattern repeating every 512 bytes.
NO_SWIZZLE = 0  # the layout type of padded core matrices; the swizzles' are WGMMA_SWIZZLE_LAYOUTS


def _xor(a, b, bits):
    """a ^ b for a, b in [0, 2 ** bits), in floordiv/floormod arithmetic that TVM's analyzer can bound
    (transform_layout computes the new buffer's shape from it)."""
    return sum(((a // m % 2 + b // m % 2) % 2) * m for m in (1, 2, 4)[:bits])


def _swizzled_map(r, c, columns=SWIZZLE_COLUMNS):
    """Row-major (rows, cols) tile -> the swizzled layout of rows of ``columns`` elements (group, r,
    chunk, element): 128-byte (64 columns) or 64-byte (32)."""
    chunks = columns // 8
    phase = r % 8 if chunks == 8 else r % 8 // (8 // chunks)  # the 128-byte line within 8 rows of 128 bytes
    return (c // columns, r, _xor(c % columns // 8, phase, chunks.bit_length() - 1), c % 8)


def wgmma_intrin_name(n: int, k: int, dtype: str, b_major: str, a_regs: bool = False,
                      fence_operands: bool = True, b_swizzled: bool = False, a_swizzled: bool = False,
                      wait: bool = True, a_major: str = "k", swizzle: int = SWIZZLE_COLUMNS) -> str:
    """Register (once) and name the intrinsic for a 64 x n x k GEMM on wgmma.

    A (64 x k) is a K-major shared-memory tile in ``_core_matrix_map`` layout, or with
    ``a_regs`` per-thread registers in the accumulator layout (``_acc_index_map`` with N = k: the
    "rs" form of wgmma, whose A fragment for each k16 slice is the 64 x 16 accumulator layout,
    CUTLASS's SM90 ALayout_64x16). B is a shared-memory tile, K-major (an n x k tile,
    ``b_major="k"``: S = Q K^T) or N-major (a k x n tile, ``b_major="mn"``: O += P V). C is the
    float32 accumulator, per thread (``_acc_index_map``). b_swizzled, a_swizzled: the shared-memory
    tile is in the swizzled layout (``_swizzled_map``; rows of ``swizzle`` columns, 64: 128-byte, 32:
    64-byte) instead of core matrices. a_major
    "mn": A is a k x 64 shared-memory tile in core matrices, read transposed (``imm-trans-a``; the
    backward's dsᵀ as the A of ds k).

    wait: end with ``wgmma.wait_group 0`` (the result is ready when the intrinsic ends), or only
    commit the group (overlap: a later wait, of the next GEMM or before the result is read, ends it).

    fence_operands ("ss" form only): begin with ``fence.proxy.async`` and a barrier, so that the
    threads' shared-memory writes are visible to wgmma. Off where the caller's code already does
    both before it (the cp.async pipeline's wait, ``lowering.tvm_fixes.ConstantAsyncWaitCounts``,
    at the top of the K/V step: ``lowering.passes.OneBarrierPerPipelinedStep``).
    """
    name = f"tvmflash_wgmma_m64n{n}k{k}_{_PTX_TYPE[dtype]}_{'r' if a_regs else 's'}_b{b_major}"
    if b_swizzled:
        name += f"_sw{2 * swizzle}"
    if a_swizzled:
        name += f"_asw{2 * swizzle}"
    if a_major == "mn":
        name += "_amn"
    if not wait:
        name += "_nowait"
    if not a_regs and not fence_operands:
        name += "_unfenced"
    try:
        TensorIntrin.get(name)
    except Exception:  # noqa: BLE001 - not registered yet
        TensorIntrin.register(name, *_wgmma_desc_impl(n, k, dtype, b_major, a_regs, fence_operands, b_swizzled,
                                                        a_swizzled, wait, a_major, swizzle))
    return name


def _wgmma_desc_impl(n, k, dtype, b_major, a_regs, fence_operands=True, b_swizzled=False, a_swizzled=False,
                     wait=True, a_major="k", swizzle=SWIZZLE_COLUMNS):
    from tvm.script import tirx as T

    if n % 8 or not 8 <= n <= 256 or k % 16:
        raise ValueError(f"wgmma: n must be a multiple of 8 in [8, 256] and k of 16, got n={n}, k={k}")
    nr = n // 2  # accumulator registers per thread
    w, chunks, layout = swizzle, swizzle // 8, WGMMA_SWIZZLE_LAYOUTS[swizzle]
    a_shape = (k // 2,) if a_regs else (k // w, 64, chunks, 8) if a_swizzled else (8, k // 8, 8, 8)
    if a_major == "mn":  # a k x 64 tile, core matrices (_core_matrix_map)
        assert not (a_regs or a_swizzled), "an M-major A is a shared-memory tile in core matrices"
        a_shape = (k // 8, 8, 8, 8)
    a_scope = "local" if a_regs else "shared.dyn"
    a_whole = tuple(slice(0, e) for e in a_shape)
    b_shape = (n // 8, k // 8, 8, 8) if b_major == "k" else (k // 8, n // 8, 8, 8)
    if b_swizzled:  # _swizzled_map's (column group, row, chunk, element) of the k x n (K) or n x k (V) tile
        b_shape = (k // w, n, chunks, 8) if b_major == "k" else (n // w, k, chunks, 8)
    trans_a, trans_b = (0 if major == "k" else 1 for major in (a_major, b_major))
    ptx = _PTX_TYPE[dtype]
    shape = f"m64n{n}k16"
    mma = getattr(getattr(T.ptx.wgmma.mma_async.sync.aligned, shape).f32, ptx)
    mma = getattr(mma, ptx)

    def a_at(A, vi, vk):
        if a_regs:
            return A[_acc_layout(vi, vk)[1]]
        if a_swizzled:  # K-major, as K in b_at
            return A[_swizzled_map(vi, vk, w)]
        if a_major == "mn":
            return A[vk // 8, vi // 8, vk % 8, vi % 8]
        return A[vi // 8, vk // 8, vi % 8, vk % 8]

    def b_at(B, vj, vk):
        if b_swizzled:
            return B[_swizzled_map(vj, vk, w)] if b_major == "k" else B[_swizzled_map(vk, vj, w)]
        if b_major == "k":
            return B[vj // 8, vk // 8, vj % 8, vk % 8]
        return B[vk // 8, vj // 8, vk % 8, vj % 8]

    def acc_reg(vi, vj):
        return _acc_layout(vi, vj)[1]

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle):
        A = T.match_buffer(a, a_shape, dtype, offset_factor=1, scope=a_scope)
        B = T.match_buffer(b, b_shape, dtype, offset_factor=1, scope="shared.dyn")
        C = T.match_buffer(c, (nr,), "float32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:nr], A[a_whole], B[0 : b_shape[0], 0 : b_shape[1], 0 : b_shape[2], 0:8])
            T.writes(C[0:nr])
            for i, j, kk in T.grid(64, n, k):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                    C[acc_reg(vi, vj)] = C[acc_reg(vi, vj)] + T.cast(a_at(A, vi, vk), "float32") * T.cast(
                        b_at(B, vj, vk), "float32")

    def _descriptor(X, offset, lbo, sbo, layout=NO_SWIZZLE):
        # X's start and the operand's offset in 16-byte units (8 two-byte elements; always whole)
        start = X.access_ptr("r", offset=-X.elem_offset)
        return T.cuda.func_call("tvmflash_wgmma_descriptor", start, T.floordiv(X.elem_offset + offset, 8), lbo, sbo,
                                layout, source_code=_DESCRIPTOR, return_type="uint64")

    def k_major_swizzled(X, s0, s1, ks):
        # s0: a column group's stride, s1: a row's (w elements, 2 w bytes); a k16 slice starts 32
        # bytes into the rows of its group; LBO unused; SBO: 8 rows, 16 w bytes (8 s1 * 2 / 16 = s1 units)
        return _descriptor(X, (ks * 16) // w * s0 + ks * 16 % w, 1, s1, layout)

    def a_descriptor(A, sa0, sa1, ks):
        if a_swizzled:
            return k_major_swizzled(A, sa0, sa1, ks)
        if a_major == "mn":  # as an N-major B: LBO = K-direction (r//8) stride, SBO = M-direction
            return _descriptor(A, ks * 2 * sa0, sa0 // 8, sa1 // 8)
        # K-major: LBO = K-direction core-matrix stride, SBO = M-direction.
        return _descriptor(A, ks * 2 * sa1, sa1 // 8, sa0 // 8)

    def b_descriptor(B, sb0, sb1, ks):
        # Descriptor fields are in 16-byte units; 2-byte elements.
        if b_swizzled:  # sb0: a column group's stride, sb1: a row's (w elements)
            if b_major == "k":
                return k_major_swizzled(B, sb0, sb1, ks)
            # N-major: a k16 slice is 16 rows; LBO: from one column group to the next
            return _descriptor(B, ks * 16 * sb1, sb0 // 8, sb1, layout)
        if b_major == "k":  # K-major: LBO = K-direction core-matrix stride, SBO = N-direction
            return _descriptor(B, ks * 2 * sb1, sb1 // 8, sb0 // 8)
        # N-major: LBO = K-direction (r//8) stride, SBO = N-direction (c//8).
        return _descriptor(B, ks * 2 * sb0, sb0 // 8, sb1 // 8)

    if fence_operands:
        @T.macro
        def shared_operands_visible():
            # Shared memory written by threads (generic proxy) -> read by wgmma (async proxy). Only
            # the "ss" form (S = Q K^T) does this: the "rs" form's B tile (V) is written with K's,
            # before it.
            T.ptx.fence.proxy.async_.shared__cta()
            T.tvm_storage_sync("shared")
    else:
        @T.macro
        def shared_operands_visible():
            T.evaluate(0)

    @T.macro
    def wgmma_begin(C):
        for r in T.unroll(nr):
            T.cuda.func_call("tvmflash_wgmma_reg_fence", C[r], source_code=REG_FENCE)

    if wait:
        @T.macro
        def wgmma_end(C):  # one commit group, waited for at once
            T.ptx.wgmma.commit_group.sync.aligned()
            T.ptx.wgmma.wait_group.sync.aligned(0)
            for r in T.unroll(nr):
                T.cuda.func_call("tvmflash_wgmma_reg_fence", C[r], source_code=REG_FENCE)
    else:
        @T.macro
        def wgmma_end(C):  # C is still being written: no fence on it until a wait
            T.ptx.wgmma.commit_group.sync.aligned()

    @T.prim_func(s_tir=True)
    def impl_ss(a: T.handle, b: T.handle, c: T.handle):
        sa0 = T.int32()
        sa1 = T.int32()
        sb0 = T.int32()
        sb1 = T.int32()
        A = T.match_buffer(a, a_shape, dtype, offset_factor=1, scope="shared.dyn", strides=[sa0, sa1, 8, 1])
        B = T.match_buffer(b, b_shape, dtype, offset_factor=1, scope="shared.dyn", strides=[sb0, sb1, 8, 1])
        C = T.match_buffer(c, (nr,), "float32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:nr], A[a_whole], B[0 : b_shape[0], 0 : b_shape[1], 0 : b_shape[2], 0:8])
            T.writes(C[0:nr])
            for tx in T.thread_binding(WARPGROUP, thread="threadIdx.x"):
                shared_operands_visible()
                wgmma_begin(C)
                T.ptx.wgmma.fence.sync.aligned()
                for ks in T.unroll(k // 16):
                    mma(*[C[r] for r in range(nr)], a_descriptor(A, sa0, sa1, ks), b_descriptor(B, sb0, sb1, ks),
                        T.bool(True), 1, 1, trans_a, trans_b)
                wgmma_end(C)

    @T.prim_func(s_tir=True)
    def impl_rs(a: T.handle, b: T.handle, c: T.handle):
        sb0 = T.int32()
        sb1 = T.int32()
        A = T.match_buffer(a, a_shape, dtype, offset_factor=2, scope="local")
        B = T.match_buffer(b, b_shape, dtype, offset_factor=1, scope="shared.dyn", strides=[sb0, sb1, 8, 1])
        C = T.match_buffer(c, (nr,), "float32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:nr], A[a_whole], B[0 : b_shape[0], 0 : b_shape[1], 0 : b_shape[2], 0:8])
            T.writes(C[0:nr])
            for tx in T.thread_binding(WARPGROUP, thread="threadIdx.x"):
                # A's registers as 32-bit pairs: register 4 ks + r of the k16 slice ks is the pair
                # (8 ks + 2 r, 8 ks + 2 r + 1) of the accumulator layout, low half first. (A's
                # offset in its buffer is even: offset_factor=2.)
                A32 = T.decl_buffer((k // 4,), "uint32", data=A.data, elem_offset=A.elem_offset // 2, scope="local")
                wgmma_begin(C)
                for r in T.unroll(k // 4):
                    T.cuda.func_call("tvmflash_wgmma_reg_fence_u32", A32[r], source_code=_REG_FENCE_U32)
                T.ptx.wgmma.fence.sync.aligned()
                for ks in T.unroll(k // 16):
                    mma(*[C[r] for r in range(nr)], A32[4 * ks], A32[4 * ks + 1], A32[4 * ks + 2],
                        A32[4 * ks + 3], b_descriptor(B, sb0, sb1, ks), T.bool(True), 1, 1, trans_b)
                wgmma_end(C)

    return desc, (impl_rs if a_regs else impl_ss)


# --------------------------------------------------------------------------------------------
# schedule helpers
# --------------------------------------------------------------------------------------------
def _bind_acc_threads(sch, block):
    """Bind the last two loops of ``block`` (64 rows, N cols of one warpgroup's accumulator)
    so that thread t runs exactly the (row, col) it holds (``_acc_layout``):
    rows = (warp 4, half 2, r8 8), cols = (c8 N/8, quad 4, pair 2), t = 32 warp + 4 r8 + quad."""
    i, j = sch.get_loops(block)[-2:]
    warp, half, r8 = sch.split(i, [4, 2, 8])
    c8, quad, pair = sch.split(j, [None, 4, 2])
    sch.reorder(warp, r8, quad, c8, half, pair)
    sch.bind(sch.fuse(warp, r8, quad), "threadIdx.x")
    sch.unroll(c8)
    sch.unroll(half)
    sch.unroll(pair)


def _split_warpgroups(sch, loop, num_warpgroups):
    """Split a loop over block_m rows into (warpgroup -> threadIdx.y, 64 rows)."""
    wg, rows = sch.split(loop, [num_warpgroups, WG_ROWS])
    sch.bind(wg, "threadIdx.y")
    return rows


def _acc_block(sch, name, num_warpgroups):
    """A block over (block_m rows, N cols) of an accumulator, run by the threads that hold them."""
    i = sch.get_loops(name)[-2]
    _split_warpgroups(sch, i, num_warpgroups)
    _bind_acc_threads(sch, name)


def _row_block(sch, name, num_warpgroups):
    """Per-row block: row 64 g + r is run by thread r of warpgroup g (threads 64..127 idle)."""
    i = sch.get_loops(name)[0]
    rows = _split_warpgroups(sch, i, num_warpgroups)
    _, tx = sch.split(rows, [None, WARPGROUP])  # 64 rows on 128 threads: a predicate
    sch.bind(tx, "threadIdx.x")


def _copy_along_rows(sch, block, num_warpgroups, vec):
    """Global -> shared copy of a tile, 16 bytes a thread, threads along the rows: each 8 threads
    (one phase of a 16-byte access) copy 128 contiguous bytes of a row, so every 32-byte sector
    they read is whole. In shared memory those 8 pieces land on 8 different groups of 4 banks:
    one per core matrix, spread by ``_pad_core_matrix_stride``, or 8 chunks of one swizzled row
    (``_swizzled_map``)."""
    r, c = sch.get_loops(block)[-2:]
    c_hi, v = sch.split(c, [None, vec])
    fused = sch.fuse(r, c_hi)
    _, ty, tx = sch.split(fused, [None, num_warpgroups, WARPGROUP])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(v)


def _pad_core_matrix_stride(sch, block):
    """Core matrices along a row 144 bytes apart instead of 128 (16 bytes of padding each): the
    8 pieces of 16 bytes that 8 threads copy from one row (``_copy_along_rows``) then land
    in 8 different groups of 4 banks. Unpadded they all hit the same 4 banks, and in the
    copy-friendly order before (8 rows of one core matrix) each phase read 8 half-used sectors:
    on the H200 the cp.async tile copies moved twice the L2 sectors and 8x the shared-memory
    wavefronts they need (ncu, 2026-11-30, commit cb572b6). The stride is the descriptor's LBO (K-major: Q, K) or
    SBO (N-major: V), read from the buffer, so wgmma follows; a core matrix stays 128 contiguous
    bytes. Costs 1/8 more shared memory (``shared_memory_bytes``)."""
    sch.storage_align(block, 0, axis=1, factor=CORE_MATRIX_ELEMENTS, offset=PAD_ELEMENTS)


def _tile_in_shared_memory(sch, name, num_warpgroups, vec, swizzled, columns=SWIZZLE_COLUMNS):
    """The tile that block ``name`` writes, in dynamic shared memory as wgmma reads it: swizzled in rows
    of ``columns`` (``_swizzled_map``, as TMA writes it) or in padded core matrices; copied along its rows."""
    sch.set_scope(name, 0, "shared.dyn")
    if swizzled:
        sch.transform_layout(name, ("write", 0), lambda r, c: _swizzled_map(r, c, columns),
                             assume_injective_transform=True)
    else:
        sch.transform_layout(name, ("write", 0), _core_matrix_map)
        _pad_core_matrix_stride(sch, name)
    _copy_along_rows(sch, name, num_warpgroups, vec)


def _store_o_through_shared_memory(sch, head_dim, num_warpgroups, vec, swizzled, columns=SWIZZLE_COLUMNS):
    """The output goes to global memory through shared memory: the accumulator threads write their
    pairs of adjacent columns (one 32-bit store each) into a row-major tile whose rows are padded
    by 16 bytes (so the 8 rows a warp writes at once hit different banks), then all threads copy
    the tile out along its rows, 16 bytes each. Straight from the accumulator layout it was 2-byte
    stores, each warp's touching 8 sectors for 64 bytes. The tile reuses the K/V and Q tiles'
    shared memory (dead by then). H200, d128 bf16, 128-row blocks: 0.421 -> 0.361 ms at 1k
    tokens non-causal, 0.864 -> 0.819 ms at 4k causal (H200, 2026-11-30, commit 4f59a48). ``swizzled``
    (q_layout "swizzled"): the tile is in the Q tile's swizzled layout instead, as large as the Q
    tile and as free of bank conflicts (the 8 rows a warp writes at once land in 8 different
    16-byte chunks)."""
    _acc_block(sch, "store_o", num_warpgroups)
    sch.vectorize(sch.get_loops("store_o")[-1])  # a thread's two adjacent columns
    copy = sch.cache_write("store_o", 0, "shared.dyn")
    if swizzled:  # the tile is (1, block_m, 1, head_dim), a slice of O
        sch.transform_layout("store_o", ("write", 0), lambda b, r, h, c: _swizzled_map(r, c, columns),
                             assume_injective_transform=True)
    else:  # axis 2's stride is the row stride
        sch.storage_align("store_o", 0, axis=2, factor=head_dim, offset=PAD_ELEMENTS)
    # Its rows: those of the sequence (a symbolic count, at most block_m); 16 bytes a thread.
    b, r, h, c = sch.get_loops(copy)[-4:]
    c_hi, v = sch.split(c, [None, vec])
    _, ty, tx = sch.split(sch.fuse(b, r, h, c_hi), [None, num_warpgroups, WARPGROUP])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(v)


def _warpgroup_gemm(sch, name, num_warpgroups):
    """Prepare a GEMM block (loops: block_m rows, cols, reduction) for one wgmma intrinsic per
    warpgroup: rows split over warpgroups, the init (decompose_reduction) run by the threads that
    hold the accumulator. Returns the loop to tensorize."""
    i = sch.get_loops(name)[-3]
    rows = _split_warpgroups(sch, i, num_warpgroups)
    init = sch.decompose_reduction(name, rows)
    _bind_acc_threads(sch, init)
    return rows


def _row_state_in_registers(sch, BN, num_warpgroups):
    """row_state "registers" (FA2's way, as sm80's): the per-row values (m, l, m_tile, m_new,
    alpha, l_tile, l_new, l_inv) in the registers of the quads that hold the rows, each lane a
    copy (``common.row_quad_map``); row max and row sum fold into them (quad mode of
    ``common.row_reduce_intrin``), the per-row blocks run on the quads (``common.quad_row_block``),
    and the K/V step has no barrier but those of the K/V tiles. store_lse reads the values back
    through shared memory once, after the loop (``common.staged_row_block``)."""
    per_row = (("init_ml", 0), ("init_ml", 1), ("row_max", 0), ("alpha", 0), ("alpha", 1), ("row_sum", 0),
               ("merge_l", 0), ("inv_l", 0))  # m, l, m_tile, m_new, alpha, l_tile, l_new, l_inv
    for name, idx in per_row:
        sch.set_scope(name, idx, "local")
        sch.transform_layout(name, ("write", idx), row_quad_map)
    for name, op in (("row_max", "max"), ("row_sum", "sum")):
        tensorize_row_reduce(sch, name, row_reduce_intrin(op, acc_rows(BN), "local"), num_warpgroups, WARPGROUP,
                             quad_row_init(sch, WARPS_PER_WARPGROUP))
    _acc_block(sch, "cast_p", num_warpgroups)
    for name in ("init_ml", "alpha", "merge_l", "update_ml", "inv_l"):
        quad_row_block(sch, name, num_warpgroups, WARPS_PER_WARPGROUP)
    staged_row_block(sch, "store_lse", num_warpgroups, lambda sch, name: _row_block(sch, name, num_warpgroups),
                     WARPS_PER_WARPGROUP)


def _row_state_in_shared_memory(sch, BN, num_warpgroups):
    """row_state "shared": row max and row sum are quad-shuffle reductions into per-row values in
    shared memory (m_tile, l_tile); the per-row blocks run one thread per row (thread r of the
    warpgroup, r < 64), and what the accumulator threads read back by row (m_new in exp, alpha in
    pv_init, l_inv in store_o) is in shared memory. About 5 __syncthreads a K/V step."""
    # m_tile and l_tile in static shared memory, m_new and alpha in dynamic: ThreadSync plans each
    # scope on its own, and for "shared.dyn" it takes every access as one buffer's (the pool the
    # buffers are merged into) and trusts two accesses to be the same thread's only when their
    # index names the innermost thread variable (threadIdx.y here; the row is 64 threadIdx.y +
    # threadIdx.x, bound to a let by CSE). Were m_tile dynamic too, block ``alpha``'s read of it
    # after its store of m_new (one row thread, under ``threadIdx.x < 64``) would need a barrier
    # inside that guard: "Cannot insert syncs inside condition".
    for name, idx in (("row_max", 0), ("row_sum", 0)):  # m_tile, l_tile
        sch.set_scope(name, idx, "shared")
    for name, idx in (("alpha", 0), ("alpha", 1)):  # m_new, alpha
        sch.set_scope(name, idx, "shared.dyn")
    for name, op in (("row_max", "max"), ("row_sum", "sum")):
        tensorize_row_reduce(sch, name, row_reduce_intrin(op, acc_rows(BN), "shared"), num_warpgroups, WARPGROUP)
    _acc_block(sch, "cast_p", num_warpgroups)
    # The running sum l stays in its row's register. store_o, run by the accumulator threads, reads
    # its inverse (inv_l, one row thread each, after the last K/V tile) from shared memory.
    sch.set_scope("inv_l", 0, "shared.dyn")
    for name in ("init_ml", "alpha", "merge_l", "update_ml", "inv_l", "store_lse"):
        _row_block(sch, name, num_warpgroups)
    for name, idx in (("init_ml", 0), ("init_ml", 1), ("merge_l", 0)):  # m, l, l_new: per-row blocks only
        sch.set_scope(name, idx, "local")


# --------------------------------------------------------------------------------------------
def schedule(
    sch: tvm.s_tir.Schedule,
    *,
    block_m: int,
    block_n: int,
    num_warpgroups: int,
    vec: int,
    num_stages: int = 2,
    min_blocks_per_sm: int = 2,
    row_state: str = "registers",
    kv_layout: str = "swizzled",
    kv_copy: str = "tma",
    producer: str = "thread",
    q_layout: str = "core_matrices",
    q_copy: str = "threads",
    o_store: str = "staged",
    overlap: int = 0,
) -> tvm.s_tir.Schedule:
    """Map the attention program onto sm90 wgmma. See the module docstring. (min_blocks_per_sm
    is a kernel attribute, ``kernel_attrs``: the caller puts it on the program.)"""
    dtype, BM, D, BN = buffer_info(sch)
    assert (BM, BN) == (block_m, block_n), "schedule knobs must match the program's tiles"
    if block_m != WG_ROWS * num_warpgroups:
        raise ValueError(f"block_m: the sm90 schedule gives each warpgroup 64 rows, so block_m must be "
                         f"64 * num_warpgroups = {WG_ROWS * num_warpgroups}, got {block_m}")
    if block_n % 16 or block_n > 256 or D % 16:
        raise ValueError(f"block_n and head_dim: expected multiples of 16 (block_n <= 256), got {block_n} and {D}")
    if not isinstance(num_stages, int) or num_stages not in NUM_STAGES:
        raise ValueError(f"num_stages: the sm90 schedule takes one of {NUM_STAGES}, got {num_stages!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: the sm90 schedule takes {DTYPES}, got {dtype!r}")
    if row_state not in ROW_STATES:
        raise ValueError(f"row_state: the sm90 schedule takes one of {ROW_STATES}, got {row_state!r}")
    if not isinstance(min_blocks_per_sm, int) or min_blocks_per_sm < 1:
        raise ValueError(f"min_blocks_per_sm: expected a positive int, got {min_blocks_per_sm!r}")
    registers = register_problem(D, block_n, WARPGROUP * num_warpgroups, min_blocks_per_sm)
    if registers is not None:
        raise ValueError(f"min_blocks_per_sm: {registers}")
    # With the K/V loads pipelined, each K/V step opens with its tile's cp.async wait,
    # fence.proxy.async and a barrier (covering Q's stores too): the intrinsic's own would be a
    # second barrier a K/V step.
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: the sm90 schedule takes one of {KV_LAYOUTS}, got {kv_layout!r}")
    swizzled = kv_layout == "swizzled"
    columns = swizzle_columns(D)  # 64 (the 128-byte swizzle) or, at d96, 32 (64-byte)
    if swizzled and columns is None:
        raise ValueError(f"kv_layout: 'swizzled' needs a head_dim that is a multiple of {NARROW_SWIZZLE_COLUMNS}, "
                         f"got {D}")
    if o_store not in O_STORES:
        raise ValueError(f"o_store: the sm90 schedule takes one of {O_STORES}, got {o_store!r}")
    if q_layout not in Q_LAYOUTS:
        raise ValueError(f"q_layout: the sm90 schedule takes one of {Q_LAYOUTS}, got {q_layout!r}")
    q_swizzled = q_layout == "swizzled"
    if q_swizzled and columns is None:
        raise ValueError(f"q_layout: 'swizzled' needs a head_dim that is a multiple of {NARROW_SWIZZLE_COLUMNS}, "
                         f"got {D}")
    if kv_copy not in KV_COPIES:
        raise ValueError(f"kv_copy: the sm90 schedule takes one of {KV_COPIES}, got {kv_copy!r}")
    if kv_copy == "tma" and not _tma_can_copy(kv_layout, num_stages):
        raise ValueError(f"kv_copy 'tma' needs kv_layout 'swizzled' and num_stages >= 2, got {kv_layout!r} and "
                         f"{num_stages}: pass kv_copy='cp.async' with these")
    problem = (_producer_problem(producer, kv_copy, min_blocks_per_sm, num_warpgroups)
               or _q_copy_problem(q_copy, q_layout, kv_copy) or _overlap_problem(overlap, kv_copy, num_stages))
    if problem:
        raise ValueError(problem)
    qk_intrin = wgmma_intrin_name(BN, D, dtype, "k", fence_operands=num_stages == 1, b_swizzled=swizzled,
                                  a_swizzled=q_swizzled, swizzle=columns)
    pv_intrin = wgmma_intrin_name(D, BN, dtype, "mn", a_regs=True, b_swizzled=swizzled, wait=not overlap,
                                  swizzle=columns)

    # ---- grid -----------------------------------------------------------------------------
    bind_grid(sch)

    # ---- Q, K, V tiles into shared memory, as q_layout and kv_layout say ----------------------
    for name in ("load_q", "load_k", "load_v"):
        _tile_in_shared_memory(sch, name, num_warpgroups, vec, q_swizzled if name == "load_q" else swizzled, columns)
        if (q_copy if name == "load_q" else kv_copy) == "tma":  # lowered to one thread's TMA copy (tvmflash.lowering.tma)
            sch.annotate(sch.get_sblock(name), TMA_LOAD, producer)

    # ---- qk: S = Q K^T on wgmma, S in accumulator registers --------------------------------
    sch.set_scope("qk", 0, "local")
    sch.transform_layout("qk", ("write", 0), _acc_index_map)
    rows = _warpgroup_gemm(sch, "qk", num_warpgroups)
    sch.tensorize(rows, qk_intrin)

    # ---- P (the A operand of pv) stays in registers ---------------------------------------
    # The accumulator layout of S (64 x block_n) is, per 16 columns, the A-fragment layout of
    # wgmma's register ("rs") form, so Pc, cast in place, is pv's A operand as it is.
    sch.set_scope("cast_p", 0, "local")
    sch.transform_layout("cast_p", ("write", 0), _acc_index_map)

    # ---- pv: acc += P V on wgmma, acc in registers across K/V tiles ------------------------
    sch.set_scope("pv", 0, "local")
    sch.transform_layout("pv", ("write", 0), _acc_index_map)
    pv = sch.get_sblock("pv")
    rows = _warpgroup_gemm(sch, pv, num_warpgroups)  # pv_init: the rescale acc *= alpha
    # decompose_reduction leaves the init's read of alpha on the update block; drop it so the
    # update matches the intrinsic's description (reads C, A, B only).
    hide_init_reads(sch, pv)
    if row_state == "registers":  # alpha in each thread's registers: skip the rescale where it is 1
        sch.annotate(sch.get_loops("pv_init")[-3], SKIP_UNIT_RESCALE_PRAGMA, 1)  # its first per-thread loop
    sch.tensorize(rows, pv_intrin)

    _acc_block(sch, "init_acc", num_warpgroups)
    if o_store == "staged":
        _store_o_through_shared_memory(sch, D, num_warpgroups, vec, q_swizzled, columns)
    else:  # each thread stores the pairs of adjacent columns it holds
        _acc_block(sch, "store_o", num_warpgroups)
        sch.vectorize(sch.get_loops("store_o")[-1])

    # ---- softmax on the accumulator registers -------------------------------------------
    # S, the masked score and P keep the accumulator layout, and each thread works on the
    # elements it holds (all 128 threads of the warpgroup).
    for name in ("score", "exp"):
        sch.set_scope(name, 0, "local")
        sch.transform_layout(name, ("write", 0), _acc_index_map)
        _acc_block(sch, name, num_warpgroups)
    sch.set_scope("init_scale", 0, "local")  # the scale in log2 units, a scalar the per-row blocks read
    if row_state == "registers":
        _row_state_in_registers(sch, BN, num_warpgroups)
    else:
        _row_state_in_shared_memory(sch, BN, num_warpgroups)
    if num_stages > 1:  # last: it annotates kv_step's final children
        pipeline_loads(sch, num_stages, lagged=("pv",) if overlap else ())
    if overlap:  # the last PV is waited for, and its accumulators fenced, before the output reads them
        sch.annotate(sch.get_loops("store_o")[-3], WGMMA_WAIT_PRAGMA, 0)  # its first per-thread loop
    return sch


# --------------------------------------------------------------------------------------------
# the backward pass (``tvmflash.program_backward``): dkdv and dq on wgmma
# --------------------------------------------------------------------------------------------
# delta runs on the SIMT schedule. dkdv's tile is block_n keys (64 a warpgroup) and block_m query
# rows a step; dq's is dq_block_m query rows (64 a warpgroup) and dq_block_n keys a step. Each
# program's stream of tiles (dkdv: Q, dout and their rows' lse and delta; dq: K and V) is loaded in a
# pipeline of ``*_stages`` (1: plain loads), by cp.async or, dkdv's with ``dkdv_copy`` "tma" (the
# default), by TMA: one thread copies a Q block's q and dout (swizzled tiles) and its rows' lse and
# delta on the stage's mbarrier (``tvmflash.lowering.tma``), so the other threads spend no registers
# or instructions on the copies and the loads need no block-wide barrier. With the epilogue's guards
# merged (``lowering.passes.MergeAdjacentGuards``; 241-250 registers a thread at d128, no spills) the
# backward runs 1.22-1.40x SDPA flash at d128 and 1.15-1.21x at d64, against 0.95-1.02x with the
# plain loads at d128 and the cp.async pipeline at d64 (H200, 2026-12-02, benchmarks/backward_knobs.py
# at 2k and 8k tokens, BENCHMARKS.md). Dense only: varlen's rows past a sequence's end
# must read as zeros, not as the next sequence's, so varlen keeps cp.async
# (``BACKWARD_VARLEN_KNOBS_FOR_HEAD_DIM``). dq_atomic (the default): no dq pass; dkdv adds each
# step's ds k into an fp32 accumulator (``_schedule_dq_share``), 1.05-1.10x the dq pass with TMA
# (measured before the guards were merged); deterministic=True turns it off (``choice.resolve_backward``).
# wgmma_overlap: dp's wgmma only committed, so that p's exponentials run while it does (ds waits
# for it), and dv's too, so that dk's wait ends both; without it each product is waited for at once.
BACKWARD_KNOBS = {"block_m": 64, "block_n": 128, "dq_block_m": 128, "dq_block_n": 64, "dkdv_stages": 2,
                  "dq_stages": 2, "vec": 8, "dq_atomic": True, "dkdv_copy": "tma", "wgmma_overlap": True}
# d64, dq pass: 32-key steps, 8-10% faster than 64 (at d128 4-7% slower; H200, 2026-12-02, commit c022a92).
# d64 without wgmma_overlap: 0.2-0.7% faster than with it; at d128 it gains 2.0-2.4% non-causal, 0.3-0.4%
# causal (H200, 2026-12-02, benchmarks/backward_knobs.py at 2k and 8k tokens, commit 9d49f3b).
BACKWARD_KNOBS_FOR_HEAD_DIM = {64: {"dq_block_n": 32, "wgmma_overlap": False}}
# varlen by cp.async: at d128 by plain loads, 1.01-1.17x the two stages' speed (which spill 400 bytes
# there), at d64 in two stages, 5-17% faster than one (H200, 2026-12-02, commit aab1fe2)
BACKWARD_VARLEN_KNOBS_FOR_HEAD_DIM = {64: {"dkdv_copy": "cp.async"}, 128: {"dkdv_copy": "cp.async", "dkdv_stages": 1}}
BACKWARD_HEAD_DIMS = (64, 128)
BACKWARD_SPACE = {
    "block_m": [32, 64],
    "block_n": [64, 128],
    "dq_block_m": [64, 128],
    "dq_block_n": [32, 64],
    "dkdv_stages": [1, 2],
    "dq_stages": [1, 2],
    "vec": [8],
    "dq_atomic": [True, False],
    "dkdv_copy": lambda knobs: list(KV_COPIES) if knobs["dkdv_stages"] > 1 else ["cp.async"],  # TMA fills stages
    "wgmma_overlap": [True, False],
}


def backward_shared_memory_bytes(head_dim: int, dtype: str, knobs: dict) -> int:
    """Dynamic shared memory of the larger of dkdv and dq: each program's tiles in padded core
    matrices (``_pad_core_matrix_stride``), the streamed ones once a stage, and the rows' lse and
    delta; with dq_atomic, dkdv's dsᵀ tile (block_n x block_m) and no dq."""
    def padded(cols):
        return cols * (CORE_MATRIX_ELEMENTS + PAD_ELEMENTS) // CORE_MATRIX_ELEMENTS

    tma = knobs.get("dkdv_copy") == "tma"  # swizzled q and dout (no padding), after the barriers, on 1 KiB
    stream = 2 * knobs["block_m"] * knobs["dkdv_stages"] * (head_dim if tma else padded(head_dim)) * 2
    dkdv = 2 * knobs["block_n"] * padded(head_dim) * 2 + stream + 8 * knobs["block_m"] * knobs["dkdv_stages"] \
        + (TMA_BARRIER_BYTES["thread"] + SWIZZLE_ALIGNMENT if tma else 0)
    if knobs.get("dq_atomic"):
        return dkdv + knobs["block_n"] * padded(knobs["block_m"]) * 2
    dq = (2 * knobs["dq_block_m"] + 2 * knobs["dq_block_n"] * knobs["dq_stages"]) * padded(head_dim) * 2 \
        + 8 * knobs["dq_block_m"]
    return max(dkdv, dq)


def schedule_backward(sch: tvm.s_tir.Schedule, *, block_m: int, block_n: int, dq_block_m: int, dq_block_n: int,
                      dkdv_stages: int, dq_stages: int, vec: int, dq_atomic: bool = False,
                      dkdv_copy: str = "cp.async", wgmma_overlap: bool = False) -> tvm.s_tir.Schedule:
    """delta on the SIMT schedule, dkdv and dq on wgmma (``vec`` elements a copy). The tiles are the
    program's (``program_backward.attention_backward``). ``dq_atomic``: the program has no dq; dkdv
    adds dq's share atomically (``_schedule_dq_share``) and convert_dq runs on SIMT. ``wgmma_overlap``:
    see the comment above ``BACKWARD_KNOBS``."""
    from . import cuda

    cuda.schedule_delta(sch)
    _schedule_dkdv(sch, dkdv_stages, vec, dq_atomic, dkdv_copy, wgmma_overlap)
    if dq_atomic:
        cuda.schedule_convert_dq(sch)
    else:
        _schedule_dq(sch, dq_stages, vec, wgmma_overlap)
    return sch


def backward_knobs_problem(head_dim: int, dtype: str, knobs: dict) -> str | None:
    """Why these backward knobs cannot be scheduled, or None: checked when a BackwardKernel is made,
    before anything is built (the tuner leaves such configurations out)."""
    copy = knobs.get("dkdv_copy", "cp.async")
    if copy not in KV_COPIES:
        return f"knobs: dkdv_copy takes one of {KV_COPIES}, got {copy!r}"
    if copy == "tma" and (knobs["dkdv_stages"] < 2 or head_dim % SWIZZLE_COLUMNS):
        return (f"knobs: dkdv_copy 'tma' copies into a pipeline's stages, in 64-column swizzled halves: it needs "
                f"dkdv_stages >= 2 and a head_dim that is a multiple of {SWIZZLE_COLUMNS}, got "
                f"{knobs['dkdv_stages']} and {head_dim}")
    if knobs.get("dq_atomic"):
        return _dq_share_problem(knobs["block_m"], head_dim, max(1, knobs["block_n"] // WG_ROWS))
    return None


def _dq_share_problem(block_m: int, head_dim: int, groups: int) -> str | None:
    if block_m != WG_ROWS or (head_dim // groups) % 8:
        return (f"knobs: the sm90 dq_atomic (the default) makes ds k in one wgmma of 64 query rows, each warpgroup "
                f"head_dim / warpgroups columns (a multiple of 8): it needs block_m 64 and head_dim a multiple of "
                f"{8 * groups}, got block_m {block_m} and head_dim {head_dim}; with other tiles pass dq_atomic False "
                f"(dq by a pass of its own)")
    return None


def _backward_warpgroups(rows: int, what: str) -> int:
    if rows % WG_ROWS:
        raise ValueError(f"knobs: the sm90 backward gives each warpgroup 64 {what}, so it needs a multiple of 64, "
                         f"got {rows}")
    return rows // WG_ROWS


def _schedule_dkdv(sch: tvm.s_tir.Schedule, num_stages: int, vec: int, dq_atomic: bool = False,
                   copy: str = "cp.async", overlap: bool = False) -> None:
    """dkdv: its tiles are key-first (sᵀ = k qᵀ, ...), so warpgroup g owns keys [64 g, 64 g + 64) of
    the K/V block, as the forward's warpgroups own query rows: sᵀ and dpᵀ on wgmma with K or V as A
    and q or dout as B (K-major), pᵀ and dsᵀ in the accumulator registers, which are the A operand
    of dv += pᵀ dout and dk += dsᵀ q (the "rs" form, dout and q as N-major B), and dv, dk in
    accumulator registers across the Q blocks, stored from them."""
    sch.work_on("dkdv")
    dtype, BM, D, BN = buffer_info(sch)
    groups = _backward_warpgroups(BN, "keys (block_n)")
    if BM % 16 or D % 16:
        raise ValueError(f"knobs: the sm90 dkdv needs block_m and head_dim multiples of 16, got {BM} and {D}")
    staged = dkdv_grid(sch, dq_atomic)  # dsᵀ's copy to shared memory with dq_atomic
    tma = copy == "tma"
    for name in ("load_k", "load_v", "load_q", "load_do"):  # q and dout swizzled for TMA
        _tile_in_shared_memory(sch, name, groups, vec, swizzled=tma and name in ("load_q", "load_do"))
    for name in ("load_lse", "load_delta"):  # BM rows, any number of warpgroups
        _spread_rows(sch, name, groups)
    if tma:  # the Q block's tiles and its rows' values by TMA
        for name in ("load_q", "load_do", "load_lse", "load_delta"):
            sch.annotate(sch.get_sblock(name), TMA_LOAD, "thread")
    _backward_step(sch, ("cast_p",), groups, BM, D, dtype, num_stages, overlap, b_swizzled=tma)
    for name in ("dv", "dk"):  # with overlap dv is only committed: dk's wait ends both
        _backward_accumulate(sch, name, groups, D, BM, dtype, b_swizzled=tma, wait=not overlap or name == "dk")
    if dq_atomic:
        _schedule_dq_share(sch, staged, groups, BM, D, BN, dtype)
    if num_stages > 1:
        pipeline_loads(sch, num_stages, step="q_step", loads=("load_q", "load_do", "load_lse", "load_delta"))


def _schedule_dq_share(sch, staged, groups, BM, D, BN, dtype):
    """dq's share of a dkdv step, ds k, added atomically into the fp32 dq (FA2's way, as sm80's
    ``dq_atomic``). Each warpgroup holds dsᵀ of its keys, but ds k sums over all the block's keys:
    the threads write their dsᵀ elements to shared memory (core matrices), and each warpgroup then
    makes the 64 query rows of ds k for its share of the head_dim columns on wgmma (dsᵀ read
    transposed as A, K N-major as B) and adds its accumulator registers into global memory, two
    adjacent columns a ``red.global.add.v2.f32`` (``ATOMIC_ADD_PRAGMA``)."""
    problem = _dq_share_problem(BM, D, groups)
    if problem:
        raise ValueError(problem)
    cols = D // groups
    sch.transform_layout(staged, ("write", 0), _core_matrix_map)
    _pad_core_matrix_stride(sch, staged)
    _acc_block(sch, staged, groups)
    sch.vectorize(sch.get_loops(staged)[-1])

    def by_columns(i, d):  # (query row, column) -> (warpgroup, register): warpgroups split the columns
        return (d // cols, _acc_layout(i, d % cols)[1])

    def columns_by_warpgroup(i, d):  # (query row, column) loops -> warpgroup outside the rows; the rows loop
        wg, d = sch.split(d, [groups, cols])
        sch.reorder(wg, i, d)
        sch.bind(wg, "threadIdx.y")
        return i

    block = sch.get_sblock("dq")
    sch.set_scope(block, 0, "local")
    sch.transform_layout(block, ("write", 0), by_columns)
    i = columns_by_warpgroup(*sch.get_loops(block)[-3:-1])  # (i, d, j): the reduction j stays innermost
    init = sch.decompose_reduction(block, i)
    _bind_acc_threads(sch, init)
    sch.tensorize(i, wgmma_intrin_name(cols, BN, dtype, "mn", a_major="mn"))
    columns_by_warpgroup(*sch.get_loops("accumulate_dq")[-2:])
    _bind_acc_threads(sch, "accumulate_dq")
    # the loops in each thread; 2: a thread's two adjacent columns go as one vector reduction
    sch.annotate(sch.get_loops("accumulate_dq")[-3], ATOMIC_ADD_PRAGMA, 2)


def _schedule_dq(sch: tvm.s_tir.Schedule, num_stages: int, vec: int, overlap: bool = False) -> None:
    """dq, mapped as the forward is (a Q block, the K/V blocks streamed past it): s and dp on wgmma
    with q or dout as A and K or V as B (K-major), p and ds in accumulator registers, ds the A operand
    of dq += ds k (K as N-major B), dq in accumulator registers across the K/V blocks."""
    sch.work_on("dq")
    dtype, BM, D, BN = buffer_info(sch)
    groups = _backward_warpgroups(BM, "query rows (dq_block_m)")
    if BN % 16 or D % 16:
        raise ValueError(f"knobs: the sm90 dq needs dq_block_n and head_dim multiples of 16, got {BN} and {D}")
    bind_grid(sch)
    for name in ("load_q", "load_do", "load_k", "load_v"):
        _tile_in_shared_memory(sch, name, groups, vec, swizzled=False)
    for name in ("load_lse", "load_delta"):
        sch.set_scope(name, 0, "shared.dyn")
        _row_block(sch, name, groups)
    _backward_step(sch, (), groups, BN, D, dtype, num_stages, overlap)
    _backward_accumulate(sch, "dq", groups, D, BN, dtype)
    if num_stages > 1:
        pipeline_loads(sch, num_stages)


def _spread_rows(sch, name, groups):
    """A per-row copy of any number of rows over the block's threads."""
    sch.set_scope(name, 0, "shared.dyn")
    _, ty, tx = sch.split(sch.get_loops(name)[-1], [None, groups, WARPGROUP])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")


def _backward_step(sch, casts, groups, cols, D, dtype, num_stages, overlap, b_swizzled=False):
    """What dkdv and dq share: s and dp on wgmma ("ss": A and B K-major from shared memory, N =
    ``cols``), p, ds and ``casts`` on the accumulator registers, each thread its elements. With
    ``overlap`` dp's wgmma is only committed: p's exponentials run while it does, and ds waits for
    it. With one stage, s's fence and barrier make the step's tiles visible to both products (dp
    reads none that is written after them)."""
    sch.set_scope("init_scale", 0, "local")  # each thread its copy of the scale
    for name in ("qk", "dp"):
        sch.set_scope(name, 0, "local")
        sch.transform_layout(name, ("write", 0), _acc_index_map)
        rows = _warpgroup_gemm(sch, name, groups)
        sch.tensorize(rows, wgmma_intrin_name(cols, D, dtype, "k", fence_operands=num_stages == 1 and name == "qk",
                                              b_swizzled=b_swizzled, wait=not overlap or name == "qk"))
    for name in ("exp", "ds", *casts):
        sch.set_scope(name, 0, "local")
        sch.transform_layout(name, ("write", 0), _acc_index_map)
        _acc_block(sch, name, groups)
    if overlap:
        sch.annotate(sch.get_loops("ds")[-3], WGMMA_WAIT_PRAGMA, "dP")  # its first per-thread loop


def _backward_accumulate(sch, name, groups, D, k, dtype, b_swizzled=False, wait=True):
    """A gradient's product on wgmma ("rs": A, the p or ds of the step, from the accumulator
    registers; B N-major from shared memory), the gradient in accumulator registers across the
    steps, zeroed first and stored from them (each thread its pairs of adjacent columns). Without
    ``wait`` only committed: a later product's wait ends it."""
    sch.set_scope(name, 0, "local")
    sch.transform_layout(name, ("write", 0), _acc_index_map)
    block = sch.get_sblock(name)
    rows = _warpgroup_gemm(sch, block, groups)
    hide_init_reads(sch, block)
    sch.tensorize(rows, wgmma_intrin_name(D, k, dtype, "mn", a_regs=True, b_swizzled=b_swizzled, wait=wait))
    _acc_block(sch, f"init_{name}", groups)
    _acc_block(sch, f"store_{name}", groups)
    sch.vectorize(sch.get_loops(f"store_{name}")[-1])
