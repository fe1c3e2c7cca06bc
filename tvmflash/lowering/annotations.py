"""What a schedule (or the program) writes into its TensorIR for the lowering to act on: loop and block
annotations, pragmas, and the layout constants that the sm90 schedule and the TMA lowering share.

Schedules and the programs import these names from here; the lowering never imports a schedule."""

# A block annotation, from the program: the block runs only where this condition (of its iteration
# variables) holds, else not at all (``loops_and_blocks.RunBlocksIf``): varlen's Q blocks past their
# sequence's end, flash-attn's early return. (A block predicate, T.where, would make the bindings within
# non-affine for the schedules; an ``if`` in the program would move the statements they count.)
RUNS_IF = "tvmflash.runs_if"

# A loop annotation: the loop visits its iterations last to first (``loops_and_blocks.ReverseLoops``;
# TensorIR's Schedule has no primitive that reverses a loop).
REVERSED = "tvmflash.reversed"

# A loop annotation: the loop walks a persistent thread block's tiles (the "tile" block inside it, one a
# step; the loop outside it bound to blockIdx.x), so that the TMA lowering sets its barriers up once, runs
# the walk inside the producer's and the consumers' branches, and carries the pipeline's phases from one
# tile to the next (``tma_copies.lowered_to_tma``).
PERSISTENT_WALK = "tvmflash.persistent_walk"

# Block annotation: this pipelined global -> shared copy goes by TMA (``tma_copies.LowerToTMA``), issued
# by the producer the annotation names; that adds TMA_BARRIER_BYTES[producer] of mbarriers to the
# kernel's shared memory. The sizes keep the tiles that shared-memory merging packs after the barriers
# on 1024-byte boundaries (the swizzle's), for the buffers each build has
# (``tile_alignment.CheckTileAlignment`` checks every build).
TMA_LOAD = "tvmflash.tma_load"
TMA_PRODUCERS = ("thread", "warpgroup")  # thread 0 of the first warpgroup, or a producer warpgroup (FA3's)
TMA_BARRIER_BYTES = {"thread": 512, "warpgroup": 1024}
# Shared-memory merging packs the buffers live together by size, smallest first, so the K/V tiles land
# after the barriers and every smaller buffer. TMA_BARRIER_BYTES suits the defaults; where the smaller
# buffers add up to another multiple of 256 bytes, a build grows the barriers by one of these
# (``lowering.build`` tries them in turn until ``tile_alignment.CheckTileAlignment`` passes).
TMA_BARRIER_PADDINGS = (0, 256, 512, 768)
# The 128-byte swizzle of 16-bit tiles (wgmma descriptors' layout type 1, TMA's SWIZZLE_128B): a tile
# is cut into halves of this many columns, one 128-byte row each.
SWIZZLE_COLUMNS = 64
# Where a head_dim is no multiple of SWIZZLE_COLUMNS (d96), the 64-byte swizzle (layout type 2, TMA's
# SWIZZLE_64B): groups of 32 columns, one 64-byte row each.
NARROW_SWIZZLE_COLUMNS = 32
# A wgmma descriptor's layout type for each swizzle, by its rows' columns (0: no swizzle)
WGMMA_SWIZZLE_LAYOUTS = {SWIZZLE_COLUMNS: 1, NARROW_SWIZZLE_COLUMNS: 2}


def swizzle_columns(head_dim: int) -> int | None:
    """The columns of a swizzled tile's row group at this head_dim: the widest swizzle that divides it
    (None: neither does)."""
    return next((c for c in (SWIZZLE_COLUMNS, NARROW_SWIZZLE_COLUMNS) if head_dim % c == 0), None)


# A loop annotated so (a schedule has no primitive that inserts a statement) is preceded by
# ``wgmma.wait_group 0`` and a register fence of the accumulators it reads (the local float32 buffers
# whose names start with the annotation's value where it is a string, else with ``acc``): the loop
# reads the result of a wgmma that was only committed (``pragmas.LowerPragmas``).
WGMMA_WAIT_PRAGMA = "pragma_tvmflash_wgmma_wait"
# A loop annotated so, one that scales a thread's elements by per-row factors (the output's rescale
# by alpha), runs only where a lane of the warp has a factor other than 1; with the program's
# RESCALE_THRESHOLD that is rare after the first tiles (``pragmas.LowerPragmas``).
SKIP_UNIT_RESCALE_PRAGMA = "pragma_tvmflash_skip_unit_rescale"

# A loop annotated so, whose stores all read-modify-write ``x[i] = x[i] + y``, adds atomically instead
# (``atomicAdd(&x[i], y)``; ``pragmas.LowerPragmas``): thread blocks that sum into the same memory
# (the backward's dq from every K/V tile).
ATOMIC_ADD_PRAGMA = "pragma_tvmflash_atomic_add"
# As ATOMIC_ADD_PRAGMA, for additions whose index is data (a learnable bias table's, read through a
# score_mod's index: ``program_flex_gradient``), where many of a thread's elements share one: the thread sums a
# run of consecutive additions to one element in a register and adds the run once, atomically, when the
# index changes and after the loop (``pragmas.LowerPragmas``). A relative-position table clamped at a
# reach gives most of a tile one index: one atomic a thread a step instead of one an element. The value 2:
# the loop runs on whole, converged warps, and a warp whose last runs all end on one element (a per-head
# scalar, a clamped table's far entries) adds their sum once: one atomic a warp a step.
MERGED_ATOMIC_ADD_PRAGMA = "pragma_tvmflash_merged_atomic_add"

# A loop annotated so writes a shared-memory tile that the rest of its step reads: the tile is held in
# two buffers that the steps take in turn, and the barrier before its writes goes
# (``double_buffers.DoubleBuffers``).
DOUBLE_BUFFERED_PRAGMA = "pragma_tvmflash_double_buffered"

# A loop over rows annotated so, its body a loop over a row's columns whose stores all add a
# shared-memory row into a global one (``x[f(i, c)] = x[f(i, c)] + y[g(i, c)]``, c innermost and
# contiguous in both), adds each row by one bulk reduction (``cp.reduce.async.bulk ... add.f32``),
# issued by thread i of the warpgroup, after a fence and a named barrier of the warpgroup's threads
# (the annotation's value: how many) that make the row's writes visible to the bulk copy engine
# (``pragmas.LowerPragmas``). The warpgroup's named barrier is BULK_REDUCE_BARRIER + threadIdx.y.
BULK_REDUCE_PRAGMA = "pragma_tvmflash_bulk_reduce"
# A loop annotated so, one that writes the rows that a BULK_REDUCE_PRAGMA loop adds, first waits until
# this thread's bulk reductions have read their rows, then at the warpgroup's named barrier (the
# annotation's value: its threads) for the other threads' (or, value 0, until they are complete,
# without a barrier: before the thread block ends).
BULK_REDUCE_WAIT_PRAGMA = "pragma_tvmflash_bulk_reduce_wait"
# As BULK_REDUCE_PRAGMA, but the warpgroup's threads add the rows themselves, four columns a
# ``red.global.add.v4.f32``, consecutive threads consecutive columns: whole 128-byte lines a warp.
VECTOR_REDUCE_PRAGMA = "pragma_tvmflash_vector_reduce"
# As BULK_REDUCE_PRAGMA, but the rows' shared-memory tile is in the 128-byte swizzle of float32 rows (TMA's
# layout, ``schedules.sm90.layouts.swizzled_map``) and thread 0 of the warpgroup adds all of them by one
# TMA reduction (``cp.reduce.async.bulk.tensor``) through a tensor map of the global tensor
# (``tma_reductions``), FA3's way: the copy engine's cost is per operation.
TMA_REDUCE_PRAGMA = "pragma_tvmflash_tma_reduce"
BULK_REDUCE_BARRIER = 2  # the named barriers' first id (0 is __syncthreads, 1 the TMA consumers')

# A register fence of one float (a wgmma accumulator element): the compiler may not move reads of it
# above the wgmma wait that precedes the fence. The sm90 schedule's wgmma intrinsics and the
# WGMMA_WAIT_PRAGMA lowering emit it (CUTLASS's warpgroup_fence_operand: TVM's own noop_barrier helper
# takes its operand by value, which fences a copy).
REG_FENCE = (
    "__device__ __forceinline__ void tvmflash_wgmma_reg_fence(float& r) "
    '{ asm volatile("" : "+f"(r) :: "memory"); }'
)
REG_FENCE_U32 = (  # the same for the A registers of the "rs" form (bf16/fp16 pairs)
    "__device__ __forceinline__ void tvmflash_wgmma_reg_fence_u32(unsigned int& r) "
    '{ asm volatile("" : "+r"(r) :: "memory"); }'
)
REG_FENCE_PAIR = (  # the same, given the first of the pair's two 16-bit elements
    "template <typename T> __device__ __forceinline__ void tvmflash_wgmma_reg_fence_pair(T& r) "
    '{ asm volatile("" : "+r"(*reinterpret_cast<unsigned int*>(&r)) :: "memory"); }'
)

# PrimFunc attributes that ``lowering.build`` sets from the schedule's build options, for the pipeline's
# passes to read (``pipeline.options``).
ASYNC_PROXY_OPERANDS_ATTR = "tvmflash.async_proxy_operands"
HOIST_BLOCK_INDEX_CONDITIONS_ATTR = "tvmflash.hoist_block_index_conditions"
TMA_BARRIER_PADDING_ATTR = "tvmflash.tma_barrier_padding"
WIDE_INDICES_ATTR = "tvmflash.wide_indices"  # index global buffers in int64 (``wide_indices.WidenGlobalIndices``)
