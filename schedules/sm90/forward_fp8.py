"""The sm90 FP8 forward (``schedule_fp8``): FlashAttention-3's e4m3 forward on e4m3 wgmma (m64nNk32).

The program is the forward's with ``spec.fp8`` (``tvmflash.program_forward``): q, k e4m3, V e4m3 and
transposed (keys contiguous), the descales folded into the scale and the output's normalisation, the
output bf16. The mapping is the bf16 schedule's (``forward``), with what e4m3 wgmma asks for:
  * both shared-memory operands K-major (e4m3 wgmma has no transpose): Q and K in head_dim, V in the
    keys, which V's transposed layout gives as it is; every tile in padded core matrices of 8 rows x
    16 bytes (``layouts.fp8_core_matrix_map``), copied along its rows 16 bytes a thread by cp.async in a
    software pipeline of the K/V tiles (``num_stages``);
  * P as the A operand from registers: e4m3's A fragment holds other columns than S's accumulator
    (``layouts.fp8_a_index``), so the K tile's rows are permuted in shared memory
    (``layouts.fp8_key_row``) to make S's accumulator hold, in each thread, the keys that its A
    fragment wants: P is cast in place, as in bf16, and no shuffle moves it (FA3 permutes P's
    registers by shuffles instead, ``permute_Aregs_fp8``). The softmax's blocks run on S in that
    permuted layout (``layouts.fp8_acc_index_map``, ``bind_fp8_acc_threads``, ``fp8_acc_rows``);
  * the per-row state in registers, the output's rescale skipped under a warp vote, the output stored
    from the accumulator registers (bf16 pairs), as the bf16 schedule's defaults and ``o_store``
    "direct".
"""

from __future__ import annotations

import tvm

from tvmflash.lowering.annotations import SKIP_UNIT_RESCALE_PRAGMA

from ..common import bind_grid, buffer_info, hide_init_reads, pipeline_loads, scalars_local
from .forward import row_state_in_registers
from .knobs import fp8_problem
from .layouts import (acc_block, acc_index_map, bind_fp8_acc_threads, fp8_acc_block, fp8_acc_index_map,
                      fp8_acc_rows, fp8_core_matrix_map, fp8_key_row, fp8_p_index_map, fp8_tile_in_shared_memory,
                      split_warpgroups)
from .wgmma import fp8_wgmma_intrin_name, warpgroup_gemm


def schedule_fp8(sch: tvm.s_tir.Schedule, *, block_m: int, block_n: int, num_warpgroups: int, num_stages: int = 2,
                 min_blocks_per_sm: int = 1, kv_copy: str = "cp.async") -> tvm.s_tir.Schedule:
    """Map the FP8 forward program onto sm90's e4m3 wgmma. See the module docstring. (min_blocks_per_sm
    is a kernel attribute, ``knobs.kernel_attrs``: the caller puts it on the program.)"""
    dtype, BM, D, BN = buffer_info(sch)
    assert (BM, BN) == (block_m, block_n), "schedule knobs must match the program's tiles"
    problem = fp8_problem(D, dtype, {"block_m": block_m, "block_n": block_n, "num_warpgroups": num_warpgroups,
                                     "num_stages": num_stages, "min_blocks_per_sm": min_blocks_per_sm,
                                     "kv_copy": kv_copy})
    if problem:
        raise ValueError(problem)
    qk_intrin = fp8_wgmma_intrin_name(BN, D, a_regs=False, fence_operands=num_stages == 1)
    pv_intrin = fp8_wgmma_intrin_name(D, BN, a_regs=True)

    bind_grid(sch)

    # ---- Q, K (rows permuted) and V (transposed) tiles into shared memory ---------------------
    # (Q's plain copy zero-fills the rows past seqlen_q 4 bytes at a time: CUDA code generation
    # broadcasts e4m3 to 4 lanes at most)
    fp8_tile_in_shared_memory(sch, "load_q", num_warpgroups, fp8_core_matrix_map, vec=4)
    fp8_tile_in_shared_memory(sch, "load_k", num_warpgroups, lambda j, d: fp8_core_matrix_map(fp8_key_row(j), d))
    fp8_tile_in_shared_memory(sch, "load_v", num_warpgroups, None, transposed=True)

    # ---- qk: S = Q K^T on e4m3 wgmma, S in the permuted accumulator layout --------------------
    sch.set_scope("qk", 0, "local")
    sch.transform_layout("qk", ("write", 0), fp8_acc_index_map)
    rows = split_warpgroups(sch, sch.get_loops("qk")[-3], num_warpgroups)
    bind_fp8_acc_threads(sch, sch.decompose_reduction("qk", rows))
    sch.tensorize(rows, qk_intrin)

    # ---- P in e4m3, in the A fragment's registers (the same threads as S's) -------------------
    sch.set_scope("cast_p", 0, "local")
    sch.transform_layout("cast_p", ("write", 0), fp8_p_index_map)

    # ---- pv: acc += P V on e4m3 wgmma, acc in registers across K/V tiles ----------------------
    sch.set_scope("pv", 0, "local")
    sch.transform_layout("pv", ("write", 0), acc_index_map)
    pv = sch.get_sblock("pv")
    rows = warpgroup_gemm(sch, pv, num_warpgroups)  # pv_init: the rescale acc *= alpha
    hide_init_reads(sch, pv)
    sch.annotate(sch.get_loops("pv_init")[-3], SKIP_UNIT_RESCALE_PRAGMA, 1)
    sch.tensorize(rows, pv_intrin)

    acc_block(sch, "init_acc", num_warpgroups)
    acc_block(sch, "store_o", num_warpgroups)  # pairs of adjacent bf16 columns from the registers
    sch.vectorize(sch.get_loops("store_o")[-1])

    # ---- softmax on S's registers ---------------------------------------------------------------
    for name in ("score", "exp"):
        sch.set_scope(name, 0, "local")
        sch.transform_layout(name, ("write", 0), fp8_acc_index_map)
        fp8_acc_block(sch, name, num_warpgroups)
    scalars_local(sch)
    sch.set_scope("init_v_scale", 0, "local")  # V's descale, a scalar inv_l reads
    row_state_in_registers(sch, BN, num_warpgroups, rows=fp8_acc_rows, p_block=fp8_acc_block)
    # P's adjacent pairs of keys are adjacent registers of S and of the A fragment: one cvt (e4m3x2) a pair
    sch.vectorize(sch.get_loops("cast_p")[-1])
    if num_stages > 1:
        pipeline_loads(sch, num_stages)
    return sch
