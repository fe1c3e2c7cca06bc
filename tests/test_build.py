"""tvmflash's own passes in building a scheduled program (tvmflash.lowering)."""

import numpy as np
import tvm
from tvm.script import tirx as T

from tvmflash import lowering
from tvmflash.lowering.annotations import REVERSED


def test_a_loop_annotated_reversed_runs_last_to_first():
    """Each iteration records how many ran before it: reversed, iteration i is the (7 - i)-th."""

    @T.prim_func
    def visit_order(order: T.Buffer((8,), "int32"), count: T.Buffer((1,), "int32")):
        count[0] = 0
        for i in T.serial(8, annotations={REVERSED: 1}):
            order[i] = count[0]
            count[0] = count[0] + 1

    target = tvm.target.Target({"kind": "llvm"})
    run = lowering.build(tvm.IRModule({"main": visit_order}), target)
    order, count = (tvm.runtime.tensor(np.full(n, -1, "int32")) for n in (8, 1))
    run(order, count)
    assert order.numpy().tolist() == [7, 6, 5, 4, 3, 2, 1, 0]
    assert count.numpy().tolist() == [8]


def test_conditions_on_a_block_index_are_hoisted_out_of_their_loop():
    """TVM's HoistIfThenElse keeps a test that reads blockIdx.y inside its loop; with
    ``uniformity.HoistBlockIndexConditions`` it moves out (one branch, two loops), and blockIdx.y is itself
    again afterwards (no alias variable left)."""
    from tvm import s_tir

    from tvmflash.lowering import uniformity

    @T.prim_func
    def masked(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32"), n: T.int32):
        by = T.launch_thread("blockIdx.y", 4)
        for i in T.unroll(64):
            if by * 16 < n:
                b[i] = a[i]
            else:
                b[i] = T.if_then_else(i < n, a[i], T.float32(0))

    mod = tvm.IRModule({"main": masked})
    plain = s_tir.transform.HoistIfThenElse()(mod)["main"].script()
    hoisted = uniformity.HoistBlockIndexConditions()(mod)["main"].script()
    loops = "for i in T.unroll(64):"
    assert plain.count(loops) == 1 and plain.index(loops) < plain.index("if by * 16 < n")
    assert hoisted.count(loops) == 2 and hoisted.index("if by * 16 < n") < hoisted.index(loops)
    assert "alias" not in hoisted


def test_conditions_on_a_step_value_are_hoisted_out_of_the_element_loops_only():
    """A BlockMask's tile is a let of each K/V step (``uniformity.BindStepLoads``), which TVM's HoistIfThenElse
    keeps a condition in its loop for: the full-tile test was made per score. ``HoistBlockIndexConditions``
    moves it out of the element loop, and no further than the step's loop, after the let, even where the let's
    value does not read the step (``same``)."""
    from tvm import s_tir

    from tvmflash.lowering import uniformity

    @T.prim_func
    def walked(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32"), lists: T.Buffer((8,), "int32"),
               n: T.int32):
        T.launch_thread("blockIdx.y", 4)
        for t in range(8):
            tile = T.bind(lists[t])
            same = T.bind(lists[0])
            for i in T.unroll(64):
                if tile * 16 < n:
                    b[i] = a[i]
                else:
                    b[i] = T.if_then_else(tile * 16 + i < n, a[i], T.float32(0))
            for i in T.unroll(64):
                if same < t:
                    b[i] = a[i] + b[i]

    mod = tvm.IRModule({"main": walked})
    plain = s_tir.transform.HoistIfThenElse()(mod)["main"].script()
    hoisted = uniformity.HoistBlockIndexConditions()(mod)["main"].script()
    loops = "for i in T.unroll(64):"
    assert plain.count(loops) == 2 and plain.index(loops) < plain.index("if tile * 16 < n")
    assert hoisted.count(loops) == 3, hoisted
    steps, lets = hoisted.index("for t in range(8)"), hoisted.index("same: T.let")
    assert steps < hoisted.index("tile: T.let") < lets < hoisted.index("if tile * 16 < n") < hoisted.index(loops)
    assert lets < hoisted.index("if same < t") and "alias" not in hoisted


def test_adjacent_statements_under_one_uniform_condition_share_one_if():
    """``uniformity.MergeAdjacentGuards``: a pipeline's epilogue guards each statement on its own; runs of
    one condition that reads no buffer and no thread index become one ``if``, marked thread-invariant
    (so ThreadSync may place barriers inside). A condition on threadIdx.x, or on a buffer's value,
    stays where it is."""
    from tvmflash.lowering import uniformity

    @T.prim_func
    def guarded(a: T.Buffer((4,), "float32"), n: T.int32):
        tx = T.launch_thread("threadIdx.x", 32)
        if 1 <= n:
            a[0] = T.float32(1)
        if 1 <= n:
            a[1] = T.float32(2)
        if tx < n:
            a[2] = T.float32(3)
        if tx < n:
            a[3] = T.float32(4)
        if a[0] < T.float32(1):
            a[2] = T.float32(5)
        if a[0] < T.float32(1):
            a[3] = T.float32(6)

    merged = uniformity.MergeAdjacentGuards()(tvm.IRModule({"main": guarded}))["main"].script()
    assert merged.count("1 <= n") == 1 and "T.tvm_thread_invariant(1 <= n)" in merged
    assert merged.count("tx < n") == 2 and merged.count("a[0] < T.float32(1.0)") == 2


def test_a_block_masks_tile_is_read_once_a_step():
    """``uniformity.BindStepLoads``: the walk's tile (an ``if_then_else`` that reads a BlockMask's list at
    the step) is computed once at the top of the step's body, its load still under its condition; the
    tile of the last step, used by two statements after the loop and another loop, once just before
    the first of them (bound at the start, it would live through both loops)."""
    from tvmflash.lowering import uniformity

    @T.prim_func
    def walked(Counts: T.Buffer((4,), "int32"), Indices: T.Buffer((4, 8), "int32"), out: T.Buffer((64,), "int32"),
               n: T.int32):
        bx = T.launch_thread("blockIdx.x", 4)
        tx = T.launch_thread("threadIdx.x", 32)
        for t in range(n):
            out[tx] = T.if_then_else(t < Counts[bx], Indices[bx, T.min(t, 7)], 9) * 64 + tx
            out[tx + 32] = T.if_then_else(t < Counts[bx], Indices[bx, T.min(t, 7)], 9) * 64 + tx + 1
        for k in range(n):
            out[k] = out[k] + 1
        out[1] = T.if_then_else(n - 1 < Counts[bx], Indices[bx, T.min(n - 1, 7)], 9)
        out[2] = T.if_then_else(n - 1 < Counts[bx], Indices[bx, T.min(n - 1, 7)], 9) + 1

    bound = uniformity.BindStepLoads(("Counts", "Indices"))(tvm.IRModule({"main": walked}))["main"].script()
    assert bound.count("Indices[") == 2, bound
    step = "selected_t_0: T.let[T.int32] = T.if_then_else(t < "
    assert bound.index("for t in range(n):") < bound.index(step) < bound.index("out[tx] = selected_t_0 * 64 + tx")
    assert "out[tx + 32] = selected_t_0 * 64 + tx + 1" in bound
    last = "selected_0: T.let[T.int32] = T.if_then_else(n - 1 < "
    assert bound.index("for k in range(n):") < bound.index(last) < bound.index("out[1] = selected_0")
    assert "out[2] = selected_0 + 1" in bound


def test_a_divisor_of_loaded_offsets_is_computed_once_a_kernel():
    """``uniformity.BindLoadedDivisors``: a block-uniform divisor that reads the offsets
    ``BindBlockUniformLoads`` bound (varlen dkdv's Q block count, by which its fused step is divided) is
    computed once at the kernel's start from the loads themselves (a let of a pure value would be
    inlined again by StmtSimplify), read through ``max(., 0)`` where it is never negative; a divisor
    of a thread index and a constant one stay as they are, and the simplified kernel keeps the let."""
    from tvmflash.lowering import uniformity

    @T.prim_func
    def fused(Cu: T.Buffer((5,), "int32"), out: T.Buffer((64,), "int32"), n: T.int32):
        bz = T.launch_thread("blockIdx.z", 4)
        c0 = T.bind(Cu[bz])
        c1 = T.bind(Cu[bz + 1])
        tx = T.launch_thread("threadIdx.x", 32)
        for f in range(n):
            out[tx] = f // T.max(0, (c1 - c0 + 63) // 64) + f % T.max(0, (c1 - c0 + 63) // 64) * 64 + f % 8
            out[tx + 32] = (f + 1) % T.max(0, (c1 - c0 + 63) // 64) + f % (tx + 1)

    mod = uniformity.BindLoadedDivisors(("Cu",))(tvm.IRModule({"main": fused}))
    bound = mod["main"].script()
    assert "divisor_0: T.let[T.int32] = T.max(0, (Cu[bz + 1] - Cu[bz] + 63) // 64)" in bound, bound
    assert bound.count("divisor_") == 4 and "f % T.max(divisor_0, 0) * 64" in bound, bound
    assert "(f + 1) % T.max(divisor_0, 0)" in bound and "f % 8" in bound and "f % (tx + 1)" in bound
    with tvm.transform.PassContext(opt_level=3):
        simplified = tvm.tirx.transform.StmtSimplify()(mod)["main"].script()
    assert "divisor_0: T.let" in simplified and "(c1 - c0 + 63)" not in simplified.split("for f")[1], simplified


def test_exp2_on_the_cpu_is_a_vectorised_polynomial_as_exact_as_float32_needs():
    """``cpu_exp2.PolynomialExp2OnCPU``: a vectorised float32 exp2 built for the CPU calls no libm
    function, and matches float64's exp2 within 2e-7 relative where the result is a normal float;
    -inf and anything at or below -127 give 0, 128 and above inf, NaN stays NaN."""

    @T.prim_func
    def powers_of_two(x: T.Buffer((4096,), "float32"), y: T.Buffer((4096,), "float32")):
        for o in range(256):
            for i in T.vectorized(16):
                y[o * 16 + i] = T.exp2(x[o * 16 + i])

    target = tvm.target.Target({"kind": "llvm"})
    run = lowering.build(tvm.IRModule({"main": powers_of_two}), target)
    llvm_ir = run.mod.inspect_source("ll")
    assert "llvm.exp2" not in llvm_ir and "exp2f" not in llvm_ir

    rng = np.random.default_rng(0)
    special = [-np.inf, -1e30, -200.0, -127.0, -126.9, 0.0, -0.0, 0.5, -0.5, 127.4, 128.0, 300.0, np.inf, np.nan]
    x = np.concatenate([special, rng.uniform(-126, 127, 4096 - len(special))]).astype("float32")
    y = tvm.runtime.tensor(np.full(4096, -1, "float32"))
    run(tvm.runtime.tensor(x), y)
    got, want = y.numpy().astype("float64"), np.exp2(x.astype("float64"))
    normal = (x > -126) & (x < 127.5)
    assert np.max(np.abs(got[normal] / want[normal] - 1)) < 2e-7
    assert (got[x <= -127] == 0).all()
    assert np.isinf(got[x >= 128]).all() and (got[x >= 128] > 0).all()
    assert np.isnan(got[np.isnan(x)]).all()


def test_a_padded_tile_loads_without_its_test_where_the_whole_tile_is_inside():
    """``cpu_padding.VersionPaddedLoads``: a nest that loads rows zero-padded past ``n`` runs, where all its
    rows are below ``n``, a copy whose loads have no test; both copies give the padded tile."""

    @T.prim_func
    def padded(x: T.Buffer((100, 8), "float32"), y: T.Buffer((4, 32, 8), "float32")):
        for t, r, c in T.grid(4, 32, 8):
            y[t, r, c] = T.if_then_else(t * 32 + r < 100, x[T.min(t * 32 + r, 99), c], T.float32(0))

    from tvmflash.lowering import cpu_padding

    mod = tvm.IRModule({"main": padded.with_attr("target", tvm.target.Target({"kind": "llvm"}))})
    mod = tvm.tirx.transform.FlattenBuffer()(tvm.s_tir.transform.LowerOpaqueBlock()(mod))
    versioned = cpu_padding.VersionPaddedLoads()(mod)["main"].body
    branch = lowering.ir.find(versioned, tvm.tirx.IfThenElse)
    assert len(branch) == 1 and "if_then_else" not in str(branch[0].then_case)
    assert "if_then_else" in str(branch[0].else_case)

    x = np.random.default_rng(0).standard_normal((100, 8)).astype("float32")
    y = tvm.runtime.tensor(np.full((4, 32, 8), -1, "float32"))
    lowering.build(tvm.IRModule({"main": padded}), tvm.target.Target({"kind": "llvm"}))(tvm.runtime.tensor(x), y)
    assert (y.numpy().reshape(128, 8) == np.concatenate([x, np.zeros((28, 8), "float32")])).all()


def test_the_amx_tile_configuration_is_loaded_once_a_task():
    """``amx_config.OneTileConfigPerTask``: the AMX forward (built, not run: any host) loads its tile
    configuration once in its parallel task, for all of the task's tile products."""
    import torch

    import tvmflash

    kernel = tvmflash.compile(head_dim=64, dtype=torch.bfloat16,
                              target={"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
    build = kernel.build
    llvm_ir = lowering.build(build.programs(build.spec(2, 2)).mod, build.target, **build.options).mod.inspect_source("ll")
    assert llvm_ir.count("call void @llvm.x86.ldtilecfg") == 1 and llvm_ir.count("@llvm.x86.tdpbf16ps") > 8


def test_the_amx_backward_loads_its_tile_configuration_once_a_task():
    """The AMX backward (built, not run: any host): dkdv's task (and with the dq pass, dq's) loads the tile
    configuration once, for all of its steps' products (dkdv's five with dq's share, a task walking its K/V
    blocks in a loop of its own; with the dq pass dkdv's four, dq's three)."""
    import torch

    import tvmflash

    for knobs, tasks, products in ((None, 1, 5), ({"dq_atomic": False}, 2, 7)):
        kernel = tvmflash.compile_backward(head_dim=64, dtype=torch.bfloat16, knobs=knobs,
                                           target={"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
        assert kernel.info()["schedule"] == "amx" and kernel.dq_atomic == (knobs is None)
        build = kernel.build
        llvm_ir = lowering.build(build.programs(build.spec(2, 2)).mod, build.target, **build.options).mod.inspect_source("ll")
        assert llvm_ir.count("call void @llvm.x86.ldtilecfg") == tasks
        assert llvm_ir.count("@llvm.x86.tdpbf16ps") > products * 4


def test_every_lowering_module_is_in_the_build_cache_key():
    """``lowering.MODULES`` (whose source is in the build cache's key) holds every module of the package:
    a change to any pass builds anew."""
    from pathlib import Path

    here = {path.stem for path in Path(lowering.__file__).parent.glob("*.py") if path.stem != "__init__"}
    assert {module.__name__.rsplit(".", 1)[1] for module in lowering.MODULES} == here
