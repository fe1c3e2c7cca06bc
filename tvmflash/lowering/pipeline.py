"""tvmflash's TIR lowering pipeline: TVM 0.27's default pass list (``tvm/s_tir/pipeline.py``,
``default_s_tir_pipeline``), written out once, with tvmflash's passes in their places.

Every build, CPU and CUDA, the Kernel's and the tuner's, goes through ``build`` below, which runs
``tvm.compile(mod, target, tir_pipeline=PIPELINE)``. Lines marked ``+`` are tvmflash's own (each
module a role, listed in ``lowering/__init__.py``); lines marked ``fix`` work around TVM 0.27
(``tvm_fixes.py``); the rest is TVM's list as it stands, in its order.

A build's options travel as attributes of its PrimFunc (``annotations.*_ATTR``), set by ``build``
from the schedule's ``build_options``, and are read here when the pipeline runs.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from tvmflash.lowering import (amx_config, cp_async_barriers, cpu_exp2, cpu_padding, double_buffers, loops_and_blocks, philox, pragmas,
                               tile_alignment, tma_copies, tma_producer_warpgroup, tvm_fixes, uniformity, wide_indices)
from tvmflash.lowering.annotations import (ASYNC_PROXY_OPERANDS_ATTR, HOIST_BLOCK_INDEX_CONDITIONS_ATTR,
                                           TMA_BARRIER_PADDING_ATTR, TMA_BARRIER_PADDINGS, WIDE_INDICES_ATTR)

PIPELINE = "tvmflash"
# The buffers of varlen's sequence offsets (``program.varlen_arguments``): read once a kernel
# (``uniformity.BindBlockUniformLoads``).
SEQUENCE_OFFSETS = ("CuSeqlensQ", "CuSeqlensK")
# A BlockMask's lists (``program_block_sparse.SPARSE_ARGUMENTS``; a test holds the two equal): a block's counts
# read once a kernel (``uniformity.BindBlockUniformLoads``), the tile a step visits once a step
# (``uniformity.BindStepLoads``).
BLOCK_LISTS = ("KvCounts", "KvIndices", "QCounts", "QIndices")
BLOCK_COUNTS = ("KvCounts", "QCounts")


def options(mod: tvm.IRModule) -> dict:
    """The build options that the module's PrimFuncs carry (``build`` sets them)."""
    found = {}
    for func in mod.functions.values():
        for key in (ASYNC_PROXY_OPERANDS_ATTR, HOIST_BLOCK_INDEX_CONDITIONS_ATTR, WIDE_INDICES_ATTR):
            if func.attrs is not None and key in func.attrs:
                found[key] = bool(func.attrs[key])
    return found


def passes_for(mod: tvm.IRModule, config) -> list:
    """The pass list for ``mod`` under the current PassContext's ``config``."""
    opts = options(mod)
    pipeline = [
        loops_and_blocks.ReverseLoops(),                             # +
        loops_and_blocks.RunBlocksIf(),                              # +
        s_tir.transform.CanonicalizeLoop(),
        s_tir.transform.LowerCrossThreadReduction(),
        s_tir.transform.LowerInitBlock(),
        s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
        s_tir.transform.ConvertBlocksToOpaque(),
        s_tir.transform.LiftThreadBinding(),
        s_tir.transform.ManifestSharedMemoryLocalStage(),
        s_tir.transform.CompactBufferAllocation(),
        s_tir.transform.LowerAutoCopy(),
        s_tir.transform.UnifyThreadBinding(),
        s_tir.transform.LowerMatchBuffer(),
        s_tir.transform.StmtSimplify(),
        tvm_fixes.CompactAgainAfterMatchBuffers(),                   # fix
        s_tir.transform.InjectPermutedLayout(),
        s_tir.transform.AnnotateIrregularLoop(),
        loops_and_blocks.BindLoadedPipelineExtents(),                # + (decode's per-sequence tile loop)
        s_tir.transform.InjectSoftwarePipeline(),
        tma_copies.LowerToTMA(),                                     # +
        s_tir.transform.TransformMmaBufferLayout(),
        s_tir.transform.LowerOpaqueBlock(),
        uniformity.MergeAdjacentGuards(),                            # + (a pipeline's epilogue)
        uniformity.BindBlockUniformLoads(SEQUENCE_OFFSETS + BLOCK_COUNTS),  # +
        uniformity.BindLoadedDivisors(SEQUENCE_OFFSETS + BLOCK_COUNTS),  # + (varlen dkdv's Q block count)
        uniformity.BindStepLoads(BLOCK_LISTS),                       # + (a BlockMask's tile, once a step)
        pragmas.LowerPragmas(),                                      # +
        tirx.transform.FlattenBuffer(),
        cpu_padding.VersionPaddedLoads(),                            # + (llvm: a branch an element of a padded tile)
        amx_config.OneTileConfigPerTask(),                           # + (llvm: AMX's ldtilecfg once a task)
        tirx.transform.BF16ComputeLegalize(),
        tirx.transform.NarrowDataType(32),
        s_tir.transform.LoopPartition(),
        cpu_exp2.PolynomialExp2OnCPU(),                              # + (llvm: a vector exp2 was libm calls)
        tirx.transform.VectorizeLoop(not bool(config.get("tirx.disable_vectorize", False))),
    ]
    if opts.get(WIDE_INDICES_ATTR):
        pipeline.append(wide_indices.WidenGlobalIndices())           # + (tensors of 2**31 elements or more)
    pipeline += [
        s_tir.transform.InjectVirtualThread(),
        s_tir.transform.InjectDoubleBuffer(),
    ]
    if not bool(config.get("tirx.disable_storage_rewrite", False)):
        pipeline.append(tirx.transform.StorageRewrite())
    # fix: no LowerAsyncDMA, which TVM's list runs under tirx.use_async_copy. It lowers a pipeline's async
    # copy to Hexagon's dma_copy where the copy is one contiguous range (CUDA has no dma_copy) and leaves
    # every other copy to InjectPTXAsyncCopy: it changed none of our CUDA modules, and took 0.06-0.3 s of each
    # one's build (an analyzer over every loop).
    pipeline += [
        uniformity.HoistBlockIndexConditions() if opts.get(HOIST_BLOCK_INDEX_CONDITIONS_ATTR)  # +, sm90
        else s_tir.transform.HoistIfThenElse(),
        tirx.transform.UnrollLoop(),
        s_tir.transform.RenormalizeSplitPattern(),
        tirx.transform.StmtSimplify(),
        tirx.transform.RemoveNoOp(),
        s_tir.transform.RewriteUnsafeSelect(),
    ]
    if bool(config.get("tirx.instrument_bound_checkers", False)):
        pipeline.append(s_tir.transform.InstrumentBoundCheckers())
    if bool(config.get("tirx.s_tir.ldg32", False)):
        pipeline.append(s_tir.transform.InjectPTXLDG32(True))
    pipeline.append(philox.LowerPhilox())                             # + (dropout's bits, after the simplifiers)
    if not bool(config.get("tirx.disable_cse_tir", False)):
        pipeline += [uniformity.UniformWarpgroupDescriptors(),      # + (before CSE shares the offsets)
                     tirx.transform.CommonSubexprElim()]
    if bool(config.get("tirx.instrument_lwp", False)):
        pipeline.append(s_tir.transform.InstrumentProfileIntrinsics())
    pipeline += [
        tirx.transform.FP8ComputeLegalize(),
        s_tir.transform.VerifyVTCMLimit(),
        s_tir.transform.LowerVtcmAlloc(),
        tirx.transform.VerifyMemory(),
        tirx.transform.AnnotateEntryFunc(),
        s_tir.transform.ThreadSync("shared"),
        s_tir.transform.ThreadSync("shared.dyn"),
        cp_async_barriers.OneBarrierPerPipelinedStep(),              # +
        double_buffers.DoubleBuffers(),                              # + (sm90 dkdv's dsᵀ)
        # fix: no ThreadSync("warp"). The barriers it plans for "warp"-scope buffers are never emitted
        # for CUDA (those buffers become registers), but in TVM 0.27 it aborts a build whose mma
        # accumulator rescale sits under a block-uniform guard ("Cannot insert syncs inside
        # condition"), as InjectSoftwarePipeline writes around the epilogue of a pipeline over the
        # symbolic number of K/V tiles.
        tma_producer_warpgroup.NameConsumerBarriers(),               # + (after the last ThreadSync)
        s_tir.transform.InferFragment(),
        s_tir.transform.LowerThreadAllreduce(),
    ]
    if bool(config.get("tirx.use_async_copy", False)):
        pipeline.append(s_tir.transform.InjectPTXAsyncCopy())
    if bool(config.get("tirx.s_tir.ldg32", False)):
        pipeline.append(s_tir.transform.InjectPTXLDG32())
    pipeline += [
        s_tir.transform.MergeSharedMemoryAllocations(),
        tile_alignment.CheckTileAlignment(),                         # + (where the tiles landed; see build)
        # (after the merge, which rewrites the pointers of TVM's own cp.async but not of a call of ours)
        tvm_fixes.ZeroFillingCpAsync(),                              # fix
        tvm_fixes.ConstantAsyncWaitCounts(proxy_fence=opts.get(ASYNC_PROXY_OPERANDS_ATTR, False)),  # fix
        tirx.transform.SplitHostDevice(),
        tvm_fixes.LaunchBoundsOnKernels(),                           # fix
        tirx.transform.MakePackedAPI(),
        tirx.transform.FP8StorageLegalize(),
        tirx.transform.BF16StorageLegalize(),
    ]
    return pipeline


def _finalize_host_passes():
    return tvm.transform.Sequential([tirx.transform.LowerTVMBuiltin(), tirx.transform.LowerIntrin()])


def _finalize_device_passes():
    return tvm.transform.Sequential([
        tvm_fixes.LowerWarpMemoryToFixpoint(),                       # fix
        tirx.transform.StmtSimplify(),
        tirx.transform.LowerIntrin(),
    ])


def _factory():
    @tvm.transform.module_pass(opt_level=0, name="tvmflash.Pipeline")
    def run(mod, _ctx):
        return tvm.transform.Sequential(passes_for(mod, tvm.transform.PassContext.current().config))(mod)
    return run, _finalize_host_passes, _finalize_device_passes


tirx.register_tir_pipeline(PIPELINE, _factory)  # TVM's extension point for a pipeline of one's own


def build(mod: tvm.IRModule, target: tvm.target.Target, *, pass_config: dict | None = None,
          async_proxy_operands: bool = False, hoist_block_index_conditions: bool = False,
          wide_indices: bool = False):
    """``tvm.compile`` a scheduled module through this pipeline.

    pass_config: the PassContext config (the schedule's, ``Schedule.build_options``). async_proxy_operands: the
    tensor-core operands are read through the async proxy (wgmma), so each cp.async wait is followed
    by a proxy fence. hoist_block_index_conditions: ``uniformity.HoistBlockIndexConditions`` instead
    of TVM's HoistIfThenElse. wide_indices: global buffers are indexed in int64
    (``wide_indices.WidenGlobalIndices``), for tensors of 2**31 elements or more. A TMA build whose
    tiles ``tile_alignment.CheckTileAlignment`` finds off the swizzle's 1024-byte boundary is built
    again with larger barriers (``TMA_BARRIER_PADDINGS``), and raises ``tile_alignment.MisalignedTiles``
    if none fits.
    """
    def with_options(func, padding):
        func = (func.with_attr(ASYNC_PROXY_OPERANDS_ATTR, async_proxy_operands)
                .with_attr(HOIST_BLOCK_INDEX_CONDITIONS_ATTR, hoist_block_index_conditions)
                .with_attr(TMA_BARRIER_PADDING_ATTR, padding))
        return func.with_attr(WIDE_INDICES_ATTR, True) if wide_indices else func

    paddings = list(TMA_BARRIER_PADDINGS)
    misaligned = None
    try:
        while paddings:  # until the TMA tiles sit on 1024-byte boundaries (one try, mostly)
            padding = paddings.pop(0)
            optioned = tvm.IRModule({gvar: with_options(func, padding) for gvar, func in mod.functions.items()})
            with tvm.transform.PassContext(opt_level=3, config=pass_config or {}):
                try:
                    return tvm.compile(optioned, target=target, tir_pipeline=PIPELINE)
                except tile_alignment.MisalignedTiles as err:
                    misaligned = err
            # The barriers come first in shared memory, so padding them moves every tile by as much: the
            # padding that puts the misaligned tile on its boundary goes next (varlen's sm90 forward with
            # ALiBi needed 512: it was built three times, 0 and 256 each a whole lowering)
            wanted = None if misaligned.shortfall is None else padding + misaligned.shortfall
            if wanted in paddings:
                paddings.remove(wanted)
                paddings.insert(0, wanted)
        raise misaligned
    finally:
        # the error's traceback holds this frame, and so every caller's frame (a training step's tensors):
        # a reference cycle, once this frame holds the error, that only a full collection would free
        misaligned = None
