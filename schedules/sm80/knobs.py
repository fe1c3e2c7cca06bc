"""The sm80 schedule's knobs, declared once (``schedules.contract``): the forward's, the backward's and
decode's, with the checks and shared-memory models that say which knobs build and fit."""

from __future__ import annotations

import math

from ..contract import DERIVED, STRUCTURE, TILE, Knob, KnobSet

WARP = 32  # threads of a warp: the forward and dq give each warp 32 query rows (block_m = 32 * num_warps)
DTYPES = ("float16", "bfloat16")  # float32 has no exact tensor-core path: the SIMT schedule serves it
# The strides of q, k, v and out are whole 16-byte vectors (``program_forward.attention_forward``'s
# stride_alignment; a kernel copies a tensor whose strides are not): the copies move 16 bytes.
STRIDE_ALIGNMENT = 16
PASS_CONFIG = {
    "tirx.use_async_copy": True,
    # Fragments are per-lane register arrays: any loop over them left rolled indexes them
    # dynamically, which puts them in local memory.
    "tirx.UnrollLoop": {"unroll_local_access": True, "explicit_unroll": False},
    # LowerWarpMemory cannot see through CSE'd store indices into warp buffers.
    "tirx.disable_cse_tir": True,
}
NUM_STAGES = (1, 2, 3)  # 1: plain loads; 2, 3: cp.async software pipeline over the K/V tiles
# Where the per-row running values (m, m_new, alpha, l) live. "registers": replicated on the 4
# lanes of the quad that holds the row's fragment elements (FA2's way); the K/V step then has only
# the barriers that guard the K/V shared tiles. "shared": shared memory, one lane per row
# (ThreadSync then puts ~7 __syncthreads in each K/V step); kept as a knob for comparison.
ROW_STATES = ("registers", "shared")


def shared_memory_bytes(head_dim: int, dtype: str, knobs: dict) -> int:
    """Shared memory a forward build with these knobs needs: the Q tile and num_stages K/V tile
    pairs, rows padded by 8 elements, plus the per-row values staged for store_lse (a few per row)."""
    row_bytes = (head_dim + 8) * (2 if dtype in DTYPES else 4)
    tiles = knobs["block_m"] + 2 * knobs["block_n"] * max(1, knobs["num_stages"])
    return tiles * row_bytes + 8 * 4 * knobs["block_m"]


# The defaults (row_state "registers", 64-key tiles, two stages) measured the fastest at head_dim 64
# and 128 against one stage, 32- or 128-key tiles and row_state "shared", whose pipelined build
# spills. One MetaSchedule task per (block_m, block_n); num_stages is a structure knob: the
# pipeline's stage annotations need a plain int.
# mma.sync m16n8k16 and ldmatrix take the head_dim in steps of 16: the forward, the backward and decode
# build at every multiple of 16 (cross-compiled for sm_80 and sm_90a, and through nvcc, at every
# multiple of 8 up to 256), and at no other. Above 128 the forward takes 32-key tiles, as at 256: with
# 64 its accumulators spilled 216 bytes at d160 and 1.2 KiB at d224 (ptxas -v), with 32 44 and 636.
MMA_HEAD_DIMS = tuple(range(16, 257, 16))
FORWARD = KnobSet("sm80", "forward", (
    Knob("block_m", 128, space=(64, 128), role=TILE),
    Knob("block_n", 64, space=(32, 64, 128), by_head_dim={d: 32 for d in MMA_HEAD_DIMS if d > 128}, role=TILE),
    Knob("num_warps", 4, space=lambda knobs: [knobs["block_m"] // WARP], role=DERIVED),  # block_m == 32 * num_warps
    Knob("num_stages", 2, choices=NUM_STAGES, space=(1, 2), role=STRUCTURE),
    Knob("vec", 8),
    Knob("row_state", "registers", choices=ROW_STATES),
), shared_memory=shared_memory_bytes)


def backward_shared_memory_bytes(head_dim: int, dtype: str, knobs: dict) -> int:
    """Dynamic shared memory of the larger of dkdv and dq: each program's Q, dout, K and V tiles
    (rows padded by 8 elements) and its rows' lse and delta."""
    dkdv = (2 * knobs["block_m"] + 2 * knobs["block_n"]) * (head_dim + 8) * 2 + 8 * knobs["block_m"]
    if knobs.get("dq_atomic"):  # and dsᵀ, for dq's share
        return dkdv + knobs["block_n"] * (knobs["block_m"] + 8) * 2
    return max(dkdv, (2 * knobs["dq_block_m"] + 2 * knobs["dq_block_n"]) * (head_dim + 8) * 2 + 8 * knobs["dq_block_m"])


# dkdv's tile (block_m query rows a step, block_n keys, dkdv_warps warps of block_n / dkdv_warps keys)
# and dq's (dq_block_m rows, dq_warps warps of 32 rows, dq_block_n keys a step). dq in 32-key tiles
# from head_dim 80: with 64, s, p and dp (64 floats a lane each) and dq (head_dim) spill (at d80 108
# bytes, at d112 496; none with 32). dq_atomic
# (dq's share added by fp32 atomics from dkdv, FA2's way) is no tuning choice: it makes dq's rounding
# change from run to run, and it measured slower (at head_dim 128 dkdv then spills).
def backward_rules(knobs: dict) -> str | None:
    """Why dkdv's warps do not split its tile (each warp 16 keys or a multiple), or None."""
    if knobs["block_n"] % (16 * knobs["dkdv_warps"]):
        return (f"the sm80 dkdv needs block_n a multiple of 16 * dkdv_warps, got block_n {knobs['block_n']}, "
                f"dkdv_warps {knobs['dkdv_warps']}")
    return None


BACKWARD = KnobSet("sm80", "backward", (
    Knob("block_m", 64, space=(32, 64, 128), role=TILE),
    Knob("block_n", 64, space=(32, 64, 128), role=TILE),
    Knob("dkdv_warps", 4, space=(2, 4, 8)),
    Knob("dkdv_stages", 2, choices=NUM_STAGES, space=NUM_STAGES),
    Knob("dq_block_m", 64, space=(32, 64, 128), role=TILE),
    Knob("dq_block_n", 64, space=(32, 64), by_head_dim={80: 32, 96: 32, 112: 32, 128: 32}, role=TILE),
    Knob("dq_warps", 2, space=lambda knobs: [knobs["dq_block_m"] // WARP], role=DERIVED),
    Knob("dq_stages", 2, choices=NUM_STAGES, space=NUM_STAGES),
    Knob("vec", 8),
    Knob("dq_atomic", False),
), rules=backward_rules, shared_memory=backward_shared_memory_bytes)
# Above 128 dkdv spills kilobytes (1.2 KiB at d144, 5.4 KiB at d256: dk and dv alone are 512 floats a
# lane of 16 keys there): SIMT serves those. The torch API pads the other head_dims up to 128 to one of
# these rather than run SIMT (``choice.head_dim_to_run``: 40 to 48, 120 to 128), once they are checked on
# a GPU (``contract.gpu_checked``).
BACKWARD_HEAD_DIMS = tuple(d for d in MMA_HEAD_DIMS if d <= 128)

WARP_ROWS = 16  # a warp's rows of a decode task: one mma tile


def decode_query_tokens(group: int, knobs: dict) -> int:
    """Query tokens of a decode task: the fewest whose rows (group x tokens) fill whole 16-row mma tiles."""
    return WARP_ROWS // math.gcd(WARP_ROWS, group)


def decode_shared_memory_bytes(head_dim: int, dtype: str, knobs: dict, group: int = 8) -> int:
    """Shared memory of a decode task: its query rows and num_stages K/V tile pairs (rows padded by 8
    elements), and the final row values staged for store_lse. Over an FP8 cache (knobs' "fp8_cache" set,
    by decode's kernel): one pair of converted tiles, or with fp8_tiles "fragments" (FP8_FRAGMENTS) num_stages
    pairs of byte tiles alone (a byte an element, rows padded by 16 bytes)."""
    rows = group * decode_query_tokens(group, knobs)
    if not knobs.get("fp8_cache"):
        tiles = rows + 2 * knobs["block_n"] * max(1, knobs["num_stages"])
        return tiles * (head_dim + 8) * 2 + 8 * rows
    fragments = knobs["num_stages"] > 1 and knobs.get("fp8_tiles") == "fragments"
    converted = (rows + (0 if fragments else 2 * knobs["block_n"])) * (head_dim + 8) * 2 + 8 * rows
    return converted + (2 * knobs["block_n"] * (head_dim + 16) * knobs["num_stages"] if fragments else 0)


def decode_tasks_per_sm(head_dim: int, dtype: str, knobs: dict, group: int = 8) -> int:
    """Thread blocks of the split kernel one SM holds at once, by shared memory (228 KiB an SM, sm80
    to sm90, 1 KiB reserved a block; at most 32 blocks), for choosing the split count."""
    return max(1, min(32, (228 * 1024) // (decode_shared_memory_bytes(head_dim, dtype, knobs, group) + 1024)))


def decode_build_problem(head_dim: int, dtype: str, knobs: dict) -> str | None:
    """Why these decode knobs cannot build, or None (the head_dim too, for a caller's ``schedule="sm80"``;
    the choice goes by ``DECODE_HEAD_DIMS``)."""
    if dtype not in DTYPES:
        return f"the sm80 decode schedule takes {DTYPES}, got {dtype}"
    if head_dim % 16 or knobs["block_n"] % 32:
        # block_n 16 builds, but on the GPU it gave wrong results (fewer keys read than the cache
        # holds); not understood yet
        return f"head_dim ({head_dim}) must be a multiple of 16 and block_n ({knobs['block_n']}) of 32"
    return None


DECODE_HEAD_DIMS = MMA_HEAD_DIMS  # the others: the SIMT decode
# Decode over an FP8 (e4m3) cache: the head_dims whose GPU tests have not passed yet (none: each of
# DECODE_HEAD_DIMS has, contiguous and paged, in every fp8_tiles form)
DECODE_FP8_UNCHECKED_HEAD_DIMS = ()
# ... and its knobs over the DECODE set's defaults: two stages of byte tiles, not three. A tile of bytes holds
# half the bf16 tile's, so a task's shared memory is small, and more tasks an SM (and more splits) hide the
# loads' latency better than a third stage does (BENCHMARKS.md, the FP8-cache decode).
DECODE_FP8_CACHE_DEFAULTS = {"num_stages": 2}


# block_n: keys per K/V tile; num_stages: K/V tiles in flight (cp.async, 1: plain loads); vec: elements
# a copy moves. 32-key tiles in three stages (four tasks an SM) measured as fast as 64-key tiles in
# two (three an SM) at large batches, and faster at small ones. A task's query tokens are no knob:
# the fewest whose rows fill whole mma tiles (``decode_query_tokens``).
# fp8_tiles (an FP8 cache only; ``decode.fp8_byte_tiles``): "registers", its next tiles' bytes prefetched
# into registers and converted into the shared tiles (FP8_PIPELINE; with num_stages 1 converted as read);
# "fragments", its bytes copied by cp.async into num_stages shared byte tiles and converted straight into
# the mma operands (FP8_FRAGMENTS): the default, measured faster than "registers" on an H100 (BENCHMARKS.md;
# where the target has no e4m3 conversion of its own, sm_80 and sm_86, the registers form serves it:
# ``decode.fp8_byte_tiles``).
FP8_TILES = ("registers", "fragments")
DECODE = KnobSet("sm80", "decode", (
    Knob("block_n", 32, space=(32, 64, 128)),
    Knob("num_stages", 3, choices=(1, 2, 3, 4), space=(1, 2, 3, 4)),
    Knob("vec", 8, choices=(2, 4, 8)),
    Knob("fp8_tiles", "fragments", choices=FP8_TILES),
), build_problem=decode_build_problem, shared_memory=decode_shared_memory_bytes)
