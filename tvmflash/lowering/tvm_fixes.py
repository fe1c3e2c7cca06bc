"""Passes that work around bugs and gaps of TVM 0.27's own lowering and CUDA code generation.

Each is a pass in ``pipeline.py``'s list, says which TVM behaviour it works around, and should be
dropped once the TVM that tvmflash pins fixes it (``tests/test_generated_cuda.py`` then shows
what changes). tvmflash's own lowerings are in the other modules of this package.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.script import tirx as T

from tvmflash.lowering.ir import folded, is_attr, is_call, prim_func_pass


def LowerWarpMemoryToFixpoint():  # noqa: N802 - named as TVM's passes are
    """Run ``tirx.transform.LowerWarpMemory`` until it changes nothing.

    TVM 0.27: one run lowers only the first "warp"-scope allocation it meets; the others stay one
    full copy of the warp's tile per thread, and intrinsics that assume the lowered layout (mma
    fill) then write the wrong elements.
    """
    one = tirx.transform.LowerWarpMemory()

    @tvm.transform.module_pass(opt_level=0, name="tvmflash.LowerWarpMemoryToFixpoint")
    def run(mod, _ctx):
        for _ in range(64):
            lowered = one(mod)
            if tvm_ffi.structural_equal(lowered, mod):
                break
            mod = lowered
        return mod

    return run


def CompactAgainAfterMatchBuffers():  # noqa: N802
    """``s_tir.transform.CompactBufferAllocation`` once more, right after ``LowerMatchBuffer``'s
    StmtSimplify, and a StmtSimplify after it.

    TVM 0.27 compacts buffers once, before ``LowerMatchBuffer``: a tensorized block's
    ``match_buffer`` region then counts as accessed by every thread, so a "local" buffer that each
    lane touches at a lane-dependent index (the sm80 row_state "registers" per-row values: row
    8 k + lane // 4 of each warp, matched as the warp's whole (4, 8) tile by the quad intrinsics)
    keeps the whole warp's shape, indexed with ``threadIdx.x >> 2``, and nvcc puts it in local
    memory. Once the match buffers are lowered, the accesses are plain loads and stores at
    ``[k, threadIdx.x // 4]``, and the same pass (threadIdx is not relaxed for "local" scope)
    shrinks them to the 4 values each thread owns. On the other buffers it is a no-op.
    """
    return tvm.transform.Sequential([s_tir.transform.CompactBufferAllocation(), s_tir.transform.StmtSimplify()],
                                    name="tvmflash.CompactAgainAfterMatchBuffers")


# Function attributes that TVM's CUDA code generator turns into __launch_bounds__ / __maxnreg__.
LAUNCH_BOUNDS_ATTRS = ("tirx.launch_bounds_min_blocks_per_sm", "tirx.launch_bounds_max_blocks_per_cluster",
                       "tirx.max_registers")


def LaunchBoundsOnKernels():  # noqa: N802
    """After ``tirx.transform.SplitHostDevice``: copy the launch-bounds attributes of the PrimFunc
    onto the device kernels that it made of it.

    TVM 0.27's CUDA code generator reads ``tirx.launch_bounds_min_blocks_per_sm`` (and the others
    above) from the device kernel, but SplitHostDevice leaves them on the host function, so
    ``__launch_bounds__(threads, min_blocks)`` is never emitted for a scheduled PrimFunc.
    """
    @tvm.transform.module_pass(opt_level=0, name="tvmflash.LaunchBoundsOnKernels")
    def run(mod, _ctx):
        kernel_launch = 2  # CallingConv::kDeviceKernelLaunch
        kernels = [gvar for gvar, func in mod.functions.items()
                   if func.attrs is not None and int(func.attrs.get("calling_conv", 0)) == kernel_launch]
        attrs = {gvar.name_hint: {key: func.attrs[key] for key in LAUNCH_BOUNDS_ATTRS if key in func.attrs}
                 for gvar, func in mod.functions.items()
                 if func.attrs is not None and not any(gvar.same_as(k) for k in kernels)}
        for gvar in kernels:
            # the host function's own kernel (SplitHostDevice names it "<host>_kernel"), or with one host
            # function that has any, every kernel
            own = attrs.get(gvar.name_hint.removesuffix("_kernel"))
            given = [a for a in attrs.values() if a]
            func = mod[gvar]
            for key, value in (own if own is not None else given[0] if len(given) == 1 else {}).items():
                func = func.with_attr(key, value)
            mod[gvar] = func
        return mod

    return run


_CP_ASYNC = "tirx.s_tir.cp_async_raw"  # the raw cp.async that InjectPTXAsyncCopy emits


def _zero_filling(call):
    """A predicated 16-byte cp.async as our own helper: ``cp.async ..., 16, src_size`` with src_size
    16 or 0, with CUTLASS's L2 prefetch hint (``.L2::128B``: L2 fetches the copy's whole 128-byte
    line). The decode, whose K/V tiles are these copies, measured faster with the hint than without
    it or with ``.L2::256B``."""
    dst, dst_offset, src, src_offset, size, predicate = call.args
    dst_bytes, src_bytes = (tvm.DataType(str(ptr.ty.element_type.dtype)).bits // 8 for ptr in (dst, src))
    wide = str(src_offset.ty) == "int64"  # an offset into a tensor of 2**31 elements or more (WidenGlobalIndices)
    name = f"tvmflash_cp_async_zfill_16_{dst_bytes}_{src_bytes}" + ("_i64" if wide else "")
    source = (
        f"\n__forceinline__ __device__ void {name}(void* dst, int dst_off, void* src, "
        f"{'long long' if wide else 'int'} src_off, int predicate) {{\n"
        f"  unsigned int dst_addr = __cvta_generic_to_shared((uint8_t*)dst + dst_off * {dst_bytes});\n"
        f"  uint8_t* src_p = (uint8_t*)src + src_off * {src_bytes};\n"
        "  // src-size 0 reads nothing and fills the 16 bytes with zeros\n"
        '  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;"\n'
        '               :: "r"(dst_addr), "l"(src_p), "r"(predicate ? 16 : 0));\n'
        "}\n"
    )
    return T.cuda.func_call(name, dst, dst_offset, src, src_offset, predicate, source_code=source)


def ZeroFillingCpAsync():  # noqa: N802
    """After ``InjectPTXAsyncCopy``: each bounds-checked 16-byte cp.async becomes one zero-filling
    ``cp.async ..., 16, src_size`` (src_size 16 or 0), as CUTLASS's and Triton's masked copies.

    TVM 0.27's CUDA code generator prints InjectPTXAsyncCopy's predicated copy as ``@p cp.async``
    then ``@!p st.shared.v4 0``: in SASS an LDGSTS, an STS and three never-executed LDS fillers per
    copy. The zero-filling form is one LDGSTS with the
    same result.
    """
    def rewrite(call):
        if is_call(call, _CP_ASYNC) and len(call.args) == 6 and int(call.args[4]) == 16:
            return _zero_filling(call)
        return call

    return prim_func_pass(lambda func: func.with_body(tvm_ffi.structural_map(func.body, (tvm.ir.expr.Call, rewrite))),
                          "tvmflash.ZeroFillingCpAsync")


def _wait_then_proxy_fence(n: int):
    helper = f"tvmflash_cp_async_wait_group_{n}_proxy_fence"
    source = (f"\n__forceinline__ __device__ void {helper}() {{\n"
              f'  asm volatile("cp.async.wait_group {n};\\n\\tfence.proxy.async.shared::cta;" ::: "memory");\n}}\n')
    return T.cuda.func_call(helper, source_code=source)


def _constant_wait(attr, proxy_fence: bool):
    """An ``async_wait_queue_scope`` AttrStmt (around ``async_wait_inflight_count``) with its count
    folded; with ``proxy_fence``, the wait and fence as one call of ours, then the body."""
    count = attr.body
    if not is_attr(count, "async_wait_inflight_count"):
        return attr
    n = folded(count.value)
    if proxy_fence:
        return tirx.SeqStmt([tirx.Evaluate(_wait_then_proxy_fence(int(n))), count.body])
    return tirx.AttrStmt(attr.node, attr.attr_key, attr.value,
                         tirx.AttrStmt(count.node, count.attr_key, n, count.body))


def ConstantAsyncWaitCounts(proxy_fence: bool):  # noqa: N802
    """Fold each cp.async wait's count (an ``async_wait_inflight_count``, which the CUDA code
    generator prints as ``cp.async.wait_group``) such as ``if_then_else(True & True, 1, 0)`` to its
    constant; with ``proxy_fence``, make the wait our own call, followed by
    ``fence.proxy.async.shared::cta`` in the same asm.

    TVM 0.27's InjectSoftwarePipeline writes that form for a pipelined loop whose trip count depends
    on the thread block (causal attention with static shapes, as the tuner builds, and block_m 64),
    and its PTX code generator then rejects it: "cp_async_wait_group: immediate operands must become
    compile-time constants before CUDA codegen".

    proxy_fence (sm90, ``ASYNC_PROXY_OPERANDS_ATTR``): wgmma reads its shared-memory operands through
    the async proxy, and the pipeline puts the wait right before the tile's first consumer, after the
    fence and barrier that ThreadSync placed, so without it a tile's cp.async writes would be fenced
    before they have landed.
    """
    def rewrite(attr):
        return _constant_wait(attr, proxy_fence) if is_attr(attr, "async_wait_queue_scope") else attr

    return prim_func_pass(lambda func: func.with_body(tvm_ffi.structural_map(func.body, (tirx.AttrStmt, rewrite))),
                          "tvmflash.ConstantAsyncWaitCounts")
