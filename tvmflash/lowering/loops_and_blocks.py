"""Passes on the scheduled loops and blocks, before they are lowered: what the schedules and the program
ask of them through annotations (``annotations.REVERSED``, ``annotations.RUNS_IF``), and a pipelined
loop's trip count read from memory bound to a variable for InjectSoftwarePipeline."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.script import tirx as T

from tvmflash.lowering.annotations import REVERSED, RUNS_IF
from tvmflash.lowering.ir import LOAD, find, prim_func_pass, substitute


# ---------------------------------------------------------------------------------- reversed loops
def _reversed(loop):
    if REVERSED not in loop.annotations:
        return loop
    old = loop.loop_var
    new = type(old)(old.name, old.ty)
    flipped = loop.min + loop.extent - 1 - new
    body = substitute(loop.body, [(old, flipped)])
    annotations = {key: value for key, value in loop.annotations.items() if key != REVERSED}
    return tirx.For(new, loop.min, loop.extent, loop.kind, body, loop.thread_binding, annotations)


def ReverseLoops():  # noqa: N802 - named as TVM's passes are
    """Each loop annotated ``REVERSED`` visits its iterations last to first: its variable i becomes
    min + extent - 1 - i in the body. The schedules use it on a loop bound to blockIdx, whose
    iterations are independent thread blocks, to choose the order the GPU starts them in. TensorIR's
    Schedule has no primitive that reverses a loop."""
    return prim_func_pass(lambda func: func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, _reversed))),
                          "tvmflash.ReverseLoops")


# ---------------------------------------------------------------------------------- guarded blocks
def _run_if(block):
    if RUNS_IF not in block.annotations:
        return block
    annotations = {key: value for key, value in block.annotations.items() if key != RUNS_IF}
    # the same for every thread of the block: ThreadSync then places barriers under it
    uniform = T.tvm_thread_invariant(block.annotations[RUNS_IF])
    return tvm.s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint,
                            tirx.IfThenElse(uniform, block.body, None), block.init, block.alloc_buffers,
                            block.match_buffers, annotations)


def RunBlocksIf():  # noqa: N802
    """Before the blocks are lowered: a block annotated ``RUNS_IF`` (by the program) runs its body only
    where that condition of its iteration variables holds. On a GPU the block is a thread block, so
    the test is uniform: varlen's Q blocks past their own sequence's end return at once instead of
    loading a Q block of zeros and running a masked K/V tile."""
    def run(func):
        return func.with_body(tvm_ffi.structural_map(func.body, (tvm.s_tir.SBlock, _run_if)))
    return prim_func_pass(run, "tvmflash.RunBlocksIf")


# ---------------------------------------------------------------------------------- loaded extents
def _extent_bound(loop):
    """A pipelined loop whose extent reads a buffer, as that value bound to a variable first."""
    if "software_pipeline_stage" not in loop.annotations or not find(loop.extent, LOAD):
        return loop
    # A constant floor stays in sight: the program's max(min_kv_tiles, count) keeps the pipeline's
    # epilogue unguarded (``sm90.min_kv_tiles``); under a guard, varlen's sm90 wgmma spilled registers.
    floor, counted = None, loop.extent
    if isinstance(loop.extent, tirx.Max):
        for a, b in ((loop.extent.a, loop.extent.b), (loop.extent.b, loop.extent.a)):
            if isinstance(a, tirx.IntImm):
                floor, counted = a, b
                break
    bound = tirx.Var(f"{loop.loop_var.name}_extent", loop.extent.ty)
    extent = bound if floor is None else tirx.Max(floor, bound)
    return tirx.SeqStmt([tirx.Bind(bound, counted),
                         tirx.For(loop.loop_var, loop.min, extent, loop.kind, loop.body, loop.thread_binding,
                                  loop.annotations)])


def BindLoadedPipelineExtents():  # noqa: N802
    """Before InjectSoftwarePipeline: a pipelined loop whose trip count is read from memory (decode's
    K/V loop runs over its sequence's tiles, from ``cache_seqlens``) gets it bound to a variable first.
    The pipeline's guards (``kb + 1 < extent`` in a loop of extent - 1 steps) then simplify as over
    any symbolic extent; over the buffer load they did not, and the cp.async wait count was left an
    ``if_then_else``, which the CUDA code generator rejects. Loops with other extents are untouched."""
    return prim_func_pass(lambda func: func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, _extent_bound))),
                          "tvmflash.BindLoadedPipelineExtents")
