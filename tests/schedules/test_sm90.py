"""The sm90 schedule (``schedules/sm90/``, wgmma on sm_90a), built on a machine with no GPU: its
layouts against CUTLASS's and the hardware's, its knobs and their checks, and what the generated
CUDA of the forward and the backward holds (and, where nvcc exists, that it compiles). Heads 4/2, as
tests/test_generated_cuda.py builds them: kernels of the same knobs are one module in a run."""

import itertools
import re
import shutil
import subprocess

import pytest

import tvmflash
from conftest import kv_loop_body
from tvmflash.schedules.sm90 import knobs as sm90_knobs


def valid(point: dict) -> bool:
    """Whether forward knobs go together (the schedule's rules), the defaults filling in the rest."""
    return sm90_knobs.FORWARD.rules({**sm90_knobs.FORWARD.defaults(), **point}) is None


def shared_memory(head_dim: int, knobs: dict) -> int:
    """The forward's shared memory for these knobs, the defaults at head_dim filling in the rest."""
    return sm90_knobs.shared_memory_bytes(head_dim, "bfloat16", {**sm90_knobs.FORWARD.defaults(head_dim), **knobs})

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


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sm90_wgmma_schedule_serves_sm_90a(monkeypatch, dtype):
    """On sm_90a the wgmma schedule serves (with no tuning records that favour sm80) and emits wgmma,
    not mma.sync (that it compiles is the GPU tests': test_numerics builds these kernels on sm_90a).
    TVMFLASH_SM90=0 keeps sm80; 1 does not take it to other targets."""
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
    src = kernel.source(heads_q=4, heads_kv=2)
    # row max and row sum: xor 1 and 2 for each of a thread's two rows, into its registers
    assert src.count("__shfl_xor_sync") == 8
    assert "wgmma_bf16_rs_mma_async_sync_aligned_m64n128k16" in src  # O += P V, P in registers
    assert "wgmma_bf16_ss_mma_async_sync_aligned_m64n64k16" in src  # S = Q K^T
    assert "((uint*)Pc_local_ptr)[" in src  # bf16 pairs of P as the A registers
    # S is read only by the mask, into registers (condval or Sm_local): no copy to shared memory
    reads_of_s = [line.lstrip() for line in src.splitlines() if "= S_local_ptr[" in line]
    assert reads_of_s and all(line.startswith(("condval", "Sm_local_ptr[")) for line in reads_of_s)


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_kv_step_fences_for_wgmma_once(monkeypatch, causal):
    """QK^T's operands are made visible to wgmma by the pipeline's wait, fence and barrier alone:
    the intrinsic adds no barrier of its own (one __syncthreads a step, as
    test_pipelined_kv_step_waits_for_its_tile_first checks). With one stage (plain stores) the
    intrinsic fences and syncs itself."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    pipelined = tvmflash.compile(head_dim=128, dtype="bfloat16", causal=causal, target="sm90",
                                 knobs={"num_stages": 2, "kv_copy": "cp.async"}).source(heads_q=4, heads_kv=2)
    assert kv_loop_body(pipelined).count("__syncthreads();") == 1
    plain = tvmflash.compile(head_dim=128, dtype="bfloat16", causal=causal, target="sm90",
                             knobs={"num_stages": 1, "kv_copy": "cp.async"}).source(heads_q=4, heads_kv=2)
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
                           ).source(heads_q=4, heads_kv=2)
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
    src = kernel.source(heads_q=4, heads_kv=2)
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


@pytest.mark.parametrize("dtype,pair", [("bfloat16", "nv_bfloat162"), ("float16", "half2")])
def test_sm90_output_goes_out_through_shared_memory(monkeypatch, dtype, pair):
    """The accumulator threads write the output tile to shared memory in pairs of adjacent columns
    (one 32-bit store each), and the tile goes to global memory in 16-byte row pieces: no 2-byte
    stores to O (schedules.sm90.forward.store_through_shared_memory)."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    src = tvmflash.compile(head_dim=128, dtype=dtype, target="sm90").source(heads_q=4, heads_kv=2)
    to_global = [line.strip() for line in src.splitlines() if "O_ptr" in line and "=" in line and "__global__" not in line]
    assert to_global and all(line.startswith("*(uint4*)(O_ptr + ") for line in to_global)
    assert f"*({pair}*)(((" in src  # the pairs into the shared tile


def test_sm90_min_blocks_per_sm_becomes_launch_bounds(monkeypatch, tmp_path):
    """min_blocks_per_sm 2 with 128-row blocks is __launch_bounds__(256, 2) on the kernel (TVM's
    SplitHostDevice drops the function attribute; tvm_fixes.LaunchBoundsOnKernels puts it back), and ptxas then
    keeps to 128 registers: with the K/V pipeline (2 stages) without spilling. (The default one
    stage spills 28 bytes at d128, loop-invariant addresses reloaded each K/V step: see knobs.FORWARD.)"""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    rows128 = {"block_m": 128, "num_warpgroups": 2, "num_stages": 2}
    one = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs={**rows128, "min_blocks_per_sm": 1})
    plain = one.source(heads_q=4, heads_kv=2)
    two = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs={**rows128, "min_blocks_per_sm": 2})
    src = two.source(heads_q=4, heads_kv=2)
    assert "__launch_bounds__(256) main_kernel" in plain and "__launch_bounds__(256, 2) main_kernel" in src
    if shutil.which("nvcc"):
        (tmp_path / "k.cu").write_text(src)
        done = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-O3", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                               str(tmp_path / "k.cu")], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        registers = int(re.search(r"Used (\d+) registers", done.stderr).group(1))
        assert registers <= 128 and "0 bytes spill stores" in done.stderr, done.stderr


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_kv_tiles_come_by_tma(monkeypatch, head_dim, causal):
    """The default sm90 build loads K/V tiles by TMA (tvmflash.lowering.tma_copies): the kernel takes a
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
    with pytest.raises(ValueError, match="producer 'warpgroup' needs kv_copy 'tma', min_blocks_per_sm 1 and block_m 128"):
        tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs={"producer": "warpgroup"}).source(1, 1)
    assert not valid({"producer": "warpgroup", "min_blocks_per_sm": 2})
    assert not valid({"producer": "warpgroup", "min_blocks_per_sm": 1, "block_m": 256})
    assert not valid({"producer": "warpgroup", "min_blocks_per_sm": 1, "kv_copy": "cp.async"})
    assert valid({"producer": "warpgroup", "min_blocks_per_sm": 1, "kv_copy": "tma"})
    # head_dim 256 in three stages does not fit: a clear error before building
    with pytest.raises(ValueError, match="KiB of shared memory"):
        tvmflash.compile(head_dim=256, dtype="bfloat16", target="sm90",
                         knobs={"producer": "warpgroup", "min_blocks_per_sm": 1, "num_stages": 3})


@pytest.mark.parametrize("producer", ["thread", "warpgroup"])
def test_sm90_three_stage_tma_pipeline(monkeypatch, producer):
    """Three TMA stages: the prologue issues two tiles (in a loop that TVM unrolls), yet the barriers
    are set up once; every Q block visits at least two K/V tiles (``sm90.SCHEDULE.min_kv_tiles``), so no
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
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    def layouts(src):
        return {layout for *_, layout in descriptors(src)}
    assert layouts(tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90").source(4, 2)) == {"0", "1"}
    src = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", knobs={"q_layout": "swizzled"}).source(4, 2)
    assert layouts(src) == {"1"} and "wgmma.mma_async" in src
    knobs = {"producer": "warpgroup", "min_blocks_per_sm": 1, "block_n": 128, "num_stages": 3}
    assert shared_memory(128, {**knobs, "q_layout": "swizzled"}) <= 227 * 1024
    assert shared_memory(128, knobs) > 227 * 1024
    # at d96 (no multiple of 64) the swizzled Q tile takes the 64-byte swizzle (layout 2)
    src = tvmflash.compile(head_dim=96, dtype="bfloat16", target="sm90",
                           knobs={"q_layout": "swizzled", "kv_layout": "core_matrices", "kv_copy": "cp.async"}).source(4, 2)
    assert layouts(src) == {"0", "2"}


@pytest.mark.parametrize("producer", ["thread", "warpgroup"])
def test_sm90_q_tile_by_tma(monkeypatch, producer):
    """q_copy="tma": one thread of the first consumer warpgroup copies the swizzled Q tile by TMA on a
    barrier of its own, and every consumer thread waits for it; no thread loads Q itself. The Q tile
    stays the consumers' own, so with a producer warpgroup three stages of block_n 128 still fit."""
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    knobs = {"producer": producer, "min_blocks_per_sm": 1, "block_n": 128, "num_stages": 3, "q_layout": "swizzled",
             "q_copy": "tma"}
    assert shared_memory(128, knobs) <= 227 * 1024
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
    assert shared_memory(128, knobs) < shared_memory(128, {**knobs, "overlap": 0})
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
