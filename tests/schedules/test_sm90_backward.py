"""The sm90 backward (``schedules/sm90/backward.py``, dkdv and dq on wgmma), built on a machine with no GPU:
its knobs and their checks, the choice at d96 and d256, and what its generated CUDA holds (and, where nvcc
exists, that it compiles without spills). Heads 4/2, as tests/test_generated_cuda.py builds them."""

import re
import shutil

import pytest

import tvmflash
from test_sm90 import descriptors
from tvmflash.schedules.sm90 import knobs as sm90_knobs


def test_sm90_backward_builds_cuda_source(monkeypatch):
    """On sm_90a, dkdv and dq on wgmma (s and dp with both operands from shared memory, the
    gradients' products with p or ds from registers), dkdv's streamed tiles by TMA, dq's by cp.async. By default
    (dq_atomic) dkdv makes dq's share on wgmma too (dsᵀ from shared memory, read transposed) and adds
    it from a shared-memory tile by red.global.add.v4.f32 (d64's "vector"); deterministic=True takes the dq pass. sm80's serves a head_dim sm90's
    does not have, and TVMFLASH_BACKWARD=sm80."""
    kernel = tvmflash.compile_backward(head_dim=64, dtype="bfloat16", causal=True, target="sm90", deterministic=True)
    assert kernel.info()["schedule"] == "sm90" and not kernel.dq_atomic
    src = kernel.source(heads_q=4, heads_kv=2)
    dq = src[src.rindex("dq_kernel("):]
    dkdv = src[src.rindex("dkdv_kernel("):src.rindex("dq_kernel(")]
    for program in (dq, dkdv):  # "ss": A and B by descriptors (s, dp); "rs": A from registers (the gradients)
        assert "_ss_mma_async_sync_aligned_m64n" in program and "_rs_mma_async_sync_aligned_m64n" in program
        assert "mma_sync" not in program
    assert "cp_async_commit_group" in dq and "tvmflash_tma_load_5d(" in dkdv
    kernel = tvmflash.compile_backward(head_dim=64, dtype="bfloat16", causal=True, target="sm90")
    assert kernel.dq_atomic
    src = kernel.source(heads_q=4, heads_kv=2)
    dkdv = src[src.rindex("dkdv_kernel("):src.rindex("convert_dq_kernel(")]
    assert " dq_kernel(" not in src and "tvmflash_red_add_v4_shared(" in dkdv
    assert "_ss_mma_async_sync_aligned_m64n32k16_f32_bf16_bf16_1_1_1_1(" in dkdv  # ds k: A and B transposed
    with pytest.raises(ValueError, match="deterministic"):
        tvmflash.compile_backward(head_dim=64, dtype="bfloat16", target="sm90", knobs={"dq_atomic": True},
                                  deterministic=True)
    with pytest.raises(ValueError, match="pass dq_atomic False"):  # dq's share takes 64 query rows a step
        tvmflash.compile_backward(head_dim=64, dtype="bfloat16", target="sm90", knobs={"block_m": 32}).source(2, 2)
    assert tvmflash.compile_backward(head_dim=32, dtype="bfloat16", target="sm90").info()["schedule"] == "sm80"
    monkeypatch.setenv("TVMFLASH_BACKWARD", "sm80")
    assert tvmflash.compile_backward(head_dim=64, dtype="bfloat16", target="sm90").info()["schedule"] == "sm80"


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("variant", ["causal", "deterministic-window-softcap"])
def test_sm90_backward_at_d96_builds_without_spills(variant):
    """head_dim 96 on wgmma (``knobs.BACKWARD_HEAD_DIMS``), the default on sm_90a: no multiple of 64, so
    dkdv's q and dout come by TMA in the 64-byte swizzle (rows of 32 columns: descriptors of layout type 2,
    none of type 1), and dq's share by vector atomics (a warpgroup's 48 columns are no rows of the TMA
    reduction's 32 floats). Every kernel compiles through ptxas with no stack frame and no spill: with the
    defaults (causal, dq_atomic), and deterministic (the dq pass) under a window and a softcap."""
    from conftest import ptxas_report

    options = ({"causal": True} if variant == "causal"
               else {"deterministic": True, "window_size": (100, 20), "softcap": 30.0})
    kernel = tvmflash.compile_backward(head_dim=96, dtype="bfloat16", target="sm90", **options)
    assert kernel.info()["schedule"] == "sm90" and kernel.knobs["dq_reduce"] == "vector"
    assert kernel.dq_atomic == (variant == "causal")
    src = kernel.source(heads_q=4, heads_kv=2)
    assert {layout for *_, layout in descriptors(src)} == {"0", "2"}  # padded core matrices, 64-byte swizzle
    assert "tvmflash_tma_load_5d(" in src and ("tvmflash_red_add_v4_shared(" in src) == kernel.dq_atomic
    report = ptxas_report(src, "sm_90a")
    assert len(report) == 3  # delta, dkdv, and convert_dq or dq
    for name, lines in report.items():
        assert "0 bytes stack frame, 0 bytes spill stores" in lines, (name, lines)


def test_sm90_backward_checks_at_d96_and_d256():
    """Without a build: d96's defaults pass the backward's checks; its TMA reduction of dq's share (48
    columns a warpgroup) and its producer warpgroup (ptxas spills) are refused. At d256 a dkdv tile that
    keeps all of dk's and dv's columns fits no tile (256 registers a thread before s and dp): the defaults
    there split the columns in two (``dkdv_slices``), a warpgroup a slice of the same 64 keys, and then pass.
    A slice must start on a whole swizzled group; a tile a slice (``dkdv_slicing`` "grid") leaves dq's share
    to atomics or a shared-memory tile."""
    backward = sm90_knobs.BACKWARD
    assert backward.problem(backward.defaults(96), 96, "bfloat16") is None
    assert "multiple of 32, got 48" in backward.problem({"dq_reduce": "tma"}, 96, "bfloat16")
    assert "take 'thread'" in backward.problem({"dkdv_producer": "warpgroup"}, 96, "bfloat16")
    for point in backward.points():  # the tuner's points keep one slice
        assert "registers" in (backward.problem(point, 256, "bfloat16") or ""), point
    d256 = backward.defaults(256)
    assert backward.problem(d256, 256, "bfloat16") is None
    assert (d256["dkdv_slices"], d256["dkdv_slicing"], d256["block_n"], d256["ds_buffers"], d256["dq_reduce"],
            d256["dkdv_producer"]) == (2, "rows", 64, 1, "atomic", "thread")
    assert sm90_knobs.dkdv_rows(d256) == 128  # two warpgroups
    assert "registers" in backward.problem({**d256, "dkdv_slices": 1}, 256, "bfloat16")
    assert backward.problem({**d256, "dkdv_slicing": "grid", "ds_buffers": 2}, 256, "bfloat16") is None
    assert "dq_reduce" in backward.problem({**d256, "dkdv_slicing": "grid", "dq_reduce": "tma"}, 256, "bfloat16")
    assert "whole" in backward.problem({"dkdv_slices": 2}, 96, "bfloat16")  # 48 columns: no whole 32-column group
    # q and dout of two stages, K and V, dsᵀ in two buffers: within the 227 KiB of a block
    assert sm90_knobs.backward_shared_memory_bytes(256, "bfloat16", d256) <= 227 * 1024
    assert sm90_knobs.backward_shared_memory_bytes(256, "bfloat16", {**d256, "dq_atomic": False}) <= 227 * 1024
    assert sm90_knobs.backward_shared_memory_bytes(256, "bfloat16", backward.defaults(256, varlen=True)) <= 227 * 1024
    assert {96, 256} <= set(sm90_knobs.BACKWARD_HEAD_DIMS)


@pytest.mark.parametrize("head_dim, variant, schedule", [
    (96, {}, "sm90"), (256, {}, "sm90"), (256, {"causal": True}, "sm90"), (256, {"varlen": True}, "sm90"),
    (256, {"dropout": True}, "sm90"), (256, {"alibi": True, "softcap": 30.0}, "sm90"),
    (256, {"window_left": 100, "window_right": 20}, "sm90"), (256, {"dtype": "float16"}, "sm90"),
    (256, {"dtype": "float32"}, "simt"),  # wgmma takes 16-bit operands
])
def test_sm90_backward_is_the_default_at_d256(head_dim, variant, schedule):
    """On sm_90a the sm90 backward is chosen at d256 (it was the SIMT's), with every variant of 16-bit inputs;
    deterministic takes the dq pass in 64-row blocks (two of 128 rows do not fit next to the K/V stages),
    and dkdv a tile a slice (``dq_pass_by_head_dim``) unless the caller says otherwise."""
    from tvmflash import choice
    from tvmflash import target as targets

    spec = {"head_dim": head_dim, "dtype": "bfloat16", "causal": False, **variant}
    chosen = choice.backward(targets.resolve("sm90"), spec, None)
    assert chosen.schedule.name == schedule
    if schedule == "sm90" and head_dim == 256:
        assert chosen.knobs["dkdv_slices"] == 2
        deterministic = choice.backward(targets.resolve("sm90"), spec, None, deterministic=True)
        assert (deterministic.knobs["dq_atomic"], deterministic.knobs["dq_block_m"],
                deterministic.knobs["dkdv_slicing"]) == (False, 64, "grid")
        given = choice.backward(targets.resolve("sm90"), spec, {"dkdv_slicing": "rows"}, deterministic=True)
        assert given.knobs["dkdv_slicing"] == "rows"  # the caller's knobs over dq_pass_by_head_dim


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("variant", ["causal", "deterministic-window-softcap", "varlen-alibi", "grid"])
def test_sm90_backward_at_d256_builds_without_spills(variant):
    """head_dim 256 on wgmma, the default on sm_90a: each of dkdv's two warpgroups makes dk, dv and dq's share
    of one half of the columns for the same 64 keys (``dkdv_slices`` 2, ``dkdv_slicing`` "rows": its slice's q
    and dout two 128-byte swizzled groups, 1024 16-byte units, in; its K the same). Every kernel compiles
    through ptxas with no stack frame and no spill: the defaults (causal, dq's share by atomics),
    deterministic (the dq pass, whose dkdv takes a tile a slice: ``dkdv_slicing`` "grid", one warpgroup,
    blockIdx.x's low bit the slice) under a window and a softcap, varlen (cp.async in one stage) with ALiBi,
    and a tile a slice with dq's share."""
    from conftest import ptxas_report

    options = {"causal": {"causal": True},
               "deterministic-window-softcap": {"deterministic": True, "window_size": (100, 20), "softcap": 30.0},
               "varlen-alibi": {"varlen": True, "alibi": True, "causal": True},
               "grid": {"causal": True, "knobs": {"dkdv_slicing": "grid", "ds_buffers": 2}}}[variant]
    kernel = tvmflash.compile_backward(head_dim=256, dtype="bfloat16", target="sm90", **options)
    assert kernel.info()["schedule"] == "sm90" and kernel.knobs["dkdv_slices"] == 2
    assert kernel.dq_atomic == (variant != "deterministic-window-softcap")
    src = kernel.source(heads_q=4, heads_kv=2)
    # a tile a slice with the dq pass (``dq_pass_by_head_dim``: two warpgroups spill there under a softcap)
    grid = variant in ("grid", "deterministic-window-softcap")
    assert kernel.knobs["dkdv_slicing"] == ("grid" if grid else "rows")
    threads = 128 if grid else 256  # a warpgroup a slice; thread 0 issues the TMA copies
    assert f"__launch_bounds__({threads}) dkdv_kernel" in src
    assert "m64n128k16" in src  # dk, dv (and dq's share) of 128 columns
    if variant in ("causal", "grid"):  # the slice's first column in q and dout
        assert ("((((int)blockIdx.x) & 1) * 1024)" if variant == "grid" else "(warpgroup * 1024)") in src
    report = ptxas_report(src, "sm_90a")
    assert len(report) == 3  # delta, dkdv, and convert_dq or dq
    for name, lines in report.items():
        assert "0 bytes stack frame, 0 bytes spill stores" in lines, (name, lines)


def test_sm90_one_stage_products_share_one_fence():
    """With one stage (plain loads), s's fence.proxy.async and barrier make a step's tiles visible to
    both of its products from shared memory: dp adds none of its own. dkdv: s's and dq's share's (it
    reads dsᵀ, copied to shared memory in the step); dq: s's alone."""
    fence = "fence_proxy_proxy_async_shared__cta();"
    kernel = tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90",
                                       knobs={"dkdv_stages": 1, "dkdv_copy": "cp.async", "dq_atomic": True})
    src = kernel.source(heads_q=4, heads_kv=2)
    assert src[src.rindex("dkdv_kernel("):src.rindex("convert_dq_kernel(")].count(fence) == 2
    kernel = tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90",
                                       knobs={"dq_atomic": False, "dq_stages": 1})
    src = kernel.source(heads_q=4, heads_kv=2)
    assert src[src.rindex("dq_kernel("):].count(fence) == 1


def test_sm90_dkdv_by_tma_builds_cuda_source():
    """dkdv_copy "tma": one thread copies each Q block's q and dout (5-D tensor maps, swizzled) and its
    rows' lse and delta (3-D, no swizzle) on the stage's mbarrier; no thread copies them by cp.async,
    and the step's tiles need no block-wide barrier (the dsᵀ staging keeps its two). Refused with
    one stage or a head_dim not a multiple of 32, and for varlen, whose rows past a sequence's
    end must read as zeros."""
    knobs = {"dkdv_stages": 2, "dkdv_copy": "tma"}
    kernel = tvmflash.compile_backward(head_dim=128, dtype="bfloat16", causal=True, target="sm90", knobs=knobs)
    src = kernel.source(heads_q=4, heads_kv=2)
    dkdv = src[src.rindex("dkdv_kernel("):src.rindex("convert_dq_kernel(")]
    assert dkdv.count("tvmflash_tma_load_5d(") == 4 and dkdv.count("tvmflash_tma_load_3d(") == 4  # prologue, loop
    assert "cp_async" not in dkdv and "CUtensorMap LSE2_tensormap" in src and "CUtensorMap Delta_tensormap" in src
    loop = dkdv[dkdv.index("for (int g_t_fused"):]
    assert loop[:loop.index("tvmflash_release_after_wgmma")].count("__syncthreads()") == 0
    for bad, match in (({"dkdv_stages": 1, "dkdv_copy": "tma"}, "dkdv_stages >= 2"),
                       ({"dkdv_copy": "bulk"}, "dkdv_copy: the sm90 schedule takes")):
        with pytest.raises(ValueError, match=match):
            tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90", knobs=bad)
    with pytest.raises(ValueError, match="varlen on the sm90 backward takes {'dkdv_copy': 'cp.async'"):
        tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90", knobs=knobs, varlen=True)
    varlen = tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90", varlen=True)
    assert varlen.knobs["dkdv_copy"] == "cp.async"


def test_sm90_dkdv_rows_values_come_by_tma_into_shared_memory():
    """The Q block's rows' lse · log2 e and delta (load_lse, load_delta) come by TMA with its q and dout, on the
    stage's mbarrier, into shared memory, and the consumers read them from there: their step loop reads no
    global memory (its only global pointers are dk's and dv's, stored after it)."""
    kernel = tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90")
    assert kernel.knobs["dkdv_copy"] == "tma" and kernel.knobs["dkdv_producer"] == "warpgroup"
    src = kernel.source(heads_q=4, heads_kv=2)
    dkdv = src[src.rindex("dkdv_kernel("):src.rindex("convert_dq_kernel(")]
    producer, consumers = dkdv.split("tvmflash_setmaxnreg_inc();")
    for name in ("LSE2", "Delta"):
        barriers = re.findall(rf"tvmflash_tma_load_3d\(.*?\(&\({name}_tensormap\)\)\), (.*?\]\)\))", producer)
        q_barriers = re.findall(r"tvmflash_tma_load_5d\(.*?\(&\(Q_tensormap\)\)\), (.*?\]\)\))", producer)
        assert len(barriers) == 2 and barriers == q_barriers, (barriers, q_barriers)  # prologue, loop
    loop = consumers[consumers.index("for (int g_t_fused"):]
    local = set(re.findall(r"alignas\(\d+\) \w+ (\w+)_ptr\[", dkdv))  # each thread's arrays
    assert set(re.findall(r"\b(\w+)_ptr\b", loop)) - local - {"buf_dyn_shmem"} == {"dK", "dV"}
    assert "LSE2_ptr" not in dkdv and "Delta_ptr" not in dkdv


def test_sm90_dkdv_staged_store_builds_cuda_source():
    """dkdv_store "staged": dk and dv go out in 16-byte row pieces from a padded tile each (no 4-byte stores
    from the registers), the tiles in the K and V tiles' shared memory (the offsets of the tile loads at the
    tile's start: no more shared memory than "direct"), written after the consumers' barrier (the other
    warpgroup's last products read K and V) and read after another. Refused with dkdv_persistent (the walk
    keeps K and V live), and "direct" for varlen."""
    for head_dim in (64, 128):
        kernel = tvmflash.compile_backward(head_dim=head_dim, dtype="bfloat16", target="sm90",
                                           knobs={"dkdv_store": "staged"})
        src = kernel.source(heads_q=4, heads_kv=2)
        dkdv = src[src.rindex("dkdv_kernel("):src.rindex("convert_dq_kernel(")]
        stores = [line.strip() for line in dkdv.splitlines() if re.search(r"\bd[KV]_ptr\b", line) and "=" in line
                  and "__global__" not in line]
        assert len(stores) == 2
        assert all(line.startswith(("*(uint4*)(dK_ptr + ", "*(uint4*)(dV_ptr + ")) for line in stores)
        kv = set(re.findall(r"buf_dyn_shmem_ptr\) \+ \([^;]*?\+ (\d+)\)\) = condval", dkdv))
        staged = {re.search(r"buf_dyn_shmem_ptr\) \+ \(.*\+ (\d+)\)\);$", line).group(1) for line in stores}
        assert len(kv) == 2 and staged == kv, (kv, staged)
        epilogue = dkdv[dkdv.rindex("tvmflash_bulk_wait();"):]
        first_write = epilogue.index("*(nv_bfloat162*)(((nv_bfloat16*)buf_dyn_shmem_ptr)")
        assert "tvmflash_named_barrier(1, 256);" in epilogue[:first_write]
        assert "tvmflash_named_barrier(1, 256);" in epilogue[epilogue.rindex("nv_bfloat162"):epilogue.index("dK_ptr")]
    default = tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90").source(heads_q=4, heads_kv=2)
    assert "*(nv_bfloat162*)(dK_ptr + " in default  # "direct": the pairs from the registers
    with pytest.raises(ValueError, match="dkdv_store 'staged' puts dk and dv"):
        tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90",
                                  knobs={"dkdv_store": "staged", "dkdv_persistent": True})
    with pytest.raises(ValueError, match="varlen on the sm90 backward takes .*'dkdv_store': 'direct'"):
        tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90", knobs={"dkdv_store": "staged"},
                                  varlen=True)


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_dkdv_staged_store_builds_without_spills(head_dim, causal):
    """dkdv_store "staged" compiles through ptxas with no stack frame and no spill (d256: dk and dv in two
    slices, 254 registers a thread)."""
    from conftest import ptxas_report

    kernel = tvmflash.compile_backward(head_dim=head_dim, dtype="bfloat16", target="sm90", causal=causal,
                                       knobs={"dkdv_store": "staged"})
    report = ptxas_report(kernel.source(heads_q=4, heads_kv=2), "sm_90a")
    lines = next(lines for name, lines in report.items() if "dkdv" in name)
    assert "0 bytes stack frame, 0 bytes spill stores" in lines, lines


def test_sm90_dkdv_kv_by_tma_builds_cuda_source():
    """dkdv_kv_copy "tma": thread 0 of the first warpgroup copies the tile's K and V (5-D tensor maps, swizzled) on
    one barrier, the bytes of both expected at once (65536 at d128), and every consumer waits on it; no thread
    loads K or V, and the products read them in the 128-byte swizzle (sᵀ's and dpᵀ's A, dq's share's B). Refused
    where dq's share gives a warpgroup part of a swizzled group (d64, d96), with dkdv_persistent, and for varlen."""
    kernel = tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90", knobs={"dkdv_kv_copy": "tma"})
    src = kernel.source(heads_q=4, heads_kv=2)
    dkdv = src[src.rindex("dkdv_kernel("):src.rindex("convert_dq_kernel(")]
    assert "CUtensorMap K_tensormap" in src and "CUtensorMap V_tensormap" in src
    assert "K_ptr" not in dkdv.replace("dK_ptr", "") and "V_ptr" not in dkdv.replace("dV_ptr", "")
    consumers = dkdv.split("tvmflash_setmaxnreg_inc();")[1]
    lines = [line.strip() for line in consumers.splitlines()]
    start = lines.index("if ((((int)threadIdx.y) == 0) && (((int)threadIdx.x) == 0)) {")
    expect, k_copy, v_copy = lines[start + 1:start + 4]
    barrier = re.fullmatch(r"tvmflash_mbarrier_expect_tx\((.*), 65536\);", expect).group(1)
    tile = r"tvmflash_tma_load_5d\((\(&\(\(\(nv_bfloat16\*\)buf_dyn_shmem_ptr\)\[\d+\]\)\)), "
    k_tile = re.match(tile + r"\(\(unsigned long long\)\(&\(K_tensormap\)\)\), " + re.escape(barrier), k_copy).group(1)
    v_tile = re.match(tile + r"\(\(unsigned long long\)\(&\(V_tensormap\)\)\), " + re.escape(barrier), v_copy).group(1)
    assert consumers.index(f"tvmflash_mbarrier_wait({barrier}, 0);") < consumers.index("for (int g_t_fused")
    for tile in (k_tile, v_tile):  # the 128-byte swizzle (layout type 1) wherever a product reads the tile
        layouts = set(re.findall(rf"tvmflash_wgmma_descriptor\({re.escape(tile)}, [^;]*?, \d+, \d+, (\d)\)", dkdv))
        assert layouts == {"1"}, (tile, layouts)
    for knobs, head_dim, match in (({}, 64, "32 columns a warpgroup"), ({}, 96, "48 columns a warpgroup"),
                                   ({"dkdv_persistent": True}, 128, "no dkdv_persistent")):
        with pytest.raises(ValueError, match=match):
            tvmflash.compile_backward(head_dim=head_dim, dtype="bfloat16", target="sm90",
                                      knobs={"dkdv_kv_copy": "tma", **knobs})
    with pytest.raises(ValueError, match="varlen on the sm90 backward takes .*'dkdv_kv_copy': 'threads'"):
        tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90", knobs={"dkdv_kv_copy": "tma"},
                                  varlen=True)


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("head_dim,options", [(128, {}), (128, {"dkdv_store": "staged"}), (256, {}),
                                              (64, {"deterministic": True})],
                         ids=["128", "128-staged", "256", "64-deterministic"])
def test_sm90_dkdv_kv_by_tma_builds_without_spills(head_dim, options):
    """dkdv_kv_copy "tma" compiles through ptxas with no stack frame and no spill without a mask (under a causal
    mask at d128 ptxas spills 4 bytes: ``knobs.BACKWARD``'s comment)."""
    from conftest import ptxas_report

    deterministic = options.pop("deterministic", False) if options else False
    kernel = tvmflash.compile_backward(head_dim=head_dim, dtype="bfloat16", target="sm90", deterministic=deterministic,
                                       knobs={"dkdv_kv_copy": "tma", **options})
    report = ptxas_report(kernel.source(heads_q=4, heads_kv=2), "sm_90a")
    lines = next(lines for name, lines in report.items() if "dkdv" in name)
    assert "0 bytes stack frame, 0 bytes spill stores" in lines, lines


def test_sm90_wgmma_overlap_waits_later():
    """wgmma_overlap: dp's wgmma is only committed, and the exponentials of p come before its wait;
    dv's is only committed, and dk's wait ends both. Without it each product is waited for at once."""
    for overlap in (True, False):
        kernel = tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90",
                                           knobs={"wgmma_overlap": overlap})
        src = kernel.source(heads_q=4, heads_kv=2)
        dkdv = src[src.rindex("dkdv_kernel("):src.rindex("convert_dq_kernel(")]
        loop = dkdv[dkdv.index("for (int g_t_fused"):]
        wait = "wait_group_sync_aligned_0()"
        dp = loop.index("(dP_local_ptr[0], dP_local_ptr[1]")
        dv = loop.index("(dv_acc_local_ptr[0], dv_acc_local_ptr[1]")
        dk = loop.index("(dk_acc_local_ptr[0], dk_acc_local_ptr[1]")
        assert ("exp2f(" in loop[dp:loop.index(wait, dp)]) == overlap
        assert (loop.index(wait, dv) > dk) == overlap


def test_sm90_persistent_dkdv_builds_cuda_source():
    """dkdv_persistent: knobs.PERSISTENT_BLOCKS thread blocks walk dkdv's tiles (one kernel for any batch and
    length: the walk's trip count reads them). The barriers are set up once, before the producer's and the
    consumers' branches; each side walks the tiles in a loop of its own (setmaxnreg once each), its counter
    from 0 a tile and the tile's phases carried in a bit a stage; the consumers meet at their named barrier
    as each tile starts; the kernel says one thread block an SM (``__launch_bounds__(384, 1)``). Refused with
    cp.async copies, for varlen, and under a BlockMask."""
    from tvmflash.schedules.sm90 import knobs as sm90

    kernel = tvmflash.compile_backward(head_dim=128, dtype="bfloat16", causal=True, target="sm90",
                                       knobs={"dkdv_persistent": True})
    assert kernel.knobs["dkdv_producer"] == "warpgroup" and sm90.PERSISTENT_BLOCKS == 132
    src = kernel.source(heads_q=4, heads_kv=2)
    dkdv = src[src.rindex("dkdv_kernel("):src.rindex("convert_dq_kernel(")]
    assert "__launch_bounds__(384, 1) dkdv_kernel(" in src
    assert dkdv.count("tvmflash_mbarrier_init(") == 4 and dkdv.count("tvmflash_setmaxnreg_dec();") == 1
    producer, consumers = dkdv.split("tvmflash_setmaxnreg_inc();")
    assert dkdv.index("tvmflash_mbarrier_init(") < dkdv.index("tvmflash_setmaxnreg_dec();")
    for side, counter in ((producer, "tma_issued_ptr"), (consumers, "tma_consumed_ptr")):
        walk = side[side.index("for (int kbc_b_hk_fused_0"):]
        assert "132) + ((int)blockIdx.x)) <" in walk  # the thread block's tiles: every 132nd
        assert walk.index(f"{counter}[0] = 0;") < walk.index("for (int g_t_fused")  # a tile's count from 0
        assert f"tma_phases_ptr[0] = (tma_phases_ptr[0] ^ " in walk  # its phases carried to the next tile
    start = consumers[consumers.index("tma_consumed_ptr[0] = 0;"):]
    assert start.index("tvmflash_named_barrier(1, 256);") < start.index("K_ptr")  # before the tile's K and V
    assert "__syncthreads" not in consumers
    with pytest.raises(ValueError, match="dkdv_persistent carries"):
        tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90",
                                  knobs={"dkdv_persistent": True, "dkdv_copy": "cp.async", "dkdv_producer": "thread",
                                         "dq_reduce": "vector"})
    assert "spills" in sm90.BACKWARD.problem({**sm90.BACKWARD.defaults(256), "dkdv_persistent": True}, 256, "bfloat16")
    with pytest.raises(ValueError, match="varlen on the sm90 backward takes .*'dkdv_persistent': False"):
        tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90", knobs={"dkdv_persistent": True},
                                  varlen=True)


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("head_dim, options", [(64, {"causal": True}), (128, {"window_size": (64, 0)})])
def test_sm90_persistent_dkdv_builds_without_spills(head_dim, options):
    """dkdv_persistent compiles through ptxas with no stack frame and no spill, and ptxas keeps setmaxnreg (at
    d64 it ignored it, C7508, with ``__launch_bounds__(384)`` alone, and spilled at 168 registers). (d96, with
    thread 0 issuing the copies, builds in test_sm90_backward_gradients.py's GPU test.)"""
    from conftest import ptxas_report

    kernel = tvmflash.compile_backward(head_dim=head_dim, dtype="bfloat16", target="sm90",
                                       knobs={"dkdv_persistent": True}, **options)
    report = ptxas_report(kernel.source(heads_q=8, heads_kv=2), "sm_90a")
    lines = next(lines for name, lines in report.items() if "dkdv" in name)
    assert "0 bytes stack frame, 0 bytes spill stores" in lines, lines
    assert not any("C7508" in lines for lines in report.values())


@pytest.mark.parametrize("stages", [2, 3])
def test_persistent_walk_waits_for_each_barriers_next_phase(stages):
    """The TMA lowering's phases under a persistent walk (``tma_plan.Plan.parity``, ``Plan.tile_done``), against
    a model of the mbarriers: over tiles of random step counts (0 included: a window's empty tiles), each
    counted from 0, the consumers' k-th wait on stage s's full barrier is for its k-th completion (parity
    k % 2), and the producer's refill of stage s waits for the release of its previous fill (that completion's
    parity), or on parity 1 (which a barrier that never completed passes) where stage s was never filled."""
    import random

    from tvm import tirx

    from tvmflash.lowering.ir import loaded
    from tvmflash.lowering.tma_plan import Plan

    plan = object.__new__(Plan)
    plan.num_stages, plan.persistent = stages, True
    plan.phases = tirx.decl_buffer((1,), "int32", "tma_phases", scope="local")
    count = tirx.decl_buffer((1,), "int32", "tma_count", scope="local")

    arithmetic = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
                  "FloorDiv": lambda a, b: a // b, "FloorMod": lambda a, b: a % b, "BitwiseXor": lambda a, b: a ^ b,
                  "BitwiseAnd": lambda a, b: a & b, "RShift": lambda a, b: a >> b, "LShift": lambda a, b: a << b}

    def value(expr, phases, counted):  # the expression at the two registers' values, as the GPU reckons it
        kind = type(expr).__name__
        if kind == "IntImm":
            return expr.value
        if kind in ("TensorLoad", "BufferLoad"):
            return {"tma_phases": phases, "tma_count": counted}[loaded(expr).name]
        return arithmetic[kind](value(expr.a, phases, counted), value(expr.b, phases, counted))

    rng = random.Random(0)
    tiles = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(60)]
    fills, waits = [0] * stages, [0] * stages
    producer = consumers = 0  # each side's phases register
    for steps in tiles:
        for j in range(steps):
            stage = j % stages  # the pipeline's stage: its step mod the stages, from 0 each tile
            refill = value(tirx.bitwise_xor(plan.parity(tirx.const(j, "int32"), stage), 1), producer, j)
            assert refill == ((fills[stage] - 1) % 2 if fills[stage] else 1), (steps, j)
            fills[stage] += 1
            assert value(plan.parity(tirx.const(j, "int32"), stage), consumers, j) == waits[stage] % 2, (steps, j)
            waits[stage] += 1
        producer = value(plan.tile_done(count).value, producer, steps)
        consumers = value(plan.tile_done(count).value, consumers, steps)
