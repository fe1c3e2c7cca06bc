"""sm80 tensor-core schedule (mma.sync m16n8k16 + ldmatrix + cp.async) for the attention program.

Mapping (FA2 style):
  * tile (b, h, qb) -> blockIdx.(z, y, x); num_warps warps (threadIdx.y), 32 lanes (threadIdx.x).
  * warp w owns rows [w*RW, (w+1)*RW) of the Q block, RW = block_m / num_warps.
  * qk: S = Q K^T with mma.sync (ldmatrix Q as A, ldmatrix K as B^T).
  * pv: acc += P V with mma.sync (ldmatrix P as A, ldmatrix.trans V as B).
  * K/V tiles: global -> shared with cp.async, num_stages-deep software pipeline over kv tiles.
"""

from __future__ import annotations

import tvm
from tvm.s_tir import TensorIntrin

WARP = 32


KNOBS = {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 1, "vec": 8}
# Tuning space (``tvmflash tune``): one MetaSchedule task per (block_m, block_n). A callable gives
# the candidates from the knobs before it: this version needs block_m == 32 * num_warps. Deeper
# pipelines (num_stages >= 2) are left out until they are validated on a GPU.
SPACE = {
    "block_m": [64, 128],
    "block_n": [32, 64, 128],
    "num_warps": lambda knobs: [knobs["block_m"] // WARP],
    "num_stages": [1],
    "vec": [8],
}
PASS_CONFIG = {
    "tirx.use_async_copy": True,
    # LowerWarpMemory cannot see through CSE'd store indices into warp buffers.
    "tirx.disable_cse_tir": True,
}
DTYPES = ("float16", "bfloat16")  # float32 has no exact tensor-core path: the SIMT schedule serves it


# --------------------------------------------------------------------------------------------
# intrinsics (imported lazily: importing tvm.s_tir.tensor_intrin.cuda takes a while)
# --------------------------------------------------------------------------------------------
_REGISTERED = False


def _register_intrinsics():
    """Register what TVM lacks: an mma store to shared.dyn, and bf16 twins of the fp16 intrinsics."""
    global _REGISTERED
    if _REGISTERED:
        return
    from tvm.s_tir.tensor_intrin import cuda as C

    def reg(name, pair):
        try:
            TensorIntrin.register(name, *pair)
        except Exception:  # already registered (module reloaded)
            pass

    reg("tvmflash_mma_store_16x16_f32_shared_dyn_simple",
        C.get_mma_store_intrin("float32", 8, "shared.dyn", False))
    # TVM generates fp16 ldmatrix/mma intrinsics only; the bf16 ones differ in the element type
    # and the PTX type name alone, so derive them from the fp16 descriptions.
    fp16 = {
        "ld_a": C.get_ldmatrix_intrin(16, "float16", "A", False, "shared.dyn"),
        "ld_b": C.get_ldmatrix_intrin(16, "float16", "B", False, "shared.dyn"),
        "ld_b_trans": C.get_ldmatrix_intrin(16, "float16", "B", True, "shared.dyn"),
        "mma_nn": C.get_mma_intrin(16, "float16", "float16", "float32", False, False),
        "mma_nt": C.get_mma_intrin(16, "float16", "float16", "float32", False, True),
    }
    for key, pair in fp16.items():
        reg(f"tvmflash_{key}_bf16", tuple(_as_bf16(f) for f in pair))
    _REGISTERED = True


def _as_bf16(func):
    text = func.script().replace('"float16"', '"bfloat16"').replace('"fp16"', '"bf16"')
    # The printer drops the result type of the ldmatrix/mma calls, and without it the parser
    # types them int8, which makes the code generator emit its int8 fallback for ldmatrix.trans.
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("T.ptx_legacy.ldmatrix(") and stripped.endswith(")"):
            line = line[: line.rindex(")")] + ', dtype="bfloat16")'
        elif stripped.startswith("T.ptx_legacy.mma(") and stripped.endswith(")"):
            line = line[: line.rindex(")")] + ', dtype="float32")'
        lines.append(line)
    return tvm.script.from_source("\n".join(lines))


def _intrin_names(dtype):
    if dtype == "float16":
        return dict(
            ld_a="mma_ldmatrix_f16_a_dyn",
            ld_b_trans="mma_ldmatrix_f16_b_trans_dyn",
            ld_b="mma_ldmatrix_f16_b_dyn",
            mma_nt="mma_f16f16f32_trans_b",
            mma_nn="mma_f16f16f32",
            fill="mma_fill_16x16_f32",
            store_s="tvmflash_mma_store_16x16_f32_shared_dyn_simple",
        )
    if dtype == "bfloat16":
        return dict(
            ld_a="tvmflash_ld_a_bf16",
            ld_b_trans="tvmflash_ld_b_trans_bf16",
            ld_b="tvmflash_ld_b_bf16",
            mma_nt="tvmflash_mma_nt_bf16",
            mma_nn="tvmflash_mma_nn_bf16",
            fill="mma_fill_16x16_f32",
            store_s="tvmflash_mma_store_16x16_f32_shared_dyn_simple",
        )
    raise ValueError(f"dtype: the sm80 schedule takes {DTYPES}, got {dtype!r}")


def _ldmatrix_layout(i, j):
    from tvm.s_tir.tensor_intrin.cuda import shared_16x16_to_ldmatrix_32x8_layout

    return shared_16x16_to_ldmatrix_32x8_layout(i, j)


def _frag_index_map(i, j):
    """(row, col) of a matrix -> (row tile, col tile, lane, register) of its mma fragments."""
    lane, reg = _ldmatrix_layout(i % 16, j % 16)
    return (i // 16, j // 16, lane, reg)


# --------------------------------------------------------------------------------------------
def _buffer_info(sch):
    qt = sch.get(sch.get_sblock("load_q")).writes[0].source
    kt = sch.get(sch.get_sblock("load_k")).writes[0].source
    return str(qt.dtype), int(qt.shape[0]), int(qt.shape[1]), int(kt.shape[0])


def _copy_to_shared(sch, block, num_warps, vec):
    """Cooperative vectorised copy: all num_warps*32 threads, vec elements each."""
    fused = sch.fuse(*sch.get_loops(block)[-2:])
    _, ty, tx, v = sch.split(fused, [None, num_warps, WARP, vec])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(v)


def _tile_frag(sch, block, h=16, w=16):
    a, b = sch.get_loops(block)[-2:]
    a0, a1 = sch.split(a, [None, h])
    b0, b1 = sch.split(b, [None, w])
    sch.reorder(a0, b0, a1, b1)
    return a1


def _row_block(sch, name, num_warps):
    """Per-row block: row i = w*RW + lane (one lane per row, RW == 32)."""
    i = sch.get_loops(name)[0]
    w, r = sch.split(i, [num_warps, None])
    sch.bind(w, "threadIdx.y")
    r0, r1 = sch.split(r, [None, WARP])
    sch.bind(r1, "threadIdx.x")
    return r0


def schedule(
    sch: tvm.s_tir.Schedule,
    *,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    vec: int,
) -> tvm.s_tir.Schedule:
    """Map the attention program onto sm80 tensor cores. See the module docstring."""
    _register_intrinsics()
    dtype, BM, D, BN = _buffer_info(sch)
    assert (BM, BN) == (block_m, block_n), "schedule knobs must match the program's tiles"
    RW = BM // num_warps
    assert RW % 16 == 0 and BN % 16 == 0 and D % 16 == 0
    assert RW == WARP, "this version maps one softmax row per lane: block_m == 32*num_warps"
    names = _intrin_names(dtype)

    # ---- grid -----------------------------------------------------------------------------
    b, h, qb = sch.get_loops("tile")
    sch.bind(qb, "blockIdx.x")
    sch.bind(h, "blockIdx.y")
    sch.bind(b, "blockIdx.z")

    # ---- Q, K, V tiles into (dynamic) shared memory ---------------------------------------
    for name in ("load_q", "load_k", "load_v"):
        sch.set_scope(name, 0, "shared.dyn")
        # 16-byte vectors (for K/V with num_stages >= 2, InjectPTXAsyncCopy makes them cp.async).
        _copy_to_shared(sch, name, num_warps, vec)

    # ---- qk: S = Q K^T on tensor cores, S kept as mma fragments ("warp" scope) -------------
    # S[i, j] -> S[i//16, j//16, lane, reg]: every reader of S (row_max, exp) follows.
    sch.set_scope("qk", 0, "warp")
    sch.transform_layout("qk", ("write", 0), _frag_index_map)
    # ---- S fragments -> shared (fragment layout) for the per-row softmax ------------------
    # A lane cannot read another lane's fragment element for its own row: LowerWarpMemory would
    # emit __shfl_sync with a *reader*-dependent register index (silently wrong). So S goes
    # through shared memory, copied lane-by-lane in its fragment layout.
    s_sh = sch.cache_read("row_max", 1, "shared.dyn", consumer_blocks=["row_max", "exp"])
    a0, a1, lane, reg = sch.get_loops(s_sh)
    w, a0 = sch.split(a0, [num_warps, None])
    sch.reorder(w, lane, a0, a1, reg)
    sch.bind(w, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")

    qk = sch.get_sblock("qk")
    i, j, d = sch.get_loops(qk)
    i0, i1 = sch.split(i, [None, 16])
    j0, j1 = sch.split(j, [None, 16])
    d0, d1 = sch.split(d, [None, 16])
    sch.reorder(i0, j0, d0, i1, j1, d1)
    qk_o = sch.blockize(i1)
    iw, im = sch.split(i0, [num_warps, None])
    sch.reorder(iw, d0, im, j0)
    sch.bind(iw, "threadIdx.y")
    sch.decompose_reduction(qk_o, d0)
    # The K/V-tile scope (kv_step) is not a "stage pipeline" (pv and update_m write acc and m
    # after other blocks read them), so compute_at cannot target loops directly under it.
    # Wrapping one warp's mma loop nest in its own block gives the fragment loads a scope that is.
    sch.blockize(d0)
    q_w = sch.cache_read(qk_o, 1, "warp")  # reads: S, Qt, Kt (the update reads S)
    k_w = sch.cache_read(qk_o, 2, "warp")
    sch.compute_at(q_w, d0)
    sch.compute_at(k_w, d0)
    lq = _tile_frag(sch, q_w)
    lk = _tile_frag(sch, k_w)
    sch.transform_layout(q_w, ("write", 0), _frag_index_map)
    sch.transform_layout(k_w, ("write", 0), _frag_index_map)
    sch.tensorize(lq, names["ld_a"])
    sch.tensorize(lk, names["ld_b_trans"])
    sch.tensorize(sch.get_loops(qk)[-3], names["mma_nt"])
    sch.tensorize(sch.get_loops("qk_init")[-2], names["fill"])

    sch.set_scope("cast_p", 0, "shared.dyn")  # Pc: ldmatrix source for pv
    # ---- pv: acc += P V on tensor cores, acc kept as fragments across K/V tiles ------------
    sch.set_scope("pv", 0, "warp")
    sch.transform_layout("pv", ("write", 0), _frag_index_map)
    pv = sch.get_sblock("pv")
    i, d, j = sch.get_loops(pv)
    i0, i1 = sch.split(i, [None, 16])
    d0, d1 = sch.split(d, [None, 16])
    j0, j1 = sch.split(j, [None, 16])
    sch.reorder(i0, d0, j0, i1, d1, j1)
    pv_o = sch.blockize(i1)
    iw, im = sch.split(i0, [num_warps, None])
    sch.reorder(iw, j0, im, d0)
    sch.bind(iw, "threadIdx.y")
    sch.decompose_reduction(pv_o, j0)  # pv_init: the rescale acc *= alpha, on fragments
    sch.blockize(j0)
    p_w = sch.cache_read(pv_o, 2, "warp")  # reads: acc, alpha (left over from the init), Pc, Vt
    v_w = sch.cache_read(pv_o, 3, "warp")
    sch.compute_at(p_w, j0)
    sch.compute_at(v_w, j0)
    lp = _tile_frag(sch, p_w)
    lv = _tile_frag(sch, v_w)
    sch.transform_layout(p_w, ("write", 0), _frag_index_map)
    sch.transform_layout(v_w, ("write", 0), _frag_index_map)
    sch.tensorize(lp, names["ld_a"])
    sch.tensorize(lv, names["ld_b"])
    # decompose_reduction leaves the init's read of alpha on the update blocks; drop it so the
    # update matches the mma description (reads C, A, B only).
    for blk in (pv_o, pv):
        reads = [str(r.source.name) for r in sch.get(blk).reads]
        if "alpha" in reads:
            sch.unsafe_hide_buffer_access(blk, "read", [reads.index("alpha")])
    sch.tensorize(sch.get_loops(pv)[-3], names["mma_nn"])
    # rescale: iterate the 16x16 tile as (lane, reg) and give lanes to threadIdx.x
    sch.transform_block_layout("pv_init", lambda i, d: _ldmatrix_layout(i, d))
    lane, reg = sch.get_loops("pv_init")[-2:]
    sch.bind(lane, "threadIdx.x")

    # init_acc on fragments
    i, d = sch.get_loops("init_acc")
    i0, i1 = sch.split(i, [None, 16])
    d0, d1 = sch.split(d, [None, 16])
    sch.reorder(i0, d0, i1, d1)
    iw, im = sch.split(i0, [num_warps, None])
    sch.bind(iw, "threadIdx.y")
    sch.tensorize(i1, names["fill"])

    # epilogue straight from the fragments. (transform_block_layout would be shorter but it
    # leaves store_o's T.where referring to the removed loop var: "variables (i,) are used, but
    # are not passed in as API arguments".)  Fragment (lane, reg) of a 16x16 tile is
    # i = 8h + r8, d = 8dh + 2q + e with lane = 4 r8 + q, reg = 4 dh + 2 h + e.
    i, d = sch.get_loops("store_o")
    w, mi, h, r8 = sch.split(i, [num_warps, None, 2, 8])
    d0, dh, q, e = sch.split(d, [None, 2, 4, 2])
    sch.reorder(w, r8, q, mi, d0, h, dh, e)
    sch.bind(w, "threadIdx.y")
    sch.bind(sch.fuse(r8, q), "threadIdx.x")

    # ---- softmax: one lane per row (scalar; reads S from shared) --------------------------
    for name in ("init_ml", "row_max", "exp", "alpha", "row_sum", "cast_p", "update_m", "store_lse"):
        _row_block(sch, name, num_warps)
    for name, idx in (("init_ml", 0), ("row_max", 0), ("exp", 0)):
        sch.set_scope(name, idx, "local")
    sch.set_scope("init_ml", 1, "shared.dyn")  # l: read by the fragment lanes in store_o
    sch.set_scope("alpha", 0, "shared.dyn")  # read by the fragment lanes in pv_init
    sch.set_scope("init_scale", 0, "local")

    # ---- K/V: cp.async, software pipeline over the K/V tiles --------------------------------
    if num_stages >= 2:
        kb = sch.get_loops("kv_step")[-1]
        # InjectSoftwarePipeline flattens the thread-bound loops: one entry per child block.
        stmts = len(sch.get_child_blocks(sch.get_sblock("kv_step")))
        stage = [0, 0] + [num_stages - 1] * (stmts - 2)
        sch.annotate(kb, "software_pipeline_stage", stage)
        sch.annotate(kb, "software_pipeline_order", list(range(stmts)))
        sch.annotate(kb, "software_pipeline_async_stages", [0])
    return sch

