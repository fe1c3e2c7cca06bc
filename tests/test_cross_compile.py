"""CUDA builds on a machine with no GPU: the generated source, and (where nvcc exists) its cubin. Heads 4/2,
as tests/test_generated_cuda.py builds them: kernels of the same knobs are one module in a run."""

import itertools
import shutil

import pytest
import tvm

import tvmflash
from conftest import kv_loop_body
from tvmflash.lowering import annotations, pipeline, tile_alignment, tma_tensor_maps

@pytest.mark.parametrize("arch", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_source_builds(arch, dtype):
    kernel = tvmflash.compile(head_dim=128, dtype=dtype, causal=True, target=arch)
    src = kernel.source(heads_q=4, heads_kv=2)
    assert '__global__ void' in src and "__shared__" in src
    assert kernel.info()["target"] == {"sm80": "cuda sm_80", "sm90": "cuda sm_90a"}[arch]


# sm80's: the GPU tests run on sm_90a, where compile() takes sm90's kernels at d64 (and SIMT's in float32), which
# test_numerics builds there, so nvcc compiles those in the GPU suite
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm80"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_cuda_source_compiles_with_nvcc(arch, dtype):
    from tvm.support import nvcc

    kernel = tvmflash.compile(head_dim=64, dtype=dtype, target=arch)
    with kernel.target:
        cubin = nvcc.compile_cuda(kernel.source(heads_q=4, heads_kv=2), target_format="cubin",
                                  arch=str(kernel.target.attrs["arch"]), compiler="nvcc")
    assert len(cubin) > 1000


def test_target_forms():
    for target in ["sm90", {"kind": "cuda", "arch": "sm_90a"}, tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})]:
        kernel = tvmflash.compile(head_dim=64, dtype="float16", target=target)
        assert kernel.info()["target"] == "cuda sm_90a"


def test_row_reduce_layouts_cover_their_tiles():
    """common.row_reduce_intrin's layouts (sm80 mma fragments, sm90 wgmma accumulators): the
    elements a thread reduces for its k-th row are exactly that row's elements it holds."""
    from tvmflash.schedules import sm90
    from tvmflash.schedules.sm80 import fragments
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
        index = tuple(int(v) for v in fragments.frag_index_map(r, c))
        return index[2], index

    check(fragments.frag_rows(32, 64), frag_owner)
    acc = sm90.acc_rows(64)
    check(acc, lambda r, c: (sm90_layouts.acc_layout(r, c)[0], (sm90_layouts.acc_layout(r, c)[1],)))
    # One intrinsic for both layouts and both outputs (shared memory, the quads' registers).
    from tvm.s_tir import TensorIntrin
    from tvmflash.schedules import common

    for layout in (fragments.frag_rows(32, 64), acc):
        for out_scope in ("shared.dyn", "local"):
            TensorIntrin.get(common.row_reduce_intrin("sum", layout, out_scope))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", ["sm80", "sm90"])
def test_pipelined_kv_step_waits_for_its_tile_first(monkeypatch, schedule, causal):
    """With the K/V loads pipelined (2 stages), each K/V step begins with the wait for its own
    tile (on sm90 with fence.proxy.async after it, so wgmma sees the cp.async writes) and one
    barrier, and only then issues the next tile's copies: one __syncthreads a step. TVM's order
    (barrier, copies, wait, barrier) has two, and on sm90 the fence then also waits for the copies
    just issued (cp_async_barriers.OneBarrierPerPipelinedStep)."""
    monkeypatch.setenv("TVMFLASH_SM90", "1" if schedule == "sm90" else "0")
    knobs = {"num_stages": 2, **({"kv_copy": "cp.async"} if schedule == "sm90" else {})}
    kernel = tvmflash.compile(head_dim=64, dtype="bfloat16", causal=causal, target=schedule, knobs=knobs)
    src = kernel.source(heads_q=4, heads_kv=2)
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


def test_tensor_maps_of_the_64_byte_swizzle():
    """A tile in rows of 32 columns (d96) is copied through a (32 elements, row, 32-column group, head,
    batch) view with CU_TENSOR_MAP_SWIZZLE_64B."""
    import types

    from tvm import tirx
    from tvm.script import tirx as T

    buffer = tirx.decl_buffer((4, tirx.Var("seqlen_k", "int32"), 2, 96), "bfloat16", "K")
    plan = types.SimpleNamespace(tensor_maps={buffer: (tirx.Var("K_tensormap", ty=T.handle("tensormap").ty), (32, 64, 3))})
    _, encode = tma_tensor_maps.encode_tensor_maps(plan)
    dims, group_stride = encode.value.args[2:7], encode.value.args[8]
    assert [str(d) for d in dims] == ["32", "seqlen_k", "3", "2", "4"] and int(group_stride) == 64
    assert "swizzle=2" in str(encode.value)


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


@pytest.mark.parametrize("sm90", [False, True], ids=["sm80", "sm90"])
def test_pipeline_epilogue_is_not_guarded_statement_by_statement(monkeypatch, sm90):
    """The program visits at least one K/V tile (a tile with no visible key is all masked), so
    InjectSoftwarePipeline can prove that its epilogue runs and leaves it unguarded. With a guard
    on each of its statements (``if ((1 <= seqlen_k) && ...)``), ptxas gave the sm90 pipelined
    build 231 registers instead of 127 (sm80's d128 build has 255 either way)."""
    monkeypatch.setenv("TVMFLASH_SM90", "1" if sm90 else "0")
    kernel = tvmflash.compile(head_dim=64, dtype="bfloat16", causal=True, target="sm90", knobs={"num_stages": 2})
    assert kernel.info()["schedule"] == ("sm90" if sm90 else "sm80")
    src = kernel.source(4, 2)
    assert "cp.async" in src and "1 <= seqlen_k" not in src


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
    tile_alignment.check_tile_alignment(_descriptors_at((33280, 0), (33280, 6), (33280 - 48, 6)))
    with pytest.raises(tile_alignment.MisalignedTiles, match="swizzled wgmma operand"):
        tile_alignment.check_tile_alignment(_descriptors_at((33280, 16)))
    with pytest.raises(tile_alignment.MisalignedTiles, match="swizzled wgmma operand") as misaligned:
        tile_alignment.check_tile_alignment(_descriptors_at((33280 + 128, 0)))
    # 256 bytes past a boundary: pipeline.build pads the barriers by 768 more next
    assert misaligned.value.shortfall == 768 and tile_alignment.MisalignedTiles("other").shortfall is None


def test_tile_alignment_check_fails_closed():
    """A TMA build in which the check finds no copy to check, or a pointer it cannot read, fails: an
    unread tile is never taken for an aligned one."""
    from tvm import tirx
    from tvm.script import tirx as T

    with pytest.raises(RuntimeError, match="finds 0 TMA copies"):
        tile_alignment.check_tile_alignment(_descriptors_at((33280, 0), attrs=2))
    global_memory = tirx.decl_buffer((1024,), "bfloat16", "g")
    unreadable = tirx.PrimFunc([], tirx.Evaluate(T.cuda.func_call(
        "tvmflash_wgmma_descriptor", T.address_of(global_memory[0]), 0, 1, 64, 1, source_code="", return_type="uint64")))
    with pytest.raises(RuntimeError, match="cannot read where a swizzled wgmma operand lands"):
        tile_alignment.check_tile_alignment(unreadable)


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
    _, encode = tma_tensor_maps.encode_tensor_maps(plan)
    # (map, data, 5 dims, 4 strides in bytes: row, 64-column half, head, batch, ...)
    row, half, head, batch_stride = (str(arg) for arg in encode.value.args[7:11])
    assert "k_stride_s" in row and "k_stride_h" in head and "k_stride_b" in batch_stride and half == "128"
    assert all("int64" in s and "* T.int64(2)" in s for s in (row, head, batch_stride))


@pytest.mark.parametrize("arch,sm90,dtype", [("sm80", "0", "bfloat16"), ("sm90", "1", "bfloat16"), ("sm80", "0", "float32")],
                         ids=["sm80", "sm90", "simt"])
def test_strided_tensors_are_read_in_16_byte_vectors(monkeypatch, arch, sm90, dtype):
    """q, k, v and out are read and written through their stride arguments, still in 16-byte vectors:
    code generation proves a vector's alignment only from strides it sees are multiples of it
    (program_forward.attention_forward's stride_alignment; plain stride arguments made gathers of scalars)."""
    monkeypatch.setenv("TVMFLASH_SM90", sm90)
    src = tvmflash.compile(head_dim=128, dtype=dtype, causal=True, target=arch).source(heads_q=4, heads_kv=2)
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
