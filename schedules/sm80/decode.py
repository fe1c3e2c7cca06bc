"""The sm80 decode (``tvmflash.program_decode``, built with tensor_cores=True) on tensor cores: a
task's rows (its GQA group's query heads times its query tokens) in 16-row mma tiles, one warp each,
so that the products cost a few mma.sync a K/V tile and the kernel is left to stream the cache."""

from __future__ import annotations

import tvm

from ..common import (has_block, hide_init_reads, pipeline_loads, quad_row_block, quad_row_init, row_quad_map, row_reduce_intrin,
                      staged_row_block, tensorize_row_reduce)
from ..simt import schedule_decode_merge
from .fragments import (copy_to_shared, fill_fragments, frag_index_map, frag_rows, fragment_elementwise, fragment_lanes,
                        row_block, store_fragments, warp_gemm_operands)
from .intrinsics import intrin_names
from .knobs import WARP, WARP_ROWS

# An FP8 cache: a thread converts 4 e4m3 elements at once, the widest TVM's CUDA code converts right (8
# becomes a bit copy of uint2 into uint4, not a conversion).
FP8_CONVERT_VEC = 4
# FP8_PIPELINE: with num_stages > 1 an FP8 cache's next K and V tiles are prefetched into registers (the
# program's "prefetched" byte_tiles form, two stages): a step converts the bytes it holds into the shared
# tiles, then loads the next tiles' bytes into the same registers, then computes while they arrive (so the
# loads wait for the conversion, and at most two tiles are in flight: FP8_FRAGMENTS does not).
# Where the two tiles' bytes would pass FP8_PREFETCH_BYTES a thread (head_dim 256 at block_n 32: 512), or
# with num_stages 1, no prefetch: each element is converted as it is read, and the tasks an SM runs at once
# hide the loads' latency.
FP8_PREFETCH_BYTES = 256
# FP8_FRAGMENTS (knob fp8_tiles "fragments"): the cache's bytes copied by cp.async into num_stages shared
# byte tiles (the program's "staged" byte_tiles form: zeroed past the keys by the predicated copies; rows
# padded by 16 bytes: a warp's 8 rows in 8 bank pairs), as the bf16 cache's tiles are, in half the shared
# bytes, and converted straight into the mma operands: each lane reads the byte pairs its B fragments hold
# (K's for S = Q Kᵀ, adjacent bytes; V's for P V, bytes of adjacent rows) and converts them in registers,
# FA3's way (``convert_to_fragments``): no converted tiles in shared memory, no barrier between a
# conversion and the products, and as many bytes in flight as the pipeline's stages hold.
FP8_COPY_VEC = 16  # bytes a cp.async copy moves


def fp8_byte_tiles(head_dim: int, knobs: dict, converts: bool = True) -> str:
    """The program's byte_tiles form for an FP8 cache: "staged" (knob fp8_tiles "fragments", num_stages > 1
    and the target ``converts`` e4m3 itself: where it does not, TVM computes a copy of e4m3 values in
    float32, no cp.async: FP8_FRAGMENTS), "prefetched" (a task's one warp (its 16 rows) holds the next K and
    V tiles' bytes: FP8_PIPELINE), or "" (each element converted as it is read)."""
    if knobs["num_stages"] > 1 and knobs.get("fp8_tiles") == "fragments" and converts:
        return "staged"
    if knobs["num_stages"] > 1 and 2 * knobs["block_n"] * head_dim <= FP8_PREFETCH_BYTES * WARP:
        return "prefetched"
    return ""


def byte_tiles_form(sch) -> str:
    """The program's byte_tiles form (``fp8_byte_tiles``): "staged" where dequant_k follows load_v,
    "prefetched" where it comes before, "" without byte tiles."""
    if not has_block(sch, "dequant_k"):
        return ""
    order = [str(sch.get(block).name_hint) for block in sch.get_child_blocks(sch.get_sblock("kv_step"))]
    return "staged" if order.index("load_v") < order.index("dequant_k") else "prefetched"


def convert_to_fragments(sch, name, intrin):
    """FP8_FRAGMENTS: block ``name`` (dequant_k or dequant_v) writes its tile as mma fragments ("warp" scope,
    ``frag_index_map``), 16 x 16 tiles converted by ``intrin`` (``intrinsics``' ld_b_trans_e4m3, ld_b_e4m3:
    each lane the byte pairs its fragment holds): the B operand of S = Q Kᵀ (of P V) with no ldmatrix. Every warp
    converts the whole tile (each holds its own fragments of it, as each loads them with ldmatrix
    otherwise)."""
    sch.set_scope(name, 0, "warp")
    j, d = sch.get_loops(name)[-2:]
    j0, j1 = sch.split(j, [None, 16])
    d0, d1 = sch.split(d, [None, 16])
    sch.reorder(j0, d0, j1, d1)
    sch.transform_layout(name, ("write", 0), frag_index_map)
    sch.tensorize(j1, intrin)


def convert_to_shared(sch, load, convert, warps):
    """An FP8 cache's tile: the threads read its e4m3 bytes FP8_CONVERT_VEC at a time (a warp 128
    consecutive bytes a load), convert them (cvt's e4m3x2 pairs) and store them in q's dtype to the shared
    tile, each thread the bytes it read; the loops unrolled, so that all the tile's loads are in flight at
    once. ``load`` into registers, then ``convert`` (byte tiles), or ``convert`` alone (None: it reads)."""
    if load is not None:
        sch.set_scope(load, 0, "local")
    for block in (load, convert) if load is not None else (convert,):
        fused = sch.fuse(*sch.get_loops(block)[-2:])
        chunks, ty, tx, vector = sch.split(fused, [None, warps, WARP, FP8_CONVERT_VEC])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.unroll(chunks)
        sch.vectorize(vector)


def schedule_decode(sch: tvm.s_tir.Schedule, *, block_n: int, num_stages: int, vec: int,
                    fp8_tiles: str = "registers") -> tvm.s_tir.Schedule:
    """Map the decode programs (functions ``split``, ``single`` and ``merge``) onto tensor cores.

    split (and single, the same with one split): one thread block per task, blockIdx.x = (sequence,
    K/V head), y = query block, z = split; one warp per 16 rows. As the forward (``forward.schedule``):
    the query rows and num_stages K/V tiles in padded shared rows (cp.async pipeline), S = Q Kᵀ
    and acc += P V with ldmatrix and mma.sync, the softmax on the fragments, the per-row values on
    the quads. The per-key running sums of P (``l_keys``) are fragments too, summed across the
    quads once, after the last tile. merge: SIMT, as ``simt.schedule_decode_merge``.

    An FP8 cache: each thread reads the cache's e4m3 bytes and converts them into the padded q-dtype tiles
    the ldmatrix loads read (``convert_to_shared``); with the program's prefetched byte tiles
    (``fp8_byte_tiles``: dequant_k, dequant_v) the next tiles' bytes are prefetched into registers
    (FP8_PIPELINE); with its staged ones (fp8_tiles "fragments") the bytes come by cp.async and are
    converted into the mma fragments (FP8_FRAGMENTS, ``convert_to_fragments``). fp8_tiles reaches the
    schedule through the program's form (``fp8_byte_tiles``, the kernel's choice).
    """
    for func in [gv.name_hint for gv in sch.mod.functions if gv.name_hint in ("split", "single")]:
        sch.work_on(func)
        names = intrin_names(str(sch.get(sch.get_sblock("load_q")).writes[0].source.dtype))
        fp8 = has_block(sch, "init_value_scale")  # an FP8 cache (load_k and load_v convert its e4m3 bytes)
        rows, head_dim = (int(x) for x in sch.get(sch.get_sblock("load_q")).writes[0].source.shape)
        warps = rows // WARP_ROWS
        b, hk, qb, s = sch.get_loops("tile")
        sch.bind(sch.fuse(b, hk), "blockIdx.x")
        sch.bind(qb, "blockIdx.y")
        sch.bind(s, "blockIdx.z")
        sch.set_scope("init_scale", 0, "local")
        sch.set_scope("split_range", 0, "local")
        if fp8:
            sch.set_scope("init_value_scale", 0, "local")

        form = byte_tiles_form(sch)  # (the kernel's choice: fp8_byte_tiles)
        byte_tiles = form == "prefetched"  # (FP8_PIPELINE)
        fragments = form == "staged"  # (FP8_FRAGMENTS) the bytes by cp.async
        if fragments:
            for name in ("load_k", "load_v"):
                sch.set_scope(name, 0, "shared.dyn")
                # a lane's byte pairs of 8 rows in 8 bank pairs
                sch.storage_align(name, 0, axis=0, factor=head_dim, offset=FP8_COPY_VEC)
                copy_to_shared(sch, name, warps, FP8_COPY_VEC)
        converted = () if fragments else ("dequant_k", "dequant_v") if form else ("load_k", "load_v")
        if fragments:
            convert_to_fragments(sch, "dequant_k", names["ld_b_trans_e4m3"])  # (K's tile is stored (n, k))
            convert_to_fragments(sch, "dequant_v", names["ld_b_e4m3"])
        for name in ("load_q", *converted):
            sch.set_scope(name, 0, "shared.dyn")
            sch.storage_align(name, 0, axis=0, factor=head_dim, offset=8)  # ldmatrix's 8 rows in 8 bank groups
            if byte_tiles and name != "load_q":
                convert_to_shared(sch, name.replace("dequant", "load"), name, warps)
            elif fp8 and name != "load_q":
                convert_to_shared(sch, None, name, warps)
            else:
                copy_to_shared(sch, name, warps, vec)

        # Per-row values in each quad's registers (row_quad_map), as the forward's row_state "registers".
        for name, index in (("init_m", 0), ("row_max", 0), ("alpha", 0), ("alpha", 1), ("row_sum", 0),
                            ("inv_l", 0)):
            sch.set_scope(name, index, "local")
            sch.transform_layout(name, ("write", index), row_quad_map)
        # Tiles of (rows, keys) and the accumulator as mma fragments.
        for name in ("qk", "score", "exp", "cast_p", "init_l", "sum_p", "pv"):
            sch.set_scope(name, 0, "warp")
            sch.transform_layout(name, ("write", 0), frag_index_map)

        qk = sch.get_sblock("qk")
        k_operand = None if fragments else names["ld_b_trans"]  # (None: fragments already)
        warp_gemm_operands(sch, qk, warps, [("Qt", names["ld_a"]), ("Kt", k_operand)])
        sch.tensorize(sch.get_loops(qk)[-3], names["mma_nt"])
        sch.tensorize(sch.get_loops("qk_init")[-2], names["fill"])
        for name in ("score", "exp", "cast_p", "init_l", "sum_p", "update_l"):
            fragment_elementwise(sch, name, warps)
        tensorize_row_reduce(sch, "row_max", row_reduce_intrin("max", frag_rows(WARP_ROWS, block_n), "local"),
                             warps, WARP, quad_row_init(sch))
        tensorize_row_reduce(sch, "row_sum", row_reduce_intrin("sum", frag_rows(WARP_ROWS, block_n), "local"),
                             warps, WARP, quad_row_init(sch))

        pv = sch.get_sblock("pv")
        v_operand = None if fragments else names["ld_b"]
        pv_o = warp_gemm_operands(sch, pv, warps, [("Pc", None), ("Vt", v_operand)])
        for block in (pv_o, pv):
            hide_init_reads(sch, block)
        sch.tensorize(sch.get_loops(pv)[-3], names["mma_nn"])
        fragment_lanes(sch, "pv_init")  # the rescale
        fill_fragments(sch, "init_acc", warps, names["fill"])
        store_fragments(sch, "store_o", warps)

        for name in ("init_m", "alpha", "update_m", "inv_l"):
            quad_row_block(sch, name, warps)
        staged_row_block(sch, "store_lse", warps, lambda sch, name: row_block(sch, name, warps))
        if byte_tiles:  # an FP8 cache's next tiles' bytes prefetched into registers (FP8_PIPELINE)
            pipeline_loads(sch, 2, async_loads=False, ahead=("dequant_k", "dequant_v"))
        elif num_stages > 1 and (fragments or not fp8):  # (an FP8 cache's: FP8_FRAGMENTS)
            pipeline_loads(sch, num_stages)
    schedule_decode_merge(sch)
    return sch
