"""The sm80 backward (``tvmflash.program_backward``) on tensor cores: dkdv and dq each mapped as the
forward is (``_schedule_dkdv``, ``_schedule_dq``), delta on the SIMT schedule. dkdv's tile (block_m
query rows a step, block_n keys, dkdv_warps warps of block_n / dkdv_warps keys) and dq's (dq_block_m
rows, dq_warps warps of 32 rows, dq_block_n keys a step) are knobs of their own (``knobs.BACKWARD``)."""

from __future__ import annotations

import tvm

from tvmflash.lowering.annotations import ATOMIC_ADD_PRAGMA, MERGED_ATOMIC_ADD_PRAGMA

from .. import simt
from ..common import bind_grid, buffer_info, dkdv_grid, has_block, hide_init_reads, pipeline_loads
from .fragments import (copy_to_shared, fill_fragments, frag_index_map, fragment_elementwise, fragment_lanes, row_block,
                        store_fragments, warp_gemm_operands)
from .intrinsics import intrin_names
from .knobs import WARP


def schedule_backward(sch: tvm.s_tir.Schedule, *, block_m: int, block_n: int, dkdv_warps: int, dkdv_stages: int,
                      dq_block_m: int, dq_block_n: int, dq_warps: int, dq_stages: int, vec: int,
                      dq_atomic: bool = False) -> tvm.s_tir.Schedule:
    """delta on the SIMT schedule, dkdv and dq on tensor cores (``vec`` elements a copy); see above.
    The tiles are the program's (``program_backward.attention_backward``). ``dq_atomic``: the program
    has no dq; dkdv adds dq's share atomically (``_schedule_dq_share``) and convert_dq runs on SIMT."""
    simt.schedule_delta(sch)
    _schedule_dkdv(sch, dkdv_warps, dkdv_stages, vec, dq_atomic)
    if dq_atomic:
        simt.schedule_convert_dq(sch)
    else:
        _schedule_dq(sch, dq_warps, dq_stages, vec)
    return sch


def _schedule_dq(sch: tvm.s_tir.Schedule, num_warps: int, num_stages: int, vec: int) -> None:
    """dq on tensor cores, mapped as the forward is (dq's tile is the forward's: a Q block, the K/V
    blocks streamed past it). q kᵀ and dout vᵀ are the forward's qk (ldmatrix Q or dout as A, K or
    V as Bᵀ); p and ds stay in the mma accumulator layout, which is the A layout, so ds feeds
    dq += ds k (ldmatrix.trans K as B) from registers, as P feeds P V; dq accumulates in fragments
    across the K/V blocks and is stored from them; p, which feeds no mma, stays in each lane's
    registers. The rows' lse and delta sit in shared memory, one lane a row. ``num_stages``: the
    forward's K/V pipeline."""
    sch.work_on("dq")
    dtype, BM, D, BN = buffer_info(sch)
    if BM != WARP * num_warps or BN % 16 or D % 16:
        raise ValueError(f"knobs: the sm80 dq needs dq_block_m = 32 * dq_warps and dq_block_n, head_dim multiples "
                         f"of 16, got dq_block_m {BM}, dq_warps {num_warps}, dq_block_n {BN}, head_dim {D}")
    names = intrin_names(dtype)
    bind_grid(sch)
    _backward_step(sch, ("load_q", "load_do", "load_k", "load_v"), (), num_warps, vec, names)
    _accumulate(sch, "dq", num_warps, names)
    if num_stages > 1:
        pipeline_loads(sch, num_stages)


def _schedule_dkdv(sch: tvm.s_tir.Schedule, num_warps: int, num_stages: int, vec: int, dq_atomic: bool = False) -> None:
    """dkdv on tensor cores. Its tiles are key-first (sᵀ = k qᵀ, ...), so each warp owns 16 or
    more keys (rows) of the K/V block: it computes sᵀ and dpᵀ for its keys against the whole Q block
    (ldmatrix K or V as A, q or dout as Bᵀ), keeps pᵀ and dsᵀ in the mma accumulator layout, which
    is the A layout of pᵀ dout and dsᵀ q, and accumulates dv and dk for its keys in fragments across
    the Q blocks. The Q, dout, K and V tiles and the rows' lse and delta sit in shared memory; with
    ``num_stages`` 2 or 3, the Q and dout blocks and their rows' lse and delta of the next steps are
    loaded by cp.async while this one computes (the steps of all the group's query heads are one
    pipelined loop)."""
    sch.work_on("dkdv")
    dtype, BM, D, BN = buffer_info(sch)
    if BN % (16 * num_warps) or BM % 16 or D % 16:
        raise ValueError(f"knobs: the sm80 dkdv needs block_n a multiple of 16 * dkdv_warps and block_m, head_dim "
                         f"multiples of 16, got block_n {BN}, dkdv_warps {num_warps}, block_m {BM}, head_dim {D}")
    names = intrin_names(dtype)
    staged = dkdv_grid(sch, dq_atomic)  # dsᵀ's copy to shared memory with dq_atomic
    _backward_step(sch, ("load_k", "load_v", "load_q", "load_do"), ("cast_p",), num_warps, vec, names)
    if has_block(sch, "capture_gradient"):  # a learned capture's gradient: each lane its elements of dsᵀ
        fragment_elementwise(sch, "capture_gradient", num_warps)
        # the loops in each lane; 2: whole warps, so a warp whose runs end on one element adds once
        sch.annotate(sch.get_loops("capture_gradient")[-3], MERGED_ATOMIC_ADD_PRAGMA, 2)
    for name in ("dv", "dk"):  # dv += pᵀ dout, dk += dsᵀ q
        _accumulate(sch, name, num_warps, names)
    if dq_atomic:
        _schedule_dq_share(sch, staged, num_warps, names)
    if num_stages > 1:
        pipeline_loads(sch, num_stages, step="q_step", loads=("load_q", "load_do", "load_lse", "load_delta"))


def _schedule_dq_share(sch: tvm.s_tir.Schedule, staged, num_warps: int, names: dict) -> None:
    """dq's share of a dkdv step, ds k, added atomically into the fp32 dq (FA2's way). Each warp holds
    dsᵀ for its keys, but ds k sums over all the block's keys: the warps write dsᵀ to shared memory,
    and each then takes 16 or more query rows of ds k (ldmatrix.trans dsᵀ as A, ldmatrix K as B) and
    adds its fragments into global memory one element at a time (``ATOMIC_ADD_PRAGMA``). ``staged``:
    the copy of dsᵀ to shared memory (``cache_read`` of dq's A)."""
    D = buffer_info(sch)[2]
    block = sch.get_sblock("dq")
    sch.storage_align(staged, 0, axis=0, factor=D, offset=8)
    store_fragments(sch, staged, num_warps)
    sch.set_scope(block, 0, "warp")
    sch.transform_layout(block, ("write", 0), frag_index_map)
    warp_gemm_operands(sch, block, num_warps, [(1, names["ld_a_trans"]), (2, names["ld_b"])])
    sch.tensorize(sch.get_loops(block)[-3], names["mma_tn"])
    sch.tensorize(sch.get_loops("dq_init")[-2], names["fill"])
    store_fragments(sch, "accumulate_dq", num_warps, vector=False)
    # the loops in each lane; 2: a lane's two adjacent columns may go as one vector reduction (sm_90)
    sch.annotate(sch.get_loops("accumulate_dq")[-5], ATOMIC_ADD_PRAGMA, 2)


def _backward_step(sch: tvm.s_tir.Schedule, loads, casts, num_warps: int, vec: int, names: dict) -> None:
    """What dkdv and dq share: their tiles (``loads``, in this order) in shared memory, rows padded for
    ldmatrix without bank conflicts; the rows' lse and delta there too, one lane a row (each lane
    reads those of the rows or columns it holds); s and dp on mma.sync (ldmatrix A, Bᵀ), and p, ds
    and ``casts`` (dkdv: pᵀ in the input dtype) in the accumulator layout, each lane its elements.
    p feeds no mma: each lane keeps it in registers ("local"), which also keeps StorageRewrite from
    putting p in place of s (LowerWarpMemory cannot see through that)."""
    D = buffer_info(sch)[2]
    for name in loads:
        sch.set_scope(name, 0, "shared.dyn")
        sch.storage_align(name, 0, axis=0, factor=D, offset=8)
        copy_to_shared(sch, name, num_warps, vec)
    sch.set_scope("init_scale", 0, "local")
    for name in ("load_lse", "load_delta"):
        sch.set_scope(name, 0, "shared.dyn")
        row_block(sch, name, num_warps)
    for name in ("qk", "exp", "dp", "ds", *casts):
        sch.set_scope(name, 0, "local" if name == "exp" else "warp")
        sch.transform_layout(name, ("write", 0), frag_index_map)
    for name in ("qk", "dp"):  # the blockized GEMM reads: its output, then A, then B
        block = sch.get_sblock(name)
        warp_gemm_operands(sch, block, num_warps, [(1, names["ld_a"]), (2, names["ld_b_trans"])])
        sch.tensorize(sch.get_loops(block)[-3], names["mma_nt"])
        sch.tensorize(sch.get_loops(f"{name}_init")[-2], names["fill"])
    for name in ("exp", "ds", *casts):
        fragment_elementwise(sch, name, num_warps)


def _accumulate(sch: tvm.s_tir.Schedule, name: str, num_warps: int, names: dict) -> None:
    """A gradient's product (dq += ds k, dv += pᵀ dout, dk += dsᵀ q) on mma.sync: A from the registers
    that hold it (the accumulator layout is the A layout), B by ldmatrix, the gradient in fragments
    across the steps (its carried-over init is nothing to do on each lane's registers), zero-filled
    first and stored from the fragments. (Vectorised, the store fails LowerWarpMemory: "failed to
    rewrite load to shuffle".)"""
    sch.set_scope(name, 0, "warp")
    sch.transform_layout(name, ("write", 0), frag_index_map)
    block = sch.get_sblock(name)
    outer = warp_gemm_operands(sch, block, num_warps, [(1, None), (2, names["ld_b"])])
    for blk in (outer, block):
        hide_init_reads(sch, blk)
    sch.tensorize(sch.get_loops(block)[-3], names["mma_nn"])
    fragment_lanes(sch, f"{name}_init")
    fill_fragments(sch, f"init_{name}", num_warps, names["fill"])
    store_fragments(sch, f"store_{name}", num_warps, vector=False)
