"""CUDA builds on a machine with no GPU: the generated source, and (where nvcc exists) its cubin."""

import itertools
import re
import shutil
import subprocess

import pytest
import tvm

import tvmflash
from conftest import kv_loop_body
from tvmflash.lowering import annotations, pipeline, tma

# A pointer into dynamic shared memory in the generated CUDA: its element type and index.
_TILE_POINTER = r"\(\(&\(\(\((\w+)\*\)buf_dyn_shmem_ptr\)\[([^\]]*)\]\)\)"
_ELEMENT_BYTES = {"nv_bfloat16": 2, "half": 2}
# tvmflash_wgmma_descriptor(&buffer[start], offset, LBO, SBO, layout): the element type, the operand's
# buffer's start (in elements), its offset from there in 16-byte units, the strides in 16-byte units,
# the layout type
_DESCRIPTOR = re.compile(r"tvmflash_wgmma_descriptor" + _TILE_POINTER + r", (.*?), (\d+), (\d+), (\d)\)")


def descriptors(src):
    """(element offset expression, LBO, SBO, layout) of each wgmma descriptor in a CUDA source."""
    return [(f"({start}) + ({offset}) * {16 // _ELEMENT_BYTES[element]}", lbo, sbo, layout)
            for element, start, offset, lbo, sbo, layout in _DESCRIPTOR.findall(src)]


def element_offsets(offset):
    """The values an element offset expression of the CUDA source takes with every variable at 0, 1,
    ..., 5 (integers, operators, max and min only)."""
    expression = re.sub(r"\b(?!max\b|min\b)[A-Za-z_][\w.]*", "{0}", offset.replace("(int)", ""))
    return [eval(expression.format(step), {"__builtins__": {}, "max": max, "min": min}) for step in range(6)]  # noqa: S307


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_source_builds(arch, dtype):
    kernel = tvmflash.compile(head_dim=128, dtype=dtype, causal=True, target=arch)
    src = kernel.source(heads_q=8, heads_kv=2)
    assert '__global__ void' in src and "__shared__" in src
    assert kernel.info()["target"] == {"sm80": "cuda sm_80", "sm90": "cuda sm_90a"}[arch]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_cuda_source_compiles_with_nvcc(arch, dtype):
    from tvm.support import nvcc

    kernel = tvmflash.compile(head_dim=64, dtype=dtype, target=arch)
    with kernel.target:
        cubin = nvcc.compile_cuda(kernel.source(heads_q=4, heads_kv=4), target_format="cubin",
                                  arch=str(kernel.target.attrs["arch"]), compiler="nvcc")
    assert len(cubin) > 1000


def test_target_forms():
    for target in ["sm90", {"kind": "cuda", "arch": "sm_90a"}, tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})]:
        kernel = tvmflash.compile(head_dim=64, dtype="float16", target=target)
        assert kernel.info()["target"] == "cuda sm_90a"


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensor_core_schedule_emits_mma_and_ldmatrix(monkeypatch, arch, dtype):
    monkeypatch.setenv("TVMFLASH_SM90", "0")  # the sm80 schedule, also on sm_90a
    kernel = tvmflash.compile(head_dim=64, dtype=dtype, target=arch)
    src = kernel.source(heads_q=2, heads_kv=1)
    assert kernel.info()["schedule"] == "sm80"
    ptx_type = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32" in src
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in src
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in src  # V, transposed on load
    # The softmax runs on the fragments: rows reduced across each quad of lanes by shuffles, and
    # P handed to the PV mma from registers (ldmatrix loads Q, K and V only: 3 call sites in the
    # K/V step; Q fragments are re-read from shared memory each step, as in FA2). The
    # cp.async pipeline (num_stages > 1) repeats the K/V step's compute once in its epilogue.
    copies = 1 if kernel.knobs["num_stages"] == 1 else 2
    assert src.count("__shfl_xor_sync(__activemask()") == 2 * copies  # row max, row sum
    assert src.count('"ldmatrix.sync.aligned') == 3 * copies


def test_float32_uses_the_simt_schedule():
    kernel = tvmflash.compile(head_dim=64, dtype="float32", target="sm90")
    assert kernel.info()["schedule"] == "cuda"
    assert "mma.sync" not in kernel.source(heads_q=2, heads_kv=2)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("num_stages", [2, 3])
def test_sm80_pipelined_kv_loads_use_cp_async(num_stages):
    """num_stages > 1: K/V tiles are copied with cp.async, num_stages - 1 tiles ahead, into
    num_stages shared buffers; the source compiles for sm_80 and sm_90a."""
    from tvm.support import nvcc

    kernel = tvmflash.compile(head_dim=64, dtype="bfloat16", causal=True, target="sm80",
                              knobs={"num_stages": num_stages})
    src = kernel.source(heads_q=4, heads_kv=2)
    assert "cp.async.cg.shared.global" in src and "cp.async.commit_group" in src
    # At the top of the steady-state loop, before the step's own copies are issued: wait until all
    # but the num_stages - 2 newest copies are done (passes.OneBarrierPerPipelinedStep).
    assert f"cp.async.wait_group {num_stages - 2};" in src
    assert ("& 1)" if num_stages == 2 else "% 3)") in src  # the buffer version of a K/V tile
    for arch in ("sm_80", "sm_90a"):
        with tvm.target.Target({"kind": "cuda", "arch": arch}):
            cubin = nvcc.compile_cuda(src, target_format="cubin", arch=arch, compiler="nvcc")
        assert len(cubin) > 1000


def test_sm80_rejects_unknown_num_stages():
    with pytest.raises(ValueError, match="num_stages"):
        tvmflash.compile(head_dim=64, dtype="float16", target="sm80", knobs={"num_stages": 4}).source(1, 1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sm90_wgmma_schedule_serves_sm_90a(monkeypatch, dtype):
    """On sm_90a the wgmma schedule serves (with no tuning records that favour sm80), emits wgmma,
    not mma.sync, and nvcc compiles it for sm_90a. TVMFLASH_SM90=0 keeps sm80; 1 does not take it
    to other targets."""
    monkeypatch.setenv("TVMFLASH_SM90", "0")
    assert tvmflash.compile(head_dim=64, dtype=dtype, target="sm90").info()["schedule"] == "sm80"
    monkeypatch.delenv("TVMFLASH_SM90")
    assert tvmflash.compile(head_dim=64, dtype=dtype, target="sm90").info()["schedule"] == "sm90"
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    assert tvmflash.compile(head_dim=64, dtype=dtype, target="sm80").info()["schedule"] == "sm80"
    kernel = tvmflash.compile(head_dim=128, dtype=dtype, causal=True, target="sm90")
    assert kernel.info()["schedule"] == "sm90"
    src = kernel.source(heads_q=4, heads_kv=2)
    ptx_type = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    assert f"wgmma.mma_async.sync.aligned.m64n64k16.f32.{ptx_type}.{ptx_type}" in src  # S = Q K^T
    assert f"wgmma.mma_async.sync.aligned.m64n128k16.f32.{ptx_type}.{ptx_type}" in src  # O += P V
    assert "wgmma.wait_group.sync.aligned" in src and "mma.sync" not in src
    if shutil.which("nvcc") is not None:
        from tvm.support import nvcc

        with kernel.target:
            cubin = nvcc.compile_cuda(src, target_format="cubin", arch="sm_90a", compiler="nvcc")
        assert len(cubin) > 1000


def test_sm90_accumulator_layout_matches_cutlass():
    """schedules.sm90's wgmma accumulator layout against an independent statement of it: CUTLASS's
    CLayout_64xN = ((4,8,4),(2,2,N/8)):((128,1,16),(64,8,512)), (thread, value) -> m + 64 n."""
    from tvmflash.schedules.sm90 import layouts

    for n in (8, 64, 136, 256):
        seen = set()
        for thread in range(128):
            for reg in range(n // 2):
                index = ((thread % 4) * 128 + (thread // 4 % 8) + (thread // 32) * 16
                         + (reg % 2) * 64 + (reg // 2 % 2) * 8 + (reg // 4) * 512)
                row, col = index % 64, index // 64
                assert layouts.acc_matrix(thread, reg) == (row, col)
                assert layouts.acc_layout(row, col) == (thread, reg)
                seen.add((row, col))
        assert len(seen) == 64 * n


def test_sm90_rs_a_registers_match_cutlass():
    """The PV wgmma takes P from registers ("rs" form) as it is: for its k16 slice ks, A value v
    of thread t is accumulator register 8 ks + v of S (``wgmma._wgmma_desc_impl``'s impl_rs packs values
    2r, 2r + 1 into 32-bit A register 4 ks + r). Against an independent statement of the A layout:
    CUTLASS's ALayout_64x16 = ((4,8,4),(2,2,2)):((128,1,16),(64,8,512)), (thread, value) -> m + 64 k.
    (Which half of a 32-bit register holds value 2r is the PTX packing rule, left to the GPU check.)"""
    from tvmflash.schedules.sm90 import layouts

    for n in (64, 128):
        for ks in range(n // 16):
            for t in range(128):
                for v in range(8):
                    index = ((t % 4) * 128 + (t // 4 % 8) + (t // 32) * 16
                             + (v % 2) * 64 + (v // 2 % 2) * 8 + (v // 4) * 512)
                    m, k = index % 64, index // 64
                    assert layouts.acc_layout(m, 16 * ks + k) == (t, 8 * ks + v)


def test_sm90_softmax_on_accumulator_registers(monkeypatch):
    """The sm90 softmax works on the wgmma accumulator registers: row max and row sum are quad
    xor shuffles, P goes to the PV wgmma from registers (the "rs" form: four 32-bit A registers,
    then the B descriptor), and S is never stored to shared memory."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    # one K/V stage: the pipelined build has the K/V step twice (its loop and its epilogue)
    kernel = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90",
                              knobs={"num_stages": 1, "kv_copy": "cp.async"})
    src = kernel.source(heads_q=2, heads_kv=1)
    # row max and row sum: xor 1 and 2 for each of a thread's two rows, into its registers
    assert src.count("__shfl_xor_sync") == 8
    assert "wgmma_bf16_rs_mma_async_sync_aligned_m64n128k16" in src  # O += P V, P in registers
    assert "wgmma_bf16_ss_mma_async_sync_aligned_m64n64k16" in src  # S = Q K^T
    assert "((uint*)Pc_local_ptr)[" in src  # bf16 pairs of P as the A registers
    # S is read only by the mask, into registers (condval or Sm_local): no copy to shared memory
    reads_of_s = [line.lstrip() for line in src.splitlines() if "= S_local_ptr[" in line]
    assert reads_of_s and all(line.startswith(("condval", "Sm_local_ptr[")) for line in reads_of_s)


def test_row_reduce_layouts_cover_their_tiles():
    """common.row_reduce_intrin's layouts (sm80 mma fragments, sm90 wgmma accumulators): the
    elements a thread reduces for its k-th row are exactly that row's elements it holds."""
    from tvmflash.schedules import sm80, sm90
    from tvmflash.schedules.sm90 import layouts as sm90_layouts

    def check(layout, owner):  # owner(r, c) -> (thread, buffer index) of element (r, c)
        seen, slots = set(), set()
        for t in range(layout.threads):
            for rt, h in itertools.product(range(layout.row_tiles), range(2)):
                k = 2 * rt + h
                row = layout.row(t, k)
                assert layout.row_slot(t, k) == (row // 8, row % 8)
                slots.add((t, row))
                for ct, half, e in itertools.product(range(layout.col_tiles), range(2), range(2)):
                    index = tuple(layout.held(t, rt, h, ct, half, e))
                    matches = [c for c in range(layout.n_cols) if owner(row, c) == (t, index)]
                    assert len(matches) == 1, (t, rt, h, ct, half, e)
                    seen.add((row, matches[0]))
        assert len(seen) == layout.n_rows * layout.n_cols
        assert len(slots) == layout.threads * layout.rows_per_thread  # a thread's rows are distinct

    def frag_owner(r, c):  # (row tile, col tile, lane, register): lane is the thread
        index = tuple(int(v) for v in sm80._frag_index_map(r, c))
        return index[2], index

    check(sm80.frag_rows(32, 64), frag_owner)
    acc = sm90.acc_rows(64)
    check(acc, lambda r, c: (sm90_layouts.acc_layout(r, c)[0], (sm90_layouts.acc_layout(r, c)[1],)))
    # One intrinsic for both layouts and both outputs (shared memory, the quads' registers).
    from tvm.s_tir import TensorIntrin
    from tvmflash.schedules import common

    for layout in (sm80.frag_rows(32, 64), acc):
        for out_scope in ("shared.dyn", "local"):
            TensorIntrin.get(common.row_reduce_intrin("sum", layout, out_scope))


def test_knobs_fit_the_targets_shared_memory():
    """sm86 allows 99 KiB of shared memory a block: the default two-stage K/V pipeline at d128
    needs more, so compile() drops to one stage (and says so); knobs the caller gives that do not
    fit are a clear error, not a failed launch."""
    kernel = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm86")
    assert kernel.knobs["num_stages"] == 1 and "shrunk to fit shared memory" in kernel.info()["knobs_source"]
    assert tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm80").knobs["num_stages"] == 2  # 163 KiB
    with pytest.raises(ValueError, match="KiB of shared memory, cuda sm_86 allows 99 KiB"):
        tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm86", knobs={"num_stages": 3})


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", ["sm80", "sm90"])
def test_pipelined_kv_step_waits_for_its_tile_first(monkeypatch, schedule, causal):
    """With the K/V loads pipelined (2 stages), each K/V step begins with the wait for its own
    tile (on sm90 with fence.proxy.async after it, so wgmma sees the cp.async writes) and one
    barrier, and only then issues the next tile's copies: one __syncthreads a step. TVM's order
    (barrier, copies, wait, barrier) has two, and on sm90 the fence then also waits for the copies
    just issued (passes.OneBarrierPerPipelinedStep)."""
    monkeypatch.setenv("TVMFLASH_SM90", "1" if schedule == "sm90" else "0")
    knobs = {"num_stages": 2, **({"kv_copy": "cp.async"} if schedule == "sm90" else {})}
    kernel = tvmflash.compile(head_dim=64, dtype="bfloat16", causal=causal, target=schedule, knobs=knobs)
    src = kernel.source(heads_q=2, heads_kv=2)
    body = [line.strip() for line in kv_loop_body(src).splitlines() if line.strip()]
    wait = "tvmflash_cp_async_wait_group_0_proxy_fence();" if schedule == "sm90" else \
        "tvm_builtin_ptx_cp_async_wait_group_async_wait_group_0();"
    first = next(i for i, line in enumerate(body) if not line.startswith("int "))  # past the loop's let variables
    assert body[first:first + 2] == [wait, "__syncthreads();"]
    assert body.count("__syncthreads();") == 1
    copies = [i for i, line in enumerate(body) if "cp_async" in line and "wait" not in line]
    assert copies and min(copies) > first + 1
    if schedule == "sm90":
        assert 'asm volatile("cp.async.wait_group 0;\\n\\tfence.proxy.async.shared::cta;"' in src
        assert min(i for i, line in enumerate(body) if "mma_async" in line) > max(copies)


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_kv_step_fences_for_wgmma_once(monkeypatch, causal):
    """QK^T's operands are made visible to wgmma by the pipeline's wait, fence and barrier alone:
    the intrinsic adds no barrier of its own (one __syncthreads a step, as
    test_pipelined_kv_step_waits_for_its_tile_first checks). With one stage (plain stores) the
    intrinsic fences and syncs itself."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    pipelined = tvmflash.compile(head_dim=128, dtype="bfloat16", causal=causal, target="sm90",
                                 knobs={"num_stages": 2, "kv_copy": "cp.async"}).source(heads_q=2, heads_kv=2)
    assert kv_loop_body(pipelined).count("__syncthreads();") == 1
    plain = tvmflash.compile(head_dim=128, dtype="bfloat16", causal=causal, target="sm90",
                             knobs={"num_stages": 1, "kv_copy": "cp.async"}).source(heads_q=2, heads_kv=2)
    body = [line.strip() for line in kv_loop_body(plain).splitlines()]
    fence = body.index("tvm_builtin_ptx_fence_proxy_proxy_async_shared__cta();")
    assert body[fence + 1] == "__syncthreads();"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_core_matrices_are_padded_and_copied_along_rows(monkeypatch, head_dim):
    """Q/K/V tiles: core matrices 144 bytes apart along a row (the descriptors' K-major LBO is 9
    16-byte units, an 8-row group of head_dim/8 core matrices the SBO), and each 16-byte copy
    goes to row threadIdx.x // (head_dim/8), so 8 threads copy 128 contiguous bytes of a row:
    whole sectors, spread over the banks (schedules.sm90.layouts.pad_core_matrix_stride)."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    src = tvmflash.compile(head_dim=head_dim, dtype="bfloat16", target="sm90",
                           knobs={"kv_layout": "core_matrices", "num_stages": 1, "kv_copy": "cp.async"}
                           ).source(heads_q=2, heads_kv=2)
    chunks = head_dim // 8
    strides = {(lbo, sbo) for _, lbo, sbo, layout in descriptors(src) if layout == "0"}
    assert ("9", str(9 * chunks)) in strides  # Q, K: LBO 144 bytes, SBO 8 rows of padded core matrices
    assert (str(9 * chunks), "9") in strides  # V (N-major): the same strides, the other way round
    copies = [line for line in src.splitlines()
              if "tvmflash_cp_async" in line or line.strip().startswith("*(uint4*)(((nv_bfloat16*)buf_dyn")]
    assert copies and all(f"(((int)threadIdx.x) & {chunks - 1}) * 72)" in line for line in copies)


@pytest.mark.parametrize("head_dim,block_n", [(64, 128), (128, 64)])
@pytest.mark.parametrize("num_stages", [1, 2])
def test_sm90_kv_tiles_are_swizzled(monkeypatch, head_dim, block_n, num_stages):
    """The default K/V layout is the 128-byte swizzled one: QK^T's K descriptors have layout type 1,
    LBO 1 (unused) and SBO 64 (8 rows of 128 bytes) and start 0, 16, 32 or 48 elements into a
    1024-byte-aligned group of 8 rows; PV's V descriptors LBO = one 64-column half (block_n rows
    of 128 bytes), SBO 64, each k16 slice 16 rows (1024 elements) on. The copies still go 16
    bytes a thread along the rows. Q keeps padded core matrices (LBO 9, SBO 9 * head_dim / 8)."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    kernel = tvmflash.compile(head_dim=head_dim, dtype="bfloat16", target="sm90",
                              knobs={"num_stages": num_stages, "kv_copy": "cp.async"})
    assert kernel.knobs["kv_layout"] == "swizzled" and kernel.knobs["block_n"] == block_n
    src = kernel.source(heads_q=2, heads_kv=2)
    # layout type 1 (bits 62-63): 128-byte swizzle
    swizzled = [(offset, lbo, sbo) for offset, lbo, sbo, layout in descriptors(src) if layout == "1"]
    k_tiles = [offset for offset, lbo, sbo in swizzled if (lbo, sbo) == ("1", "64")]
    v_tiles = [offset for offset, lbo, sbo in swizzled if (lbo, sbo) == (str(block_n * 64 // 8), "64")]
    assert len(k_tiles) + len(v_tiles) == len(swizzled) and k_tiles and v_tiles
    for offsets, within_rows in ((k_tiles, {0, 16, 32, 48}), (v_tiles, {0})):
        for offset in offsets:  # at every stage (each variable at 0, 1, ..., 5): 1024-byte aligned
            elements = element_offsets(offset)
            assert elements and all(e % 512 in within_rows for e in elements), offset
    assert re.search(rf"tvmflash_wgmma_descriptor\(.*?, 9, {9 * head_dim // 8}, 0\)", src)  # Q: padded core matrices


@pytest.mark.parametrize("columns,bits", [(64, 3), (32, 2)])
def test_swizzled_map_is_the_hardware_swizzle(columns, bits):
    """layouts.swizzled_map puts element (r, c) of a 16-bit tile where the 128-byte (64 columns) or 64-byte
    (32) swizzle of TMA and wgmma does, CUTLASS's Swizzle<bits, 4, 3> of its row-major offset within
    a column group: the 16-byte chunk (bits 4 and up) XOR the 128-byte line (bits 7 and up)."""
    from tvmflash.schedules.sm90.layouts import swizzled_map

    rows = 16
    for r, c in itertools.product(range(rows), range(2 * columns)):
        group, row, chunk, element = swizzled_map(r, c, columns)  # plain ints in, plain ints out
        logical = (r * columns + c % columns) * 2  # bytes into the group, row-major
        swizzled = logical ^ (((logical >> 7) & (2 ** bits - 1)) << 4)
        assert (group, row) == (c // columns, r) and (chunk * 8 + element) * 2 + row * columns * 2 == swizzled


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_d96_tiles_take_the_64_byte_swizzle(monkeypatch, causal):
    """head_dim 96 is no multiple of 64: swizzled K/V tiles take the 64-byte swizzle, rows of 32
    columns (layout type 2). QK^T's K descriptors: LBO 1 (unused), SBO 32 (8 rows of 64 bytes), each
    0 or 16 elements into a 512-byte-aligned group of 8 rows; PV's V descriptors: LBO one 32-column
    group (block_n rows of 64 bytes), SBO 32. TMA copies each tile whole on the stage's barrier."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    kernel = tvmflash.compile(head_dim=96, dtype="bfloat16", causal=causal, target="sm90",
                              knobs={"kv_layout": "swizzled", "kv_copy": "tma", "num_stages": 2})
    src = kernel.source(heads_q=4, heads_kv=2)
    block_n = kernel.knobs["block_n"]
    assert not [d for d in descriptors(src) if d[3] == "1"]
    swizzled = [(offset, lbo, sbo) for offset, lbo, sbo, layout in descriptors(src) if layout == "2"]
    k_tiles = [offset for offset, lbo, sbo in swizzled if (lbo, sbo) == ("1", "32")]
    v_tiles = [offset for offset, lbo, sbo in swizzled if (lbo, sbo) == (str(block_n * 32 // 8), "32")]
    assert len(k_tiles) + len(v_tiles) == len(swizzled) and k_tiles and v_tiles
    for offsets, within_rows in ((k_tiles, {0, 16}), (v_tiles, {0})):
        for offset in offsets:
            elements = element_offsets(offset)
            assert elements and all(e % 256 in within_rows for e in elements), offset
    body = kv_loop_body(src)
    assert "cp_async" not in body and re.search(rf"tvmflash_mbarrier_expect_tx\(.*?, {2 * block_n * 96 * 2}\);", body)


def test_tensor_maps_of_the_64_byte_swizzle():
    """A tile in rows of 32 columns (d96) is copied through a (32 elements, row, 32-column group, head,
    batch) view with CU_TENSOR_MAP_SWIZZLE_64B."""
    import types

    from tvm import tirx
    from tvm.script import tirx as T

    buffer = tirx.decl_buffer((4, tirx.Var("seqlen_k", "int32"), 2, 96), "bfloat16", "K")
    plan = types.SimpleNamespace(tensor_maps={buffer: (tirx.Var("K_tensormap", ty=T.handle("tensormap").ty), (32, 64, 3))})
    _, encode = tma._encode_tensor_maps(plan)
    dims, group_stride = encode.value.args[2:7], encode.value.args[8]
    assert [str(d) for d in dims] == ["32", "seqlen_k", "3", "2", "4"] and int(group_stride) == 64
    assert "swizzle=2" in str(encode.value)


@pytest.mark.parametrize("dtype,pair", [("bfloat16", "nv_bfloat162"), ("float16", "half2")])
def test_sm90_output_goes_out_through_shared_memory(monkeypatch, dtype, pair):
    """The accumulator threads write the output tile to shared memory in pairs of adjacent columns
    (one 32-bit store each), and the tile goes to global memory in 16-byte row pieces: no 2-byte
    stores to O (schedules.sm90.forward._store_o_through_shared_memory)."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    src = tvmflash.compile(head_dim=128, dtype=dtype, target="sm90").source(heads_q=2, heads_kv=2)
    to_global = [line.strip() for line in src.splitlines() if "O_ptr" in line and "=" in line and "__global__" not in line]
    assert to_global and all(line.startswith("*(uint4*)(O_ptr + ") for line in to_global)
    assert f"*({pair}*)(((" in src  # the pairs into the shared tile


def _tile_loops(scheduled_tir: str) -> list[str]:
    """The tile's thread-block loops of a scheduled program, outermost first."""
    return [line.strip() for line in scheduled_tir.splitlines() if 'thread="blockIdx.' in line]


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_causal_tiles_start_heaviest_first(monkeypatch, arch):
    """Causal: heads along blockIdx.x and the Q blocks along blockIdx.y, last to first, so the Q
    blocks with the most K/V tiles start first (schedules.common.bind_grid). Non-causal keeps a
    head's Q blocks along blockIdx.x."""
    monkeypatch.setenv("TVMFLASH_SM90", "1" if arch == "sm90" else "0")
    causal = _tile_loops(tvmflash.compile(head_dim=64, dtype="float16", causal=True, target=arch).scheduled_tir(4))
    assert len(causal) == 3
    assert "blockIdx.z" in causal[0] and "tvmflash.reversed" not in causal[0]
    assert "seqlen_q" in causal[1] and "blockIdx.y" in causal[1] and '"tvmflash.reversed": 1' in causal[1]
    assert "T.thread_binding(4," in causal[2] and "blockIdx.x" in causal[2]
    full = _tile_loops(tvmflash.compile(head_dim=64, dtype="float16", target=arch).scheduled_tir(4))
    assert "seqlen_q" in full[2] and "blockIdx.x" in full[2] and not any("reversed" in loop for loop in full)


def test_sm90_min_blocks_per_sm_becomes_launch_bounds(monkeypatch, tmp_path):
    """min_blocks_per_sm 2 with 128-row blocks is __launch_bounds__(256, 2) on the kernel (TVM's
    SplitHostDevice drops the function attribute; tvm_fixes.LaunchBoundsOnKernels puts it back), and ptxas then
    keeps to 128 registers: with the K/V pipeline (2 stages) without spilling. (The default one
    stage spills 28 bytes at d128, loop-invariant addresses reloaded each K/V step: see KNOBS.)"""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    rows128 = {"block_m": 128, "num_warpgroups": 2, "num_stages": 2}
    one = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs={**rows128, "min_blocks_per_sm": 1})
    plain = one.source(heads_q=2, heads_kv=2)
    two = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs={**rows128, "min_blocks_per_sm": 2})
    src = two.source(heads_q=2, heads_kv=2)
    assert "__launch_bounds__(256) main_kernel" in plain and "__launch_bounds__(256, 2) main_kernel" in src
    if shutil.which("nvcc"):
        (tmp_path / "k.cu").write_text(src)
        done = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-O3", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                               str(tmp_path / "k.cu")], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        registers = int(re.search(r"Used (\d+) registers", done.stderr).group(1))
        assert registers <= 128 and "0 bytes spill stores" in done.stderr, done.stderr


@pytest.mark.parametrize("sm90", [False, True], ids=["sm80", "sm90"])
def test_pipeline_epilogue_is_not_guarded_statement_by_statement(monkeypatch, sm90):
    """The program visits at least one K/V tile (a tile with no visible key is all masked), so
    InjectSoftwarePipeline can prove that its epilogue runs and leaves it unguarded. With a guard
    on each of its statements (``if ((1 <= seqlen_k) && ...)``), ptxas gave the sm90 pipelined
    build 231 registers instead of 127 (sm80's d128 build has 255 either way)."""
    monkeypatch.setenv("TVMFLASH_SM90", "1" if sm90 else "0")
    kernel = tvmflash.compile(head_dim=64, dtype="bfloat16", causal=True, target="sm90", knobs={"num_stages": 2})
    assert kernel.info()["schedule"] == ("sm90" if sm90 else "sm80")
    src = kernel.source(2, 2)
    assert "cp.async" in src and "1 <= seqlen_k" not in src


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_kv_tiles_come_by_tma(monkeypatch, head_dim, causal):
    """The default sm90 build loads K/V tiles by TMA (tvmflash.lowering.tma): the kernel takes a
    __grid_constant__ tensor map for K and one for V, one thread issues each stage's two
    cp.async.bulk.tensor copies after arriving on its full mbarrier with the bytes to expect, and
    the K/V loop has no __syncthreads (mbarrier waits and arrives order it) and no cp.async. The
    tiles land on 1024-byte boundaries, where the 128-byte swizzle of TMA and of wgmma's
    descriptors start (with the barriers, BARRIER_SLOTS, before them)."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    kernel = tvmflash.compile(head_dim=head_dim, dtype="bfloat16", causal=causal, target="sm90")
    assert kernel.knobs["kv_copy"] == "tma"
    src = kernel.source(heads_q=4, heads_kv=2)
    assert "const __grid_constant__ CUtensorMap K_tensormap" in src and "const __grid_constant__ CUtensorMap V_tensormap" in src
    assert "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes" in src
    body = kv_loop_body(src)
    assert "__syncthreads" not in body and "cp_async" not in body
    for call in ("tvmflash_mbarrier_expect_tx(", "tvmflash_mbarrier_wait(", "tvmflash_release_after_wgmma("):
        assert call in body
    # the release waits for the warpgroup's wgmma in the same asm (ptxas hoists a separate arrive)
    assert 'asm volatile("wgmma.wait_group.sync.aligned 0;\\n\\tmbarrier.arrive.shared::cta.b64 _, [%0];"' in src
    tile_bytes = 2 * kernel.knobs["block_n"] * head_dim * 2  # K and V, bf16
    assert re.search(rf"tvmflash_mbarrier_expect_tx\(.*?, {tile_bytes}\);", body)
    issues = re.findall(r"tvmflash_tma_load_5d\(\(&\(\(\(nv_bfloat16\*\)buf_dyn_shmem_ptr\)\[(.*?)\]\)\), "
                        r"\(\(unsigned long long\)\(&\(([KV])_tensormap\)\)\)", src)
    assert sorted({tensor for _, tensor in issues}) == ["K", "V"] and len(issues) == 4  # prologue and loop
    for offset, _ in issues:
        stage = re.sub(r"\(\(kb \+ 1\) & 1\) \* \d+", "", offset)
        assert all(int(n) * 2 % 1024 == 0 for n in re.findall(r"\d+", stage)), offset


def test_tma_needs_swizzled_pipelined_tiles(monkeypatch):
    """Asking for TMA where it cannot work is a clear error that says what to pass instead."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    with pytest.raises(ValueError, match="kv_copy 'tma' needs kv_layout 'swizzled' and num_stages >= 2"):
        tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs={"num_stages": 1}).source(1, 1)
    with pytest.raises(ValueError, match="kv_copy: the sm90 schedule takes one of"):
        tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs={"kv_copy": "bulk"}).source(1, 1)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_producer_warpgroup(monkeypatch, causal):
    """producer="warpgroup": a third warpgroup issues the TMA copies (and nothing else); the two
    consumer warpgroups take its registers by setmaxnreg and sync among themselves on a named barrier,
    never on __syncthreads after the branch; the tiles stay 1024-byte aligned."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    knobs = {"producer": "warpgroup", "min_blocks_per_sm": 1, "block_n": 128}
    src = tvmflash.compile(head_dim=128, dtype="bfloat16", causal=causal, target="sm90", knobs=knobs).source(4, 2)
    assert "__launch_bounds__(384)" in src
    producer, consumers = src.split("tvmflash_setmaxnreg_dec();", 1)[1].split("tvmflash_setmaxnreg_inc();", 1)
    assert producer.count("tvmflash_tma_load_5d(") == 4 and "wgmma" not in producer and "__syncthreads" not in producer
    assert "setmaxnreg.dec.sync.aligned.u32 24" in src and "setmaxnreg.inc.sync.aligned.u32 240" in src
    assert "tvmflash_tma_load_5d(" not in consumers and "__syncthreads" not in consumers
    assert "tvmflash_named_barrier(1, 256);" in consumers and "tvmflash_release_after_wgmma(" in consumers
    assert re.search(r"tvmflash_mbarrier_init\(.*?, 256\);", src)  # the empty barriers count the consumers


def test_sm90_producer_needs_tma_and_one_block(monkeypatch):
    """A producer warpgroup without TMA, or with two blocks an SM, is a clear error; the tuner's
    task filter drops those points."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    from tvmflash.schedules import sm90
    with pytest.raises(ValueError, match="producer 'warpgroup' needs kv_copy 'tma', min_blocks_per_sm 1 and block_m 128"):
        tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs={"producer": "warpgroup"}).source(1, 1)
    assert not sm90.valid_knobs({"producer": "warpgroup", "min_blocks_per_sm": 2})
    assert not sm90.valid_knobs({"producer": "warpgroup", "min_blocks_per_sm": 1, "block_m": 256})
    assert not sm90.valid_knobs({"producer": "warpgroup", "min_blocks_per_sm": 1, "kv_copy": "cp.async"})
    assert sm90.valid_knobs({"producer": "warpgroup", "min_blocks_per_sm": 1, "kv_copy": "tma"})
    # head_dim 256 in three stages does not fit: a clear error before building
    with pytest.raises(ValueError, match="KiB of shared memory"):
        tvmflash.compile(head_dim=256, dtype="bfloat16", target="sm90",
                         knobs={"producer": "warpgroup", "min_blocks_per_sm": 1, "num_stages": 3})


@pytest.mark.parametrize("producer", ["thread", "warpgroup"])
def test_sm90_three_stage_tma_pipeline(monkeypatch, producer):
    """Three TMA stages: the prologue issues two tiles (in a loop that TVM unrolls), yet the barriers
    are set up once; every Q block visits at least two K/V tiles (``sm90.min_kv_tiles``), so no
    statement of the pipeline's epilogue is guarded by the count of tiles (guarded, ptxas spilled)."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    knobs = {"producer": producer, "min_blocks_per_sm": 1, "block_n": 128, "num_stages": 3, "q_layout": "swizzled"}
    src = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs=knobs).source(4, 2)
    assert src.count("tvmflash_mbarrier_init_fence();") == 1
    assert src.count("tvmflash_tma_load_5d((") == 6  # K and V: two tiles in the prologue, one a step
    assert "< seqlen_k)" not in src.split("tvmflash_setmaxnreg_inc();")[-1].split("for (int kb")[0]  # nothing guarded before the loop


def test_sm90_swizzled_q_tile(monkeypatch):
    """q_layout="swizzled": QK^T reads Q through 128-byte-swizzled descriptors (layout 1), as it reads
    K (at d96 64-byte, layout 2); with a producer warpgroup the output's staging reuses the Q tile's memory, so three stages of
    block_n 128 fit at head_dim 128 (227 KiB)."""
    from tvmflash.schedules import sm90
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    def layouts(src):
        return {layout for *_, layout in descriptors(src)}
    assert layouts(tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90").source(4, 2)) == {"0", "1"}
    src = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs={"q_layout": "swizzled"}).source(4, 2)
    assert layouts(src) == {"1"} and "wgmma.mma_async" in src
    knobs = {"producer": "warpgroup", "min_blocks_per_sm": 1, "block_n": 128, "num_stages": 3}
    assert sm90.shared_memory_bytes(128, "bfloat16", {**knobs, "q_layout": "swizzled"}) <= 227 * 1024
    assert sm90.shared_memory_bytes(128, "bfloat16", knobs) > 227 * 1024
    # at d96 (no multiple of 64) the swizzled Q tile takes the 64-byte swizzle (layout 2)
    src = tvmflash.compile(head_dim=96, dtype="bfloat16", target="sm90",
                           knobs={"q_layout": "swizzled", "kv_layout": "core_matrices", "kv_copy": "cp.async"}).source(4, 2)
    assert layouts(src) == {"0", "2"}


@pytest.mark.parametrize("producer", ["thread", "warpgroup"])
def test_sm90_q_tile_by_tma(monkeypatch, producer):
    """q_copy="tma": one thread of the first consumer warpgroup copies the swizzled Q tile by TMA on a
    barrier of its own, and every consumer thread waits for it; no thread loads Q itself. The Q tile
    stays the consumers' own, so with a producer warpgroup three stages of block_n 128 still fit."""
    from tvmflash.schedules import sm90
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    knobs = {"producer": producer, "min_blocks_per_sm": 1, "block_n": 128, "num_stages": 3, "q_layout": "swizzled",
             "q_copy": "tma"}
    assert sm90.shared_memory_bytes(128, "bfloat16", knobs) <= 227 * 1024
    src = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs=knobs).source(4, 2)
    assert src.count("(&(Q_tensormap))") == 1 and "Q_ptr" not in src
    q_barrier = re.search(r"tvmflash_tma_load_5d\(\(&\(\(\(nv_bfloat16\*\)buf_dyn_shmem_ptr\)\[\d+\]\)\), "
                          r"\(\(unsigned long long\)\(&\(Q_tensormap\)\)\), (\(&\(\(\(uint64_t\*\)buf_dyn_shmem_ptr\)\[\d+\]\)\))", src)
    assert q_barrier and f"tvmflash_mbarrier_wait({q_barrier.group(1)}, 0);" in src
    with pytest.raises(ValueError, match="q_copy 'tma' needs q_layout 'swizzled' and kv_copy 'tma'"):
        tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs={"q_copy": "tma"}).source(1, 1)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_rescale_is_skipped_where_alpha_is_one(monkeypatch, head_dim):
    """The output's rescale (each of a thread's head_dim / 2 accumulators times its row's alpha) sits
    under one warp-wide test, taken where some lane's alpha is not 1, in the K/V loop and its
    epilogue alike; and the running max moves only past the program's threshold."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    lines = tvmflash.compile(head_dim=head_dim, dtype="bfloat16", target="sm90").source(4, 2).splitlines()
    rescale = re.compile(r"acc_local_ptr\[(\d+)\] = \(acc_local_ptr\[\1\] \* alpha_local_ptr\[[01]\]\);")
    tests = [i for i, line in enumerate(lines) if "if (__any_sync((uint)4294967295, ((alpha_local_ptr[0] != 0x1p+0f" in line]
    assert tests
    for i in tests:
        assert all(rescale.fullmatch(line.strip()) for line in lines[i + 1:i + 1 + head_dim // 2])
        assert lines[i + 1 + head_dim // 2].strip() == "}"
    assert sum(bool(rescale.fullmatch(line.strip())) for line in lines) == len(tests) * head_dim // 2
    assert any("0x1p+3f/*8.000000e+00*/ < ((m_tile_local_ptr[0] - m_local_ptr[0])" in line for line in lines)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_causal_mask_test_is_per_tile(monkeypatch, head_dim):
    """The causal tile test (it reads the Q block, blockIdx.y) is hoisted out of the score's element
    loops: an unmasked tile copies its scores one after another under one branch, as the
    non-causal one does, instead of testing before each."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    for causal in (False, True):
        lines = [line.strip() for line in
                 tvmflash.compile(head_dim=head_dim, dtype="bfloat16", causal=causal, target="sm90").source(4, 2).splitlines()]
        copies = [i for i, line in enumerate(lines) if line == "Sm_local_ptr[0] = S_local_ptr[0];"]
        assert copies and all(lines[i + 1] == "Sm_local_ptr[1] = S_local_ptr[1];" for i in copies)


def test_sm90_output_stored_from_registers(monkeypatch):
    """o_store="direct": the output goes to global memory from the accumulator registers, two adjacent
    columns a store, and not through a shared-memory tile (its 16-byte stores)."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    staged = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90").source(4, 2)
    direct = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs={"o_store": "direct"}).source(4, 2)
    assert "*(uint4*)(O_ptr + " in staged and "*(nv_bfloat162*)(O_ptr + " not in staged
    assert "*(nv_bfloat162*)(O_ptr + " in direct and "*(uint4*)(O_ptr + " not in direct


@pytest.mark.parametrize("producer", ["thread", "warpgroup"])
def test_sm90_overlap_issues_pv_with_the_next_qk(monkeypatch, producer):
    """overlap=1 (FA3's intra-warpgroup order): a K/V step issues PV of the previous tile, then QK^T of
    this one, and waits once for both; the stage of the previous tile is released after that wait; V
    keeps three stages and K two; the last PV is waited for, and the accumulators fenced, before the
    output reads them. The pipeline waits for as many tiles as it releases, and each copy of a tile
    completes on the barrier that its issue expects the bytes on."""
    from tvmflash.schedules import sm90
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    knobs = {"producer": producer, "min_blocks_per_sm": 1, "block_n": 128, "num_stages": 3, "q_layout": "swizzled",
             "overlap": 1}
    src = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs=knobs).source(4, 2)
    consumers = src.split("tvmflash_setmaxnreg_inc();")[-1]  # (the whole kernel with the thread producer)
    step = kv_loop_body(consumers)
    pv, qk = step.index("_rs_mma_async"), step.index("_ss_mma_async")
    wait = step.index("wait_group_sync_aligned_0();")
    assert pv < qk < wait < step.index("tvmflash_release_after_wgmma(") and step.count("wait_group_sync_aligned_0();") == 1
    waits = [line for line in consumers.splitlines() if "tvmflash_mbarrier_wait(" in line and "tma_consumed" in line]
    assert len(waits) == consumers.count("tvmflash_release_after_wgmma((") == 3  # prologue, step, epilogue
    # the prologue's QK^T of tile 0 releases too: K has two versions, so tile 2 may only be issued once
    # it is done (the producer waits for release t - 2 before it issues tile t)
    assert consumers.index("tvmflash_release_after_wgmma((") < consumers.index("for (int kb")
    assert "if (2 <= tma_issued_ptr[0]) {" in src and "if (3 <= tma_issued_ptr[0]) {" not in src
    # every copy of an issue completes on the barrier that issue expects its bytes on: V's stage, also
    # for K, whose own stage differs (a K copy on K's stage hung the kernel from the third tile on)
    for issue in src.split("tvmflash_mbarrier_expect_tx((")[1:]:
        expected = "(" + issue[:issue.index("), ")]
        loads = re.findall(r"tvmflash_tma_load_5d\(.*?_tensormap\)\)\), (.*?)\), ", issue.split("tma_issued_ptr[0] = ")[0])
        assert loads and all(barrier == expected for barrier in loads), (expected, loads)
    tail = consumers[consumers.rindex("_rs_mma_async"):]
    assert "wait_group_sync_aligned_0();\n" in tail and "tvmflash_wgmma_reg_fence(acc_local_ptr[63]);" in tail
    assert sm90.shared_memory_bytes(128, "bfloat16", knobs) < sm90.shared_memory_bytes(128, "bfloat16", {**knobs, "overlap": 0})
    with pytest.raises(ValueError, match="overlap 1 needs kv_copy 'tma' and num_stages >= 3"):
        tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs={"overlap": 1}).source(1, 1)


@pytest.mark.parametrize("producer", ["thread", "warpgroup"])
def test_sm90_descriptors_are_uniform_adds(monkeypatch, producer):
    """A wgmma descriptor is its buffer's start (the same for every wgmma of a step) plus the operand's
    offset in 16-byte units, folded to constants and the stage's or warpgroup's term; the warpgroup
    comes from a shuffle of lane 0's threadIdx.y at the kernel's start, so that nvcc keeps the Q
    tile's descriptors in uniform registers (no R2UR before each wgmma)."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    knobs = {"producer": producer, "min_blocks_per_sm": 1} if producer == "warpgroup" else {}
    src = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs=knobs).source(4, 2)
    found = _DESCRIPTOR.findall(src)
    assert len(found) >= 12 and "int warpgroup = __shfl_sync((uint)4294967295, ((int)threadIdx.y), 0, 32);" in src
    assert not any("threadIdx" in start + offset for _, start, offset, *_ in found)
    # Q: a constant start, and the warpgroup's 64 rows in the offset
    assert any(start.isdigit() and "warpgroup" in offset for _, start, offset, *_ in found)


def _descriptors_at(*places, attrs=None):
    """A PrimFunc whose body makes one swizzled wgmma descriptor at each (start, offset) of ``places``:
    the start an element of a bf16 "shared.dyn" buffer, the offset in 16-byte units after it, plus
    the warpgroup's 512 (a variable)."""
    from tvm import tirx
    from tvm.script import tirx as T

    smem = tirx.decl_buffer((65536,), "bfloat16", "smem", scope="shared.dyn")
    warpgroup = tirx.Var("warpgroup", "int32")
    calls = [tirx.Evaluate(T.cuda.func_call("tvmflash_wgmma_descriptor", T.address_of(smem[start]), warpgroup * 512 + offset,
                                            1, 64, 1, source_code="", return_type="uint64")) for start, offset in places]
    func = tirx.PrimFunc([], tirx.SeqStmt(calls) if len(calls) > 1 else calls[0])
    return func.with_attr("tvmflash.tma_copies", attrs) if attrs else func


def test_tile_alignment_check_reads_swizzled_descriptors():
    """check_tile_alignment reads the swizzled wgmma operands in the IR (the Q tile is no TMA
    destination): a k16 slice may start 32, 64 or 96 bytes into a 1024-byte-aligned tile, nowhere else."""
    tma.check_tile_alignment(_descriptors_at((33280, 0), (33280, 6), (33280 - 48, 6)))
    with pytest.raises(tma.MisalignedTiles, match="swizzled wgmma operand"):
        tma.check_tile_alignment(_descriptors_at((33280, 16)))
    with pytest.raises(tma.MisalignedTiles, match="swizzled wgmma operand"):
        tma.check_tile_alignment(_descriptors_at((33280 + 128, 0)))


def test_tile_alignment_check_fails_closed():
    """A TMA build in which the check finds no copy to check, or a pointer it cannot read, fails: an
    unread tile is never taken for an aligned one."""
    from tvm import tirx
    from tvm.script import tirx as T

    with pytest.raises(RuntimeError, match="finds 0 TMA copies"):
        tma.check_tile_alignment(_descriptors_at((33280, 0), attrs=2))
    global_memory = tirx.decl_buffer((1024,), "bfloat16", "g")
    unreadable = tirx.PrimFunc([], tirx.Evaluate(T.cuda.func_call(
        "tvmflash_wgmma_descriptor", T.address_of(global_memory[0]), 0, 1, 64, 1, source_code="", return_type="uint64")))
    with pytest.raises(RuntimeError, match="cannot read where a swizzled wgmma operand lands"):
        tma.check_tile_alignment(unreadable)


def test_misaligned_tma_tiles_fail_the_build(monkeypatch):
    """If shared-memory merging puts a swizzled TMA tile off a 1024-byte boundary whatever padding of
    the barriers the build tries, it says so (the copies and the wgmma descriptors would disagree)
    instead of computing garbage. Here no padding is tried, and the barriers are too small."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    monkeypatch.setitem(annotations.TMA_BARRIER_BYTES, "warpgroup", 512)
    monkeypatch.setattr(pipeline, "TMA_BARRIER_PADDINGS", (0,))
    with pytest.raises(RuntimeError, match="not on a 1024-byte boundary"):
        tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90",
                         knobs={"producer": "warpgroup", "min_blocks_per_sm": 1, "num_stages": 3}).source(1, 1)


def test_tensor_maps_take_the_buffer_strides():
    """The TMA tensor maps are encoded on the host from the strides of the K and V arguments (they
    were computed from the shape, as if every tensor were compact)."""
    import types

    from tvm import tirx
    from tvm.script import tirx as T

    strides = [tirx.Var(name, "int32") for name in ("k_stride_b", "k_stride_s", "k_stride_h")]
    batch, seqlen = tirx.Var("batch", "int32"), tirx.Var("seqlen_k", "int32")
    buffer = tirx.decl_buffer((batch, seqlen, 2, 128), "bfloat16", "K", strides=[*strides, 1])
    plan = types.SimpleNamespace(tensor_maps={buffer: (tirx.Var("K_tensormap", ty=T.handle("tensormap").ty), (64, 64, 2))})
    _, encode = tma._encode_tensor_maps(plan)
    # (map, data, 5 dims, 4 strides in bytes: row, 64-column half, head, batch, ...)
    row, half, head, batch_stride = (str(arg) for arg in encode.value.args[7:11])
    assert "k_stride_s" in row and "k_stride_h" in head and "k_stride_b" in batch_stride and half == "128"
    assert all("int64" in s and "* T.int64(2)" in s for s in (row, head, batch_stride))


@pytest.mark.parametrize("arch,sm90,dtype", [("sm80", "0", "bfloat16"), ("sm90", "1", "bfloat16"), ("sm80", "0", "float32")],
                         ids=["sm80", "sm90", "simt"])
def test_strided_tensors_are_read_in_16_byte_vectors(monkeypatch, arch, sm90, dtype):
    """q, k, v and out are read and written through their stride arguments, still in 16-byte vectors:
    code generation proves a vector's alignment only from strides it sees are multiples of it
    (program.attention_forward's stride_alignment; plain stride arguments made gathers of scalars)."""
    monkeypatch.setenv("TVMFLASH_SM90", sm90)
    src = tvmflash.compile(head_dim=128, dtype=dtype, causal=True, target=arch).source(heads_q=8, heads_kv=2)
    assert "int q_stride_s" in src and "int o_stride_s" in src
    if dtype == "float32":  # the SIMT schedule: a thread's row of Q, the K/V tiles in 16-byte vectors
        assert "*(float4*)(K_ptr + " in src and "*(float4*)(V_ptr + " in src and "make_float4(K_ptr[" not in src
    else:
        assert "*(uint4*)(Q_ptr + " in src and "make_uint4(Q_ptr[" not in src
    if arch == "sm90":  # K and V by TMA: their strides are in the tensor maps
        assert "k_stride_s" not in src and "_tensormap" in src
    else:  # K and V through their strides, in the K/V loop
        body = kv_loop_body(src)
        assert "k_stride_s" in body and "v_stride_s" in body

